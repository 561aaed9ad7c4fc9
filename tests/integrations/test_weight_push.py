"""The weight push from an FSDP2 trainer (ZeRO-3, alone and under TP): each DP group gathers
its weights, then the push program delivers every tensor whole to the engine ranks, bit-equal
to torch's own ``full_tensor`` of each parameter, after every optimizer step."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from nereus.runtime.launch import run_local  # noqa: E402

from . import push_workers as w  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("tp,engines", [(2, [1, 2, 3])])
def test_a_push_from_an_fsdp2_trainer_delivers_every_weight_whole_and_exact(tp, engines):
    results = run_local(w.push_from_fsdp, 4, tp, engines, timeout=180)
    for res in results:
        assert res["gather_dp"]
        for push in res["pushes"]:
            if res["rank"] in engines:
                assert push["names"] and push["exact"], (res["rank"], push)
                # the gather over DP left every TP shard whole: the push brings the other TP ranks' shards
                assert 0 < push["received"] < res["full_bytes"], push
            else:
                assert push["names"] is None and push["received"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("tp,zero", [(2, 0), (1, 3)])
def test_recompute_runs_each_layer_twice_and_trains_bit_identically(tp, zero):
    """The IR's ``recompute`` in the live model (per-layer activation checkpointing, under DDP + TP
    and under FSDP2): decoder layers run forward again in the backward, and the losses and the
    weights after three AdamW steps equal those without it, bit for bit."""
    for res in run_local(w.recompute_twins, 4, tp, zero, timeout=180):
        assert res["forwards"] == (1, 2), res
        assert res["same_losses"] and res["same_params"], res


@pytest.mark.slow
def test_a_plain_fsdp2_model_on_a_one_dimensional_mesh_pushes_every_weight_whole_and_exact():
    """The TRL sync's path (``state_of_params``) from FSDP2 as accelerate shards a model: every
    parameter a DTensor over one unnamed mesh dimension, gathered whole before the push."""
    results = run_local(w.push_from_plain_fsdp, 2, timeout=180)
    for res in results:
        assert res["sharded"] and res["names"] and res["exact"], res
        assert res["received"] == 0, res  # the gather made every weight whole: the push moves nothing more
