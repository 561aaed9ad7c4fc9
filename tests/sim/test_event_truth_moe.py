"""The event truth's mixture of experts (``nereus/sim/truth/experts.py``): what a GPU holds under
expert parallelism, the busiest rank, the dispatcher's links, and decode's expert reads."""

from __future__ import annotations

import numpy as np
import pytest

import nereus
from nereus.ir import Layout, Plan
from nereus.passes.transition.derive_emus import derive_missing_emus
from nereus.sim.truth import stages
from nereus.sim.truth.experts import Experts, even, routing

from ..support.jobs import moe_job


def _plan(m, train: Layout) -> None:
    other = lambda ms: Layout(model_stage=ms, tp=1, pp=1, dp=8, layers=[(0, 3)], mesh=list(range(8)))
    layouts = {"actor.train": train, "actor.generate": other("actor.generate"), "ref.infer": other("ref.infer")}
    m.plans["a"] = Plan(name="a", workload="w", cluster="c", layouts=layouts)
    nereus.verify(m)


@pytest.mark.parametrize(
    "tp, pp, dp, ep, etp, zero, dense",
    [
        (2, 1, 4, 1, None, 1, None),
        (2, 1, 4, 4, 2, 1, None),
        (2, 1, 4, 8, 1, 0, None),
        (1, 1, 8, 8, 1, 1, None),
        (2, 2, 2, 2, 2, 1, None),
        (2, 2, 2, 2, 1, 0, 1),
        (1, 2, 4, 4, 1, 0, 2),
    ],
)
def test_the_fullest_gpus_state_is_what_the_emus_hold(tp, pp, dp, ep, etp, zero, dense):
    """The truth counts its own way (each tensor's slice on EP rank 0, layer by layer); the
    weights and optimizer state it puts on the fullest GPU equal the most any GPU holds by the
    IR's sharding rule. ZeRO's shares: the truth divides evenly, the IR splits each tensor in
    whole elements, so they differ by less than an element (12 bytes) per tensor."""
    m = moe_job(experts=8, expert_ffn=16, layers=4, dense_layers=dense)
    layers = [(0, 3)] if pp == 1 else [(0, 1), (2, 3)]
    mesh = list(range(tp * pp * dp))
    train = Layout(model_stage="actor.train", tp=tp, pp=pp, dp=dp, layers=layers, mesh=mesh, ep=ep, etp=etp, zero=zero)
    _plan(m, train)
    derive_missing_emus(m, "a")
    held: dict[tuple[int, str], int] = {}
    tensors = len(m.models["actor"].tensors) * 4  # an upper bound on the tensors of a GPU (4 layers)
    for emu in m.emus.values():
        if (emu.plan, emu.model_stage) == ("a", "actor.train"):
            for s in emu.shards:
                for e in s.entries:
                    kind = "weights" if e.state == "weight" else "optimizer"
                    held[(s.gpu, kind)] = held.get((s.gpu, kind), 0) + e.numel() * (2 if kind == "weights" else 4)
    truth = stages.state_bytes(m.models["actor"], train, train=True)
    fullest = max({g for g, _ in held}, key=lambda g: held[(g, "weights")] + held.get((g, "optimizer"), 0))
    assert truth["weights"] == held[(fullest, "weights")]
    if zero == 0:
        assert truth["optimizer"] == held[(fullest, "optimizer")]
    else:
        assert abs(truth["optimizer"] - held[(fullest, "optimizer")]) < 12 * tensors


def test_the_busiest_rank_carries_more_than_the_mean_only_under_uneven_routing():
    m = moe_job(experts=8, expert_ffn=16, layers=4)
    md, c = m.models["actor"], m.clusters["c"]
    lay = lambda ep: Layout(
        model_stage="actor.train", tp=1, pp=1, dp=8, layers=[(0, 3)], mesh=list(range(8)), ep=ep, etp=1
    )
    drawn = routing(md, np.random.default_rng(0))
    assert np.allclose(drawn.sum(axis=1), 1.0) and drawn.shape == (4, 8)
    assert Experts(md, lay(4), c, even(md)).load == pytest.approx(1.0)
    assert Experts(md, lay(1), c, drawn).load == pytest.approx(1.0)  # one rank holds every expert
    skewed = Experts(md, lay(4), c, drawn)
    assert skewed.load > 1.0
    # and its experts' GEMMs take longer than the even split's
    assert skewed.gemm_seconds(4096) > Experts(md, lay(4), c, even(md)).gemm_seconds(4096)


def test_an_ep_group_across_nodes_pays_the_nic_and_an_engines_own_ep_moves_nothing_more():
    m = moe_job(experts=8, expert_ffn=16, layers=4)  # 2 nodes of 4 GPUs
    md, c = m.models["actor"], m.clusters["c"]

    def dispatch(ep, etp, mesh, engine=False):
        ms = "actor.generate" if engine else "actor.train"
        lay = Layout(model_stage=ms, tp=2, pp=1, dp=4, layers=[(0, 3)], mesh=mesh, ep=ep, etp=etp)
        return Experts(md, lay, c, even(md), engine).dispatch_seconds(8192)

    in_node = dispatch(2, 2, list(range(8)))  # replicas 0 and 1: GPUs 0-3
    across = dispatch(2, 2, [0, 1, 4, 5, 2, 3, 6, 7])  # replicas 0 and 1 on two nodes
    assert 0 < in_node < across
    assert dispatch(1, None, list(range(8))) == 0.0  # experts split as the dense layers: TP's all-reduce
    assert dispatch(2, 1, list(range(8)), engine=True) == 0.0  # vLLM's EP over its own TP ranks
    assert dispatch(4, 2, list(range(8)), engine=True) > 0.0  # across engines: an all-to-all


def test_a_decode_batch_reads_the_experts_it_touches():
    m = moe_job(experts=8, expert_ffn=16, layers=4)
    md, c = m.models["actor"], m.clusters["c"]
    lay = Layout(model_stage="actor.generate", tp=1, pp=1, dp=8, layers=[(0, 3)], mesh=list(range(8)))
    ex = Experts(md, lay, c, even(md), engine=True)
    expert = 3 * 16 * md.hidden * md.dtype_bytes
    one, few, many = (ex.touched_bytes(n) for n in (1, 3, 1000))
    assert one == pytest.approx(2 * expert)  # one token: its top-2
    assert one < few < many == pytest.approx(8 * expert)  # a large batch reads all 8


def test_dense_first_layers_play_as_the_dense_model_plays_them():
    """A stage of nothing but dense first layers (``dense_layers``) takes what the same stage of a
    dense model of that ``ffn`` takes; a stage of MoE layers does not."""
    from nereus.sim.truth.stages import pipeline_time

    from ..support.jobs import job

    moe = moe_job(experts=8, expert_ffn=16, layers=4, dense_layers=2)
    dense = job(layers=4)
    c = moe.clusters["c"]
    lay = Layout(model_stage="actor.train", tp=2, pp=1, dp=1, layers=[(0, 1)], mesh=[0, 1])
    batches = [np.full(2, 256)] * 4
    first = lambda m: pipeline_time(m.models["actor"], lay, c, batches, train=True, recompute=False)[0]
    assert first(moe) == pytest.approx(first(dense), rel=1e-12)
    later = Layout(model_stage="actor.train", tp=2, pp=1, dp=1, layers=[(2, 3)], mesh=[0, 1])
    moe_stage = pipeline_time(moe.models["actor"], later, c, batches, train=True, recompute=False)[0]
    assert moe_stage != pytest.approx(first(dense), rel=1e-6)
