"""A mixture of experts trained with expert parallelism and moved live between EP layouts.

A tiny Hugging Face Qwen3-MoE trains on 4 gloo processes with its experts split EP 4 (tokens
dispatched to their experts by ``all_to_all_single``), then one Nereus transition moves its
weights and Adam state to EP 2 x expert-DP 2 and training goes on. Checked: every expert's
weights and Adam moments after the move are bit-identical to the gathered full tensors resliced,
the dense layers untouched; the bytes sent are the planned ones; and the losses before and after
the move follow the unsplit model trained on the whole global batch in one process. The trained
weights are then pushed from the EP layout into a trainer-side generation model on every rank
(every expert whole), bit-exact, serving the EP model's log-probabilities."""

from __future__ import annotations

import pytest

from nereus.runtime.launch import run_local

from . import moe_ep_workers as w

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def results():
    return run_local(w.train_and_move, 4, timeout=300)


def test_experts_land_bit_exact_on_their_new_ep_ranks(results):
    assert [r["problems"] for r in results] == [[]] * 4
    assert [r["ep_rank"] for r in results] == [0, 1, 0, 1]  # EP 2 x expert-DP 2


def test_the_move_sends_the_planned_bytes_and_only_experts_move(results):
    moved = [r["moved"] for r in results]
    assert [x["sent"] for x in moved] == [x["planned"] for x in moved]
    assert sum(x["sent"] for x in moved) == moved[0]["bytes_moved"] > 0


def test_losses_follow_the_unsplit_model_through_the_move(results):
    losses, ref = results[0]["losses"], results[0]["ref"]
    assert all(r["losses"] == losses for r in results)  # one global loss, the same on every rank
    assert losses == pytest.approx(ref, rel=1e-5, abs=1e-6)
    assert losses[-1] < losses[0]  # it trains


def test_the_ep_trained_weights_push_into_generation_and_serve_the_same_logprobs(results):
    pushed = [r["pushed"] for r in results]
    assert [p["wrong"] for p in pushed] == [[]] * 4
    inventory = 3 + 2 * (9 + 3 * w.CONFIG["num_experts"])  # embed, norm, head; per layer: 9 dense + 3 per expert
    assert {p["tensors"] for p in pushed} == {inventory}
    assert all(p["received"] > 0 for p in pushed)  # no rank held every expert
    assert max(p["gap"] for p in pushed) < 1e-5
