"""Expert parallelism in the IR: ``ep`` and ``etp`` on a layout carve expert ranks from a pipeline
stage's dp x cp x tp ranks as Megatron does, the verifier points at the line of a carving that
cannot exist, EMUs hold each expert on its EP rank only, and plan-transition moves experts
between EP layouts with exactly the bytes each GPU lacks, counted here by brute force."""

from __future__ import annotations

import random

import numpy as np
import pytest

import nereus
from nereus.ir import Layout, Plan
from nereus.ir.model import even_split
from nereus.passes.transition.derive_emus import derive_missing_emus
from nereus.runtime.reference_executor import simulate

from ..support.jobs import moe_job

EXPERTS = 8


def layout(ms: str, tp=1, pp=1, dp=1, mesh=None, **kw) -> Layout:
    layers = [(lo, hi - 1) for lo, hi in (even_split(3, pp, r) for r in range(pp))]
    return Layout(model_stage=ms, tp=tp, pp=pp, dp=dp, layers=layers, mesh=list(mesh or range(tp * pp * dp)), **kw)


def module(a: dict, b: dict | None = None, dense_layers: int | None = None):
    m = moe_job(experts=EXPERTS, dense_layers=dense_layers)
    for name, lays in (("a", a), ("b", b)):
        if lays is not None:
            m.plans[name] = Plan(name=name, workload="w", cluster="c", layouts={ms: l for ms, l in lays.items()})
    return m


def both(train: Layout, gen: Layout, infer: Layout | None = None) -> dict:
    return {
        "actor.train": train,
        "actor.generate": gen,
        "ref.infer": infer or layout("ref.infer", tp=1, dp=8),
    }


# ---------------------------------------------------------------- verifier


@pytest.mark.parametrize(
    "attrs, at, message",
    [
        ({"ep": 3}, "ep", "ep = 3 does not divide experts = 8"),
        ({"ep": 8, "etp": 2}, "ep", "ep x etp = 8 x 2 = 16 expert ranks are more than the 8 ranks"),
        ({"etp": 3}, "etp", "etp = 3 does not divide tp = 2"),
        ({"ep": 4, "etp": 1, "dp": 3, "mesh": "[0..5]"}, "ep", "do not divide the 6 ranks"),
    ],
)
def test_a_carving_that_cannot_exist_is_reported_at_its_line(attrs, at, message):
    m = module(both(layout("actor.train", tp=2, dp=4), layout("actor.generate", tp=2, dp=4)))
    lines = nereus.print_ir(m).splitlines()
    begin = lines.index("  layout actor.train {")
    end = lines.index("  }", begin)
    block = {line.split(" = ")[0].strip(): k for k, line in enumerate(lines[begin:end], begin) if " = " in line}
    for key, value in attrs.items():
        if key in block:
            lines[block[key]] = f"    {key} = {value}"
        else:
            lines.insert(end, f"    {key} = {value}")
            block[key] = end
            end += 1
    with pytest.raises(nereus.DiagnosticError) as err:
        nereus.verify(nereus.parse("\n".join(lines)))
    (d,) = [d for d in err.value.diagnostics if message in d.message]
    assert d.loc.line == block[at] + 1


def test_expert_parallelism_on_a_dense_model_is_an_error_at_ep():
    from ..support.jobs import job

    m = job(layers=3)
    m.plans["a"] = Plan(
        name="a", workload="w", cluster="c", layouts=both(layout("actor.train", dp=8, ep=2), layout("actor.generate"))
    )
    text = nereus.print_ir(m)
    with pytest.raises(nereus.DiagnosticError) as err:
        nereus.verify(nereus.parse(text))
    (d,) = [d for d in err.value.diagnostics if "splits experts, but model @actor has none" in d.message]
    assert text.splitlines()[d.loc.line - 1][d.loc.col - 1 :].startswith("ep = 2")


# ---------------------------------------------------------------- EMUs


