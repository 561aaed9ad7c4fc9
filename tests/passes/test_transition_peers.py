"""The peers' model in ``nereus bench transition``, on cases small enough to compute by hand.

The model (``nereus/testing/cases.py``'s Llama-style job at hidden 64, 2 layers, vocab 256):
heads 16, kv_heads 4 (k and v have 16 rows), ffn 176. Trained state per parameter: bf16 weight
(2 bytes), fp32 master, exp_avg and exp_avg_sq (4 each): 14 bytes.

Parameters by how TP splits them:
- split (column, row or vocab), per layer: q 64x64 + k 16x64 + v 16x64 + o 64x64
  + gate 176x64 + up 176x64 + down 64x176 = 4096 + 1024 + 1024 + 4096 + 3 x 11264 = 44,032;
  embed_tokens and lm_head 256x64 = 16,384 each;
- replicated: input_layernorm and post_attention_layernorm 64 per layer, the final norm 64.
"""

from __future__ import annotations

import pytest

from nereus.bench.transition_bench import peers
from nereus.ir import parse
from nereus.passes import run_pipeline
from nereus.testing.cases import job_text

PER_PARAM = 2 + 4 + 4 + 4
SPLIT_LAYER = 4096 + 1024 + 1024 + 4096 + 3 * 11264  # 44,032
NORMS_LAYER = 2 * 64
EMBED = LM_HEAD = 256 * 64
NORM = 64
SPLIT = 2 * SPLIT_LAYER + EMBED + LM_HEAD  # 120,832
ALL = SPLIT + 2 * NORMS_LAYER + NORM  # 121,152
NVLINK = 450e9 * 0.7  # the job's links x the default efficiencies
NIC = 50e9 * 0.7
STORAGE = 400e9


def module(a, b, nodes: int = 1):
    """Plans a and b, each (tp, pp, dp, mesh, zero), of a 2-GPU train job on ``nodes`` nodes."""
    text = job_text(2, "train", a, b, layers=2, hidden=64, vocab=256)
    if nodes == 2:
        text = text.replace("nodes = 1\n  gpus_per_node = 2", "nodes = 2\n  gpus_per_node = 1")
    return run_pipeline(parse(text), "derive-emus{plan=@a},derive-emus{plan=@b}")


def test_tp2_to_tp1_on_one_node():
    """TP 2 -> TP 1 x DP 2 on GPUs 0 and 1 of one node: each GPU lacks the other half of every split
    tensor, both layers, and holds every replicated one."""
    costs = peers(module((2, 1, 1, [0, 1], 0), (1, 1, 2, [0, 1], 0)), "a", "b")
    half = SPLIT // 2 * PER_PARAM  # 845,824 bytes each GPU lacks
    ag = costs["all-gather + slice"]
    assert (ag.bytes, ag.nvlink_bytes, ag.nic_bytes) == (2 * half, 2 * half, 0) == (1_691_648, 1_691_648, 0)
    assert ag.seconds == pytest.approx(half / NVLINK)  # each GPU receives (and sends) half
    # GPU 0 (plan A's rank 0) receives GPU 1's half, then sends the whole state to GPU 1
    gb = costs["gather + broadcast"]
    whole = ALL * PER_PARAM  # 1,696,128
    assert gb.bytes == half + whole == 2_541_952 and gb.nic_bytes == 0
    assert gb.seconds == pytest.approx(whole / NVLINK)
    # DCP: the whole state written once (the replicated norms once, not twice), read by both GPUs;
    # a GPU writes its half of the split tensors and some of the norms through its NIC
    dcp = costs["DCP save + load"]
    assert dcp.bytes == 3 * whole == 5_088_384
    write_lo, write_hi = half / NIC, (half + (2 * NORMS_LAYER + NORM) * PER_PARAM) / NIC
    assert write_lo + whole / NIC <= dcp.seconds <= write_hi + whole / NIC


def test_per_layer_and_across_nodes():
    """One GPU -> PP 2 on two one-GPU nodes: GPU 1 joins and needs layer 1, the final norm and
    lm_head, all over the NIC; GPU 0 keeps what it has. Only the layer it needs is gathered, not
    the family across both layers (which the old model charged)."""
    costs = peers(module((1, 1, 1, [0], 0), (1, 2, 1, [0, 1], 0), nodes=2), "a", "b")
    stage1 = (SPLIT_LAYER + NORMS_LAYER + NORM + LM_HEAD) * PER_PARAM  # 848,512
    whole = ALL * PER_PARAM
    ag = costs["all-gather + slice"]
    assert (ag.bytes, ag.nvlink_bytes, ag.nic_bytes) == (stage1, 0, stage1) == (848_512, 0, 848_512)
    assert ag.seconds == pytest.approx(stage1 / NIC)
    gb = costs["gather + broadcast"]  # GPU 0 holds everything: nothing to gather, the whole state to GPU 1
    assert (gb.bytes, gb.nic_bytes) == (whole, whole) and gb.seconds == pytest.approx(whole / NIC)
    dcp = costs["DCP save + load"]  # GPU 0 writes it all; each GPU reads its stage
    assert dcp.bytes == 2 * whole
    assert dcp.seconds == pytest.approx(whole / NIC + stage1 / NIC)


def test_zero1_shards_are_all_written_and_gathered():
    """DP 2 under ZeRO-1 (optimizer state sharded over DP), the GPUs swapped: DCP writes every
    distinct piece once (both DP ranks' optimizer shards, the replicated weights once); all-gather
    moves the optimizer half each GPU lacks and no weights (held whole)."""
    costs = peers(module((1, 1, 2, [0, 1], 1), (1, 1, 2, [1, 0], 1)), "a", "b")
    weights, optimizer = ALL * 2, ALL * 12
    dcp = costs["DCP save + load"]
    assert dcp.bytes == (weights + optimizer) + (2 * weights + optimizer) == 3_634_560
    assert costs["all-gather + slice"].bytes == optimizer == 1_453_824


def test_unchanged_model_stage_moves_nothing():
    costs = peers(module((2, 1, 1, [0, 1], 0), (2, 1, 1, [0, 1], 0)), "a", "b")
    assert all(c.bytes == 0 and c.seconds == 0 for c in costs.values())
