"""A real model under PyTorch's own parallelism, moved by Nereus: continuity is the test.

A tiny seeded ``LlamaForCausalLM`` (2 layers, hidden 64, 4 heads) trains with AdamW under plan A
(TP by ``parallelize_module``, DP by a gradient all-reduce) on gloo processes, moves to plan B
with plan-transition -> lower -> execute, and must then hold, bit for bit, what gathering plan
A's full state on one process and slicing it for plan B gives; training on must match, bit for
bit, a model restarted under plan B from that sliced state. A model that never moved agrees only
to float32 rounding (``STAY_RTOL``). A failed transition leaves plan A's model and optimizer as
they were, and a layout the live model cannot take is a diagnostic before anything moves.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("transformers")  # the ``hf`` extra

from transformers import LlamaConfig

from nereus.backend.shards import plan_layout
from nereus.integrations.hf_llama import ir_model, llama_config
from nereus.integrations.job import layout, training_job
from nereus.integrations.llama_state import check_layout
from nereus.ir import DiagnosticError
from nereus.runtime.launch import run_local

from . import workers as w

# Plan A and plan B sum in different orders (TP all-reduces partial products over 2 ranks or
# none, DP averages two half-batch means instead of one mean), so a run that never moved differs
# from the moved one by float32 rounding: one ulp of the loss (1.2e-7 relative) per reduction,
# carried through a few AdamW steps. Observed: 0 to 1e-7 relative; allowed: 1e-5 (about 100
# ulps). This bounds the drift only; what catches a misplaced shard are the bit-exact checks.
STAY_RTOL = 1e-5


def full_from(shards_of_ranks: list[dict], job, plan: str) -> dict[str, np.ndarray]:
    """Plan A's full tensors, assembled on this (one) process from every rank's shards; where
    two ranks hold the same element (DP replicas, norms under TP), they must agree bit for bit."""
    full: dict[str, np.ndarray] = {}
    for rank, shards in enumerate(shards_of_ranks):
        specs = plan_layout(job, plan)[rank]
        assert sorted(shards) == sorted(str(s.key) for s in specs), f"rank {rank} exports other keys than plan @{plan}"
        for s in specs:
            region = tuple(slice(lo, hi) for lo, hi in s.box)
            t = full.setdefault(str(s.key), np.full(s.shape, np.nan, dtype=np.float32))
            held = t[region]
            seen = ~np.isnan(held)
            assert np.array_equal(held[seen], shards[str(s.key)][seen]), f"rank {rank}: replicas of {s.key} differ"
            t[region] = shards[str(s.key)]
    for key, t in full.items():
        assert not np.isnan(t).any(), f"{key}: no rank holds some of it"
        if ":master:" in key:
            assert np.array_equal(t, full[key.replace(":master:", ":weight:")]), key
    return full


K, N = 3, 2  # AdamW steps under plan A, then under plan B


@pytest.fixture(scope="module")
def tp2_to_dp2():
    """One launch of 2 processes: TP 2 -> DP 2, then the rollback checks on plan A's model
    (plan @bad: TP 4 over 2 K/V heads, which the live model cannot take)."""
    return run_local(w.continuity, 2, w.tiny(2), (2, 1), (1, 2), K, N, (4, 1), timeout=300)


def check_continuity(results, cfg, a, b):
    world = len(results)
    _, job = w.job_of(cfg, {"a": a, "b": b}, world)

    # every rank's plan-B state == plan A's full state, gathered on this process, sliced for plan B
    full = full_from([r["a"] for r in results], job, "a")
    seen = set()
    for r in results:  # the shards' keys and boxes agree with what DTensor itself gathers
        seen |= set(r["dtensor_full"])
        for key, t in r["dtensor_full"].items():
            assert t.tobytes() == full[key].tobytes(), key
    assert seen == {key for key in full if ":master:" not in key}
    for rank, r in enumerate(results):
        specs = plan_layout(job, "b")[rank]
        assert sorted(r["b"]) == sorted(str(s.key) for s in specs)
        for s in specs:
            want = full[str(s.key)][tuple(slice(lo, hi) for lo, hi in s.box)]
            assert r["b"][str(s.key)].tobytes() == want.tobytes(), f"rank {rank}: {s.key}"
        assert r["step_a"] == r["step_b"] == K

    # and training goes on bit-identically to a model restarted from that sliced state ...
    losses = results[0]["moved"]
    for r in results:
        assert r["losses_a"] == results[0]["losses_a"]
        assert r["moved"] == r["restart"] == losses
        assert r["end_differs"] == [] and r["end_steps"] == (K + N, K + N)
    # ... and within float32 rounding of the model that never moved
    for moved, stay in zip(losses, results[0]["stay"]):
        assert math.isclose(moved, stay, rel_tol=STAY_RTOL), (losses, results[0]["stay"])


@pytest.mark.slow
def test_tp2_to_dp2_continues_bit_identically(tp2_to_dp2):
    check_continuity(tp2_to_dp2, w.tiny(2), (2, 1), (1, 2))


@pytest.mark.slow
def test_tp2x2_to_tp4_continues_bit_identically_then_two_ranks_leave():
    cfg = w.tiny(4)  # 4 K/V heads: TP 4 keeps whole heads
    c = (2, 1, [2, 3])  # then TP 2 on GPUs 2 and 3: ranks 0 and 1 leave, sending what they hold
    results = run_local(w.continuity, 4, cfg, (2, 2), (4, 1), K, N, None, c, timeout=300)
    check_continuity(results, cfg, (2, 2), (4, 1))
    _, job = w.job_of(cfg, {"a": (2, 2), "b": (4, 1), "c": c}, 4)
    full = full_from([r["b_end"] for r in results], job, "b")
    assert [r["in_c"] for r in results] == [False, False, True, True]
    for rank, r in enumerate(results):
        specs = plan_layout(job, "c").get(rank, [])
        assert sorted(r["c"]) == sorted(str(s.key) for s in specs)
        for s in specs:
            assert r["c"][str(s.key)].tobytes() == full[str(s.key)][tuple(slice(lo, hi) for lo, hi in s.box)].tobytes()
    assert results[2]["step_c"] == K + N and results[2]["loss_c"] == results[3]["loss_c"]


@pytest.mark.slow
def test_pp2xtp2_to_tp2xdp2_continues_bit_identically():
    """Pipeline stages (PipelineStage, Schedule1F1B over 2 micro-batches) with TP inside each, to
    TP 2 x DDP 2: layer 1, the norm and the LM head move from stage 1 to replica 0's ranks, and
    every rank of replica 1 receives its whole stage-0 complement."""
    cfg = w.tiny(4)
    a, b = (2, 1, None, 2), (2, 2)
    results = run_local(w.continuity, 4, cfg, a, b, K, N, timeout=300)
    check_continuity(results, cfg, a, b)


@pytest.mark.slow
def test_pp2xdp2_to_tp4_continues_bit_identically():
    """Pipeline stages under DDP (2 replicas of 2 stages; the replicas must stay identical, which
    ``full_from`` checks) to TP 4."""
    cfg = w.tiny(4)
    a, b = (1, 2, None, 2), (4, 1)
    results = run_local(w.continuity, 4, cfg, a, b, K, N, timeout=300)
    check_continuity(results, cfg, a, b)


@pytest.mark.slow
def test_a_failed_transition_rolls_back_and_training_goes_on(tp2_to_dp2):
    for r in (res["rollback"] for res in tp2_to_dp2):
        # a layout the live model cannot take: a diagnostic, before anything is planned or moves
        assert "tp = 4 does not divide kv_heads = 2" in r["diagnostic"]
        assert r["nothing_planned"]
        # the injected fault on rank 1: every rank raises TransitionError and keeps plan A as it was
        # (on gloo rank 0's receive from rank 1 times out and closes their pair, so the commit
        # agreement cannot name rank 1: failed_ranks is empty and unresponsive is set)
        message, _failed, _unresponsive = r["transition_error"]
        assert "state of plan @a is intact" in message
        assert r["intact"]
        # the next step under plan A is the step of a run that never attempted anything
        assert r["loss_after"] == r["loss_control"]
    assert "injected fault on rank 1" in tp2_to_dp2[1]["rollback"]["transition_error"][0]


TINY = LlamaConfig(**w.tiny(2))


def test_ir_model_and_llama_config_round_trip():
    m = ir_model(TINY)
    assert (m.layers, m.hidden, m.heads, m.kv_heads, m.ffn, m.vocab, m.dtype) == (2, 64, 4, 2, 128, 128, "fp32")
    assert ir_model(llama_config(m)) == m
    with pytest.raises(DiagnosticError, match="bias tensors"):
        ir_model(LlamaConfig(**{**w.tiny(2), "attention_bias": True}))


@pytest.mark.parametrize(
    "tp,dp,pp,zero,kv_heads,vocab,message",
    [
        (4, 1, 1, 0, 2, 128, "tp = 4 does not divide kv_heads = 2"),
        (3, 1, 1, 0, 2, 128, "tp = 3 does not divide heads = 4"),
        (1, 1, 2, 0, 2, 128, "Schedule1F1B needs at least as many micro-batches as pipeline stages"),
        (1, 2, 1, 1, 2, 128, "zero = 1: the adapter.s ZeRO is FSDP2.*ZeRO-1/2 keep them whole"),
        (1, 2, 2, 3, 2, 128, "zero = 3 with pp = 2: FSDP2 under pipeline stages is not built"),
        # 130 vocabulary rows over DP 4: torch.chunk gives 33, 33, 33, 31, the IR 33, 33, 32, 32
        (1, 4, 1, 3, 2, 130, "zero = 3: embed_tokens.weight has 130 rows per TP shard"),
        # 130 rows over 4: tensor_split gives 33, 33, 32, 32; torch.chunk 33, 33, 33, 31
        (4, 1, 1, 0, 4, 130, "is not DTensor's torch.chunk rule"),
    ],
)
def test_layouts_the_live_model_cannot_take_are_diagnostics(tp, dp, pp, zero, kv_heads, vocab, message):
    m = ir_model(LlamaConfig(**{**w.tiny(kv_heads), "vocab_size": vocab}))
    ok = training_job(m, {"a": layout(m, tp=1)}, 4)
    bad = layout(m, tp=tp, dp=dp, pp=pp, micro_batches=1)
    bad.zero = zero
    ok.plans["a"].layouts["actor.train"] = bad  # not verified: tp = 3 is also an IR error
    with pytest.raises(DiagnosticError, match=message):
        check_layout(ok, "a", "actor.train")


def test_expressible_layouts_pass_the_check():
    m = ir_model(TINY)
    job = training_job(
        m, {"a": layout(m, tp=2), "b": layout(m, dp=2), "c": layout(m, tp=2, dp=2), "d": layout(m, tp=2, pp=2)}, 4
    )
    for plan in ("a", "b", "c", "d"):
        check_layout(job, plan, "actor.train")
