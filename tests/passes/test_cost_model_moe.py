"""A mixture of experts in the cost model: the GEMM FLOPs a token costs equal twice the parameters
it goes through (counted from the tensor inventory, independently of the formula), and a decode
step reads the experts its batch touches."""

from __future__ import annotations

import pytest

from nereus.ir.hf_config import model_from_hf_config
from nereus.ir.presets import preset_model
from nereus.passes.cost.cost_model import Candidates, CostModel, touched_share

QWEN2_57B_A14B = dict(
    model_type="qwen2_moe",
    num_hidden_layers=28,
    hidden_size=3584,
    num_attention_heads=28,
    num_key_value_heads=4,
    intermediate_size=18944,
    moe_intermediate_size=2560,
    shared_expert_intermediate_size=20480,
    num_experts=64,
    num_experts_per_tok=8,
    vocab_size=151936,
)


@pytest.mark.parametrize(
    "model",
    [preset_model("qwen3-30b-a3b"), model_from_hf_config(QWEN2_57B_A14B, "actor"), preset_model("mixtral-8x7b")],
    ids=["qwen3-30b-a3b", "qwen2-57b-a14b", "mixtral-8x7b"],
)
def test_gemm_flops_are_twice_the_active_matrix_parameters(model):
    m = model
    # every matrix a token multiplies, once: the active parameters less the embedding and the vectors
    vectors = sum(s.numel() * (m.layers if s.per_layer else 1) for s in m.tensors.values() if len(s.shape) == 1)
    embedding = m.tensors["embed_tokens.weight"].numel()
    matrices = m.num_active_params() - embedding - vectors
    assert m.layers * CostModel.gemm_flops(m) + CostModel.head_flops(m) == 2 * matrices


def test_a_decode_step_reads_the_experts_its_batch_touches():
    m = preset_model("qwen3-30b-a3b")
    one, eight, many = touched_share(m, [1, 8, 4096])
    assert one == pytest.approx(8 / 128)  # one token: its 8 experts
    assert one < eight < many and many == pytest.approx(1.0)  # a large batch reads every expert


# ---------------------------------------------------------------- expert parallelism


def _emu_bytes(m, plan: str, ms: str) -> tuple[int, int]:
    """(weight bytes, fp32 optimizer bytes) of the routed experts on the fullest GPU, counted from
    the derived EMUs."""
    from nereus.passes.transition.derive_emus import derive_missing_emus

    derive_missing_emus(m, plan)
    md = m.models[m.plans[plan].layouts[ms].model]
    weights: dict[int, int] = {}
    optimizer: dict[int, int] = {}
    for emu in m.emus.values():
        if (emu.plan, emu.model_stage) != (plan, ms):
            continue
        for s in emu.shards:
            for e in s.entries:
                if e.family not in md.expert_of:
                    continue
                into = weights if e.state == "weight" else optimizer
                into[s.gpu] = into.get(s.gpu, 0) + e.numel() * (md.dtype_bytes if e.state == "weight" else 4)
    return max(weights.values()), max(optimizer.values())


@pytest.mark.parametrize(
    "tp, dp, ep, etp, zero, pp",
    [
        (
            2,
            4,
            1,
            None,
            1,
            1,
        ),
        (
            2,
            4,
            4,
            2,
            1,
            1,
        ),
        (
            2,
            4,
            8,
            1,
            0,
            1,
        ),
        (
            1,
            8,
            8,
            1,
            1,
            1,
        ),
        (
            2,
            2,
            2,
            2,
            1,
            2,
        ),
        (
            4,
            2,
            2,
            2,
            1,
            1,
        ),
    ],
)
def test_expert_weights_and_optimizer_state_on_the_fullest_gpu_are_what_the_emus_hold(tp, dp, ep, etp, zero, pp):
    """The cost model's per-GPU expert state under EP and ETP, against the sharding rule's EMUs."""
    import nereus
    from nereus.ir import Layout, Plan

    from ..support.jobs import moe_job

    m = moe_job(experts=8, expert_ffn=16, layers=4)
    md = m.models["actor"]
    layers = [(0, 3)] if pp == 1 else [(0, 1), (2, 3)]
    train = Layout(
        model_stage="actor.train", tp=tp, pp=pp, dp=dp, layers=layers, mesh=list(range(8)), ep=ep, etp=etp, zero=zero
    )
    gen = Layout(model_stage="actor.generate", tp=1, pp=1, dp=8, layers=[(0, 3)], mesh=list(range(8)))
    ref = Layout(model_stage="ref.infer", tp=1, pp=1, dp=8, layers=[(0, 3)], mesh=list(range(8)))
    m.plans["a"] = Plan(
        name="a", workload="w", cluster="c", layouts={"actor.train": train, "actor.generate": gen, "ref.infer": ref}
    )
    nereus.verify(m)
    cost = CostModel(m.clusters["c"])
    cand = Candidates.of_layout(m.clusters["c"], train)
    dense, experts = cost.split_params(md, cand)
    w, _, opt = cost._state("train", cand, 0 * dense, experts, md.dtype_bytes)
    want_w, want_opt = _emu_bytes(m, "a", "actor.train")
    assert (float(w[0]), float(opt[0])) == (want_w, want_opt)