def holders(m, plan: str, ms: str, state: str = "weight") -> dict[tuple[int, str], np.ndarray]:
    """Per (GPU, expert family): a layer x rows x cols mask of what the GPU holds (brute force
    from the EMUs)."""
    derive_missing_emus(m, plan)
    model = m.models[m.plans[plan].layouts[ms].model]
    out: dict = {}
    for emu in m.emus.values():
        if emu.plan != plan or emu.model_stage != ms:
            continue
        for s in emu.shards:
            for e in s.entries:
                if e.state != state or e.family not in model.expert_of:
                    continue
                spec = model.tensors[e.family]
                mask = out.setdefault((s.gpu, e.family), np.zeros((model.layers, *spec.shape), dtype=bool))
                (l0, l1), ((a, b), (c, d)) = e.layers, e.box
                mask[l0 : l1 + 1, a:b, c:d] = True
    return out


def test_each_expert_lives_on_its_ep_rank_split_by_etp_and_zero_over_expert_dp():
    # 8 GPUs, tp 4 x dp 2; ep 4 x etp 2 leaves expert-DP 1: each expert on one pair of GPUs
    train = layout("actor.train", tp=4, dp=2, ep=4, etp=2, zero=1)
    m = module(both(train, layout("actor.generate", tp=4, dp=2)))
    nereus.verify(m)
    weights = holders(m, "a", "actor.train")
    masters = holders(m, "a", "actor.train", "master")
    for e in range(EXPERTS):
        family = f"mlp.experts.{e}.up_proj.weight"
        gpus = sorted(g for g, f in weights if f == family)
        # Megatron's order: a stage's rank r = tp + 4 x replica; ETP fastest, then EP
        assert gpus == [2 * (e // 2), 2 * (e // 2) + 1]
        # ETP splits the expert's rows in two; each row is held once (expert-DP 1)
        count = sum(weights[(g, family)].astype(int) for g in gpus)
        assert (count == 1).all()
        assert [(g, f) for g, f in masters if f == family] == [(g, family) for g in gpus]


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_every_expert_element_is_held_once_per_expert_dp_rank_and_once_under_zero(zero):
    train = layout("actor.train", tp=2, dp=4, ep=2, etp=1, zero=zero)  # expert-DP 8 / (1 x 2) = 4
    m = module(both(train, layout("actor.generate", tp=2, dp=4, ep=4, etp=1)))
    nereus.verify(m)
    for state, want in (("weight", 1 if zero == 3 else 4), ("master", 1 if zero else 4)):
        held = holders(m, "a", "actor.train", state)
        for e in range(EXPERTS):
            family = f"mlp.experts.{e}.down_proj.weight"
            count = sum(v.astype(int) for (g, f), v in held.items() if f == family)
            assert (count == want).all(), (state, e)


def test_an_emu_holding_an_expert_off_its_ep_rank_is_an_error():
    m = module(both(layout("actor.train", dp=8, ep=8), layout("actor.generate", tp=4, dp=2)))
    derive_missing_emus(m, "a")
    text = nereus.print_ir(m)
    # GPU 0 (EP rank 0) holds expert 0; give it expert 1's up projection instead
    start = text.index("emu @a actor.train[0]")
    i = text.index("mlp.experts.0.up_proj.weight", start)
    bad = text[:i] + "mlp.experts.1.up_proj.weight" + text[i + len("mlp.experts.0.up_proj.weight") :]
    with pytest.raises(nereus.DiagnosticError) as err:
        nereus.verify(nereus.parse(bad))
    by = {d.message.split(" [")[0]: d for d in err.value.diagnostics}
    assert set(by) == {f"actor.train: layers.0..2.mlp.experts.{e}.up_proj.weight" for e in (0, 1)}
    extra = by["actor.train: layers.0..2.mlp.experts.1.up_proj.weight"]
    assert "held 2 times across the 8 replicas, expected 1" in extra.message
    assert extra.loc.line == bad[:i].count("\n") + 1  # the slice that holds it once too often
    assert "held 0 times" in by["actor.train: layers.0..2.mlp.experts.0.up_proj.weight"].message


# ---------------------------------------------------------------- transitions


def lacking_bytes(m) -> int:
    """Brute force: bytes of the actor's experts (weights and optimizer state) that a GPU holds
    under plan B and under no model-stage of plan A."""
    model = m.models["actor"]
    total = 0
    for state, size in (("weight", model.dtype_bytes), ("master", 4), ("exp_avg", 4), ("exp_avg_sq", 4)):
        a: dict = {}
        b: dict = {}
        for plan, union in (("a", a), ("b", b)):
            for ms in ("actor.train", "actor.generate"):
                for key, mask in holders(m, plan, ms, state).items():
                    union[key] = union.get(key, False) | mask
        for (g, f), want in b.items():
            have = a.get((g, f), np.zeros_like(want))
            total += int((want & ~have).sum()) * size
    return total


def test_ep8_training_to_ep4_by_tp2_generation_moves_exactly_the_experts_each_gpu_lacks():
    train = layout("actor.train", dp=8, ep=8, zero=1)
    gen_a = layout("actor.generate", tp=2, dp=4, ep=4, etp=1)
    gen_b = layout("actor.generate", tp=4, dp=2)  # every expert on every GPU, split by TP
    train_b = layout("actor.train", tp=2, dp=4, ep=4, etp=1, zero=1)
    m = module(both(train, gen_a), both(train_b, gen_b))
    nereus.verify(m)
    nereus.run_pipeline(m, "plan-transition{to=@b},schedule-transfers")
    t = m.transitions["a_to_b"]
    result = simulate(m, t)
    assert result.mismatches == []
    lays = m.plans["b"].layouts
    received = 0
    for op in t.ops:
        if op.kind in ("send", "broadcast") and op.family in m.models["actor"].expert_of:
            gpus = {lays[d.model_stage].gpu(d.dp, d.pp, d.tp) for d in op.dst}
            received += op.bytes * len(gpus)
    assert received == lacking_bytes(m) > 0
    assert t.bytes_moved == t.lower_bound
    assert nereus.parse(nereus.print_ir(m)) == m


def random_ep_pairs(n: int, seed: int = 0) -> list[str]:
    """Plan pairs of the MoE job (every other one with a dense first layer) with random EP, ETP,
    TP, PP, DP and ZeRO, as IR text."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        dense = 1 if len(out) % 2 else None
        plans = []
        for _ in range(2):
            lays = {}
            for ms in ("actor.generate", "ref.infer", "actor.train"):
                tp, pp = rng.choice([1, 2, 4]), rng.choice([1, 1, 2])
                dp = rng.choice([d for d in (1, 2, 4, 8) if tp * pp * d <= 8])
                etp = rng.choice([t for t in (1, 2, 4) if tp % t == 0])
                ep = rng.choice([e for e in (1, 2, 4, 8) if (dp * tp) % (e * etp) == 0])
                zero = rng.choice([0, 1, 3]) if ms == "actor.train" else 0
                mesh = rng.sample(range(8), tp * pp * dp)
                lays[ms] = layout(ms, tp=tp, pp=pp, dp=dp, mesh=mesh, ep=ep, etp=etp, zero=zero)
            plans.append(lays)
        m = module(*plans, dense_layers=dense)
        try:
            nereus.verify(m)
        except nereus.DiagnosticError:
            continue
        out.append(nereus.print_ir(m))
    return out


def test_random_ep_pairs_move_the_lower_bound_and_land_every_slice():
    for text in random_ep_pairs(12):
        m = nereus.parse(text)
        nereus.run_pipeline(m, "plan-transition{to=@b},schedule-transfers")
        t = m.transitions["a_to_b"]
        assert simulate(m, t).mismatches == []
        assert t.bytes_moved == t.lower_bound


# ---------------------------------------------------------------- plan-search


def test_plan_search_chooses_expert_parallelism_where_it_pays():
    """Mixtral 8x7B on 16 GPUs, short responses: the search places the forward passes with their
    experts split over EP ranks, and every such layout, with its experts unsplit instead
    (ep = 1), is slower by estimate or does not fit."""
    from dataclasses import replace

    from nereus.ir.presets import preset_model

    from ..support import example

    m = nereus.parse(example("grpo_7b_8gpu.nir").read_text().replace("nodes = 1", "nodes = 2"))
    for name in ("actor", "ref"):
        m.models[name] = preset_model("mixtral-8x7b", name, trained=name == "actor")
    w = m.workloads["grpo"]
    w.global_batch, w.group_size, w.prompt_len_mean, w.prompt_len_max = 16, 4, 128, 256
    w.response_len_mean, w.response_len_max, w.response_len_dist, w.mini_batch = 128, 256, [], 64
    m.plans.clear()
    m.emus.clear()
    m.transitions.clear()
    nereus.run_pipeline(m, "plan-search")
    plan = m.plans["grpo_searched"]
    carved = [ms for ms, lay in plan.layouts.items() if lay.carves_experts]
    assert carved
    for ms in carved:
        unsplit = replace(plan, name="unsplit", layouts=dict(plan.layouts), step_time=None, search=None)
        unsplit.layouts[ms] = replace(plan.layouts[ms], ep=1, etp=None, time=None, memory=None)
        m.plans["unsplit"] = unsplit
        before = len(m.warnings)
        out = nereus.run_pipeline(m, "estimate{plan=@unsplit, oom=warn}")
        oom = [d.message for d in out.warnings[before:] if ms in d.message]
        assert oom or out.plans["unsplit"].step_time > plan.step_time, ms
        del m.plans["unsplit"]


# ---------------------------------------------------------------- dense first layers


def test_dense_first_layers_hold_the_dense_mlp_and_the_rest_the_experts():
    """``dense_layers = 1`` of 3: layer 0 has the dense MLP, layers 1..2 the router and experts;
    a pipeline stage holds each family over the layers it has of it, and the transition between
    EP layouts moves exactly what each GPU lacks."""
    train = layout("actor.train", tp=2, pp=2, dp=2, ep=2, etp=1, zero=1)
    m = module(both(train, layout("actor.generate", tp=2, dp=4)), dense_layers=1)
    nereus.verify(m)
    derive_missing_emus(m, "a")
    emu = m.emus[("a", "actor.train", 0)]
    by_stage = {s.pp: {(e.family, e.layers) for e in s.entries if e.state == "weight"} for s in emu.shards}
    assert ("mlp.up_proj.weight", (0, 0)) in by_stage[0] and ("mlp.gate.weight", (1, 1)) in by_stage[0]
    assert not any(f == "mlp.up_proj.weight" for f, _ in by_stage[1])  # layer 2 is MoE
    assert ("mlp.gate.weight", (2, 2)) in by_stage[1]
    md = m.models["actor"]
    assert md.num_params() == sum(
        s.numel() * ((s.span(md.layers)[1] - s.span(md.layers)[0] + 1) if s.per_layer else 1)
        for s in md.tensors.values()
    )
    train_b = layout("actor.train", tp=1, pp=1, dp=8, ep=8, etp=1, zero=1)
    m = module(
        both(train, layout("actor.generate", tp=2, dp=4)), both(train_b, layout("actor.generate", tp=1, dp=8)), 1
    )
    nereus.verify(m)
    nereus.run_pipeline(m, "plan-transition{to=@b},schedule-transfers")
    t = m.transitions["a_to_b"]
    assert simulate(m, t).mismatches == []
    assert t.bytes_moved == t.lower_bound


def test_an_expert_slice_in_a_dense_layer_is_an_error_at_its_line():
    m = module(both(layout("actor.train", dp=8, ep=8), layout("actor.generate", tp=2, dp=4)), dense_layers=1)
    derive_missing_emus(m, "a")
    text = nereus.print_ir(m)
    start = text.index("emu @a actor.train[0]")
    i = text.index("layers.1..2.mlp.experts.0.up_proj.weight", start)
    bad = text[:i] + "layers.0..2" + text[i + len("layers.1..2") :]
    with pytest.raises(nereus.DiagnosticError) as err:
        nereus.verify(nereus.parse(bad))
    (d,) = [d for d in err.value.diagnostics if "exists in layers 1..2 only" in d.message]
    assert d.loc.line == bad[:i].count("\n") + 1
