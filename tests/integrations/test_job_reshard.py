"""Three live models of one IR job (actor and critic trained with AdamW, the frozen reference),
each under its own layout, moved together by one transition (``reshard_job``): continuity is the
test, per model.

Plan A: actor TP 2 x DP 2, critic 2 pipeline stages x DP 2, reference TP 2 on GPUs 2-3. Plan
B: actor DP 4, critic TP 2 on GPUs 2-3, reference DP 2 on GPUs 0-1. Right after the move every
rank holds, for every model, bit for bit what gathering plan A's full state and slicing it for
plan B gives (AdamW's steps carried over; the frozen reference has none). Training on matches,
bit for bit, models restarted under plan B from that sliced state; models that never moved
agree to float32 rounding (``STAY_RTOL`` as in test_hf_llama). A plan whose reference layout the
live model cannot take is a diagnostic naming ``ref.infer`` before anything is planned or moved.
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("transformers")

from nereus.runtime.launch import run_local

from . import job_workers as jw
from .test_hf_llama import STAY_RTOL


@pytest.fixture(scope="module")
def results():
    return run_local(jw.continuity, 4, timeout=240)


def test_a_layout_the_reference_cannot_take_is_a_diagnostic_before_anything_moves(results):
    for res in results:
        assert "ref.infer" in res["diagnostic"] and "tp = 4 does not divide kv_heads = 2" in res["diagnostic"], res
        assert "actor.train" not in res["diagnostic"] and "critic.train" not in res["diagnostic"]
        assert res["nothing_planned"] and res["intact"]


def test_every_model_lands_bit_exact_in_plan_b(results):
    for rank, res in enumerate(results):
        assert res["same_keys"] and res["exact"] == [], (rank, res["exact"])
        held, steps_b = res["steps"]
        assert held == {jw.ACTOR: 2, jw.CRITIC: 2, jw.REF: 0}
        keys = {ms for ms, _ in res["keys"]}
        # plan B: the critic only on GPUs 2-3, the reference only on 0-1, the actor everywhere
        assert keys == {jw.ACTOR, jw.CRITIC if rank >= 2 else jw.REF}, (rank, keys)
        for ms in keys:
            assert steps_b[ms] == held[ms], (rank, ms, steps_b)
        states = {st for ms, st in res["keys"] if ms == jw.ACTOR}
        assert states == {"weight", "master", "exp_avg", "exp_avg_sq"}
        assert {st for ms, st in res["keys"] if ms == jw.REF} <= {"weight"}


def test_training_on_matches_a_restart_from_the_sliced_state_bit_for_bit(results):
    for res in results:
        assert res["moved"] == res["restart"], res
        assert any(v is not None for s in res["moved"] for v in s.values())


def test_models_that_never_moved_agree_to_float32_rounding(results):
    for res in results:
        for moved, stay in zip(res["moved"], res["stay"]):
            for ms, v in moved.items():
                if v is not None and stay[ms] is not None:
                    assert math.isclose(v, stay[ms], rel_tol=STAY_RTOL, abs_tol=1e-6), (ms, v, stay[ms])


@pytest.fixture(scope="module", params=["in", "out"])
def fsdp(request):
    """FSDP2 in (the actor DDP under TP 2 x DP 2 -> FSDP2 with TP, 2-D) and out (FSDP2 over DP 4 ->
    DDP under TP 2 x DP 2), the critic and the reference moved with it."""
    return request.param, run_local(jw.continuity, 4, 2, 2, request.param, timeout=240)


def test_a_zero_stage_fsdp2_does_not_run_is_a_diagnostic_before_anything_moves(fsdp):
    for res in fsdp[1]:
        d = res["diagnostic"]
        assert "plan @bad actor.train: zero = 2" in d, d
        assert "plan @bad critic.train: zero = 3: score.weight has 1 rows per TP shard" in d, d
        assert res["nothing_planned"] and res["intact"]


def test_fsdp2_shards_land_bit_exact_where_the_ir_puts_them(fsdp):
    kind, results = fsdp
    for rank, res in enumerate(results):
        assert res["same_keys"] and res["exact"] == [], (rank, res["exact"])
        if kind != "in":
            continue
        # ZeRO-3 over DP 2 of TP 2 shards, rank = (d, t): q_proj (TP along dim 0) holds half d of TP
        # shard t (FSDP2's _StridedShard: TP first); o_proj (TP along dim 1) half d of its rows
        d, t = divmod(rank, 2)
        boxes = {(st, name): (shape, box) for ms, st, name, shape, box in res["b_specs"] if ms == jw.ACTOR}
        assert {st for st, _ in boxes} == {"weight", "master", "exp_avg", "exp_avg_sq"}
        for st in ("weight", "exp_avg"):
            (n, m), box = boxes[(st, "layers.0.self_attn.q_proj.weight")]
            assert box == ((t * n // 2 + d * n // 4, t * n // 2 + (d + 1) * n // 4), (0, m)), box
            (n, m), box = boxes[(st, "layers.0.self_attn.o_proj.weight")]
            assert box == ((d * n // 2, (d + 1) * n // 2), (t * m // 2, (t + 1) * m // 2)), box


def test_training_under_fsdp2_matches_a_restart_from_the_sliced_state_bit_for_bit(fsdp):
    for res in fsdp[1]:
        assert res["moved"] == res["restart"], res
        assert any(v is not None for s in res["moved"] for v in s.values())


def test_fsdp2_and_ddp_runs_agree_to_float32_rounding(fsdp):
    for res in fsdp[1]:
        for moved, stay in zip(res["moved"], res["stay"]):
            for ms, v in moved.items():
                if v is not None and stay[ms] is not None:
                    assert math.isclose(v, stay[ms], rel_tol=STAY_RTOL, abs_tol=1e-6), (ms, v, stay[ms])