def test_all_to_all_costs_grow_with_ep_and_move_to_the_nic_when_the_ep_group_spans_nodes():
    from nereus.ir import Layout

    from ..support.jobs import moe_job

    m = moe_job(experts=8, expert_ffn=16, layers=4)  # 2 nodes of 4 GPUs
    c, md, w = m.clusters["c"], m.models["actor"], m.workloads["w"]
    cost = CostModel(c)

    def ep_seconds(ep, etp, mesh):
        lay = Layout(model_stage="actor.train", tp=2, pp=1, dp=4, layers=[(0, 3)], mesh=mesh, ep=ep, etp=etp)
        cand = Candidates.of_layout(c, lay)
        st = cost.stage(md, w, "train", cand)
        return st.breakdown(cost.coeffs)["ep"], int(cand.ep_link[0])

    node_major = list(range(8))
    assert ep_seconds(1, None, node_major)[0] == 0.0
    # EP 2 x ETP 1: a TP pair's own GPUs; EP 2 x ETP 2: two TP pairs on one node; EP 4 x ETP 2:
    # all four replicas, over both nodes (a stage's ranks ordered tp fastest, then replica)
    pair, link_pair = ep_seconds(2, 1, node_major)
    node, link_node = ep_seconds(2, 2, node_major)
    both, link_both = ep_seconds(4, 2, node_major)
    assert (link_pair, link_node, link_both) == (0, 0, 1)  # NVLink, NVLink, NIC
    assert 0 < pair == node < both  # (ep - 1) / ep of the tokens leave: 1/2, 1/2, 3/4
    # EP 2 x ETP 2 with replicas 0 and 1 on different nodes: its EP group crosses the NIC
    spread = [0, 1, 4, 5, 2, 3, 6, 7]
    crossed, link = ep_seconds(2, 2, spread)
    assert link == 1 and crossed > node


def test_the_search_grids_ep_link_is_the_one_its_canonical_mesh_gives():
    from itertools import product

    from nereus.ir import Layout

    from ..support.jobs import moe_job

    c = moe_job().clusters["c"]  # 2 nodes of 4 GPUs
    seen = set()
    for tp, pp, dp, ep, etp in product((1, 2, 4), (1, 2), (1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4)):
        if tp * pp * dp > 8 or tp % etp or (dp * tp) % (ep * etp):
            continue
        layers = [(0, 2)] if pp == 1 else [(0, 1), (2, 2)]
        lay = Layout(model_stage="actor.train", tp=tp, pp=pp, dp=dp, layers=layers, mesh=list(range(tp * pp * dp)))
        lay.ep, lay.etp = ep, etp
        grid = Candidates.grid(c, 3, tp, pp, dp, ep=ep, etp=etp)
        exact = Candidates.of_layout(c, lay)
        assert (grid.ep_link[0], grid.ep_local[0]) == (exact.ep_link[0], exact.ep_local[0]), (tp, pp, dp, ep, etp)
        seen.add(int(grid.ep_link[0]))
    assert seen == {0, 1}


def test_calibrate_recovers_the_busiest_ep_ranks_load_from_measured_steps():
    """Steps measured on a cluster whose routing loads the busiest EP rank 1.35x the mean (and
    whose GEMMs run at 0.45 of peak): calibrate, on plans with and without expert parallelism,
    finds both; with ep = 1 everywhere nothing tells the imbalance apart and it stays at 1."""
    from dataclasses import replace

    import nereus
    from nereus.ir import Layout, Plan
    from nereus.ir.cluster import Efficiency
    from nereus.passes.cost.calibrate import calibrate_records, synthetic_profile

    from ..support.jobs import moe_job

    def job(carvings):
        m = moe_job(experts=8, layers=4)
        for name, md in m.models.items():  # large enough that compute, not per-layer overhead, sets the time
            m.models[name] = replace(md, hidden=2048, heads=16, kv_heads=4, ffn=8192, vocab=32000, expert_ffn=1024)
        m.workloads["w"].prompt_len_mean = m.workloads["w"].prompt_len_max = 512
        for i, (tp, dp, ep, etp) in enumerate(carvings):
            lay = lambda ms, **kw: Layout(model_stage=ms, pp=1, layers=[(0, 3)], mesh=list(range(8)), **kw)
            m.plans[f"p{i}"] = Plan(
                name=f"p{i}",
                workload="w",
                cluster="c",
                layouts={
                    "actor.generate": lay("actor.generate", tp=1, dp=8),
                    "ref.infer": lay("ref.infer", tp=tp, dp=dp, ep=ep, etp=etp),
                    "actor.train": lay("actor.train", tp=tp, dp=dp, ep=ep, etp=etp, zero=1),
                },
            )
        return nereus.verify(m)

    hidden = Efficiency(compute=0.45, expert_imbalance=1.35)
    m = job([(1, 8, 1, None), (2, 4, 1, None), (1, 8, 8, 1), (2, 4, 4, 1), (2, 4, 2, 2)])
    records = [(r["plan"], r["model_stage"], r["seconds"], None, 1) for r in synthetic_profile(m, hidden, steps=1)]
    (result,) = calibrate_records(m, records).values()
    assert result.efficiency.expert_imbalance == pytest.approx(1.35)
    assert result.efficiency.compute == pytest.approx(0.45, rel=0.02)
    assert result.error_after < 0.01 < result.error_before

    dense = job([(1, 8, 1, None), (2, 4, 1, None)])
    records = [(r["plan"], r["model_stage"], r["seconds"], None, 1) for r in synthetic_profile(dense, hidden)]
    (result,) = calibrate_records(dense, records).values()
    assert result.efficiency.expert_imbalance == 1.0


@pytest.mark.parametrize(
    "tp, dp, ep, etp, pp, dense", [(2, 2, 2, 2, 2, 1), (2, 2, 2, 1, 2, 3), (2, 4, 4, 2, 1, 2), (1, 4, 4, 1, 2, 2)]
)
def test_with_dense_first_layers_the_fullest_gpus_state_is_what_the_emus_hold(tp, dp, ep, etp, pp, dense):
    """A mixture of experts with dense first layers (zero = 0: no uneven ZeRO splits): the
    weights and optimizer state on the fullest GPU, by the cost model, equal the most any GPU
    holds by the EMUs (the first stage's dense layers hold no experts)."""
    import nereus
    from nereus.ir import Layout, Plan
    from nereus.passes.transition.derive_emus import derive_missing_emus

    from ..support.jobs import moe_job

    m = moe_job(experts=8, expert_ffn=16, layers=4, dense_layers=dense)
    md = m.models["actor"]
    layers = [(0, 3)] if pp == 1 else [(0, 1), (2, 3)]
    mesh = list(range(tp * pp * dp))
    train = Layout(model_stage="actor.train", tp=tp, pp=pp, dp=dp, layers=layers, mesh=mesh, ep=ep, etp=etp)
    other = lambda ms: Layout(model_stage=ms, tp=1, pp=1, dp=8, layers=[(0, 3)], mesh=list(range(8)))
    m.plans["a"] = Plan(
        name="a",
        workload="w",
        cluster="c",
        layouts={"actor.train": train, "actor.generate": other("actor.generate"), "ref.infer": other("ref.infer")},
    )
    nereus.verify(m)
    derive_missing_emus(m, "a")
    held: dict[tuple[int, str], int] = {}
    for emu in m.emus.values():
        if (emu.plan, emu.model_stage) == ("a", "actor.train"):
            for s in emu.shards:
                for e in s.entries:
                    kind = "weight" if e.state == "weight" else "optimizer"
                    held[(s.gpu, kind)] = held.get((s.gpu, kind), 0) + e.numel() * (2 if kind == "weight" else 4)
    cost = CostModel(m.clusters["c"])
    w, _, opt = cost.state(md, "train", Candidates.of_layout(m.clusters["c"], train))
    assert float(w[0]) == max(v for (g, k), v in held.items() if k == "weight")
    assert float(opt[0]) == max(v for (g, k), v in held.items() if k == "optimizer")


def test_an_engines_ep_over_its_own_tp_ranks_is_charged_no_all_to_all():
    """vLLM's expert parallelism inside one engine (EP = TP, no data-parallel attention): every
    rank holds the batch's tokens after attention, runs its own experts and the TP all-reduce
    sums their outputs. So the engine pays the TP all-reduces it pays without EP, and no
    all-to-all (the model once charged one per decode step and layer: 114 of 205 s of the
    Qwen3-235B job's generation)."""
    from nereus.ir import Layout

    from ..support.jobs import moe_job

    m = moe_job(experts=8, expert_ffn=16, layers=4)
    c, md, w = m.clusters["c"], m.models["actor"], m.workloads["w"]
    cost = CostModel(c)

    def breakdown(ep, etp):
        lay = Layout(
            model_stage="actor.generate", tp=2, pp=1, dp=4, layers=[(0, 3)], mesh=list(range(8)), ep=ep, etp=etp
        )
        return cost.stage(md, w, "generate", Candidates.of_layout(c, lay)).breakdown(cost.coeffs)

    tp_only, expert_parallel = breakdown(1, None), breakdown(2, 1)
    assert expert_parallel.get("ep", 0.0) == 0.0
    assert expert_parallel["tp"] == tp_only["tp"] > 0
