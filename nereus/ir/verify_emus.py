"""Rules for EMUs: every EMU holds exactly its slices (``verify_transition`` checks the moves).

Coverage is checked on a compressed grid: the breakpoints of every slice (and, for per-layer
families, of every layer range) cut the tensor into cells; each cell must be held exactly as
many times as the sharding rule replicates it (1 for split dimensions, ``tp`` for replicated
tensors, ``tp / kv_heads`` for replicated K/V heads, twice more for a tied embedding held by
the first and last pipeline stage). That one rule finds gaps, overlaps and stray copies.
Replicas printed as one block share their slice lists, so each distinct layout is checked once.
"""

from __future__ import annotations

from collections import defaultdict
from typing import cast

import numpy as np

from .diagnostics import DiagnosticSink, Loc, did_you_mean, plural
from .emu import STATES, Emu, Shard, SliceEntry, tensor_name
from .model import TensorSpec, even_split
from .module import Module
from .sharding import dp_sharded


def format_box(box) -> str:
    return "[" + ", ".join(f"{lo}:{hi}" for lo, hi in box) + "]"


class _Ctx:
    """What an EMU is checked against: its plan, layout, model and stage kind."""

    def __init__(self, m: Module, emu: Emu):
        self.plan = m.plans.get(emu.plan)
        self.layout = self.plan.layouts.get(emu.model_stage) if self.plan else None
        self.model = m.models.get(self.layout.model) if self.layout else None
        w = m.workloads.get(self.plan.workload) if self.plan else None
        stage = w.stage_of(emu.model_stage) if w else None
        self.trains = stage is not None and stage.kind == "train"
        self.generates = stage is not None and stage.kind == "generate"
        self.cluster = m.clusters.get(self.plan.cluster) if self.plan else None


def verify_emus(m: Module, sink: DiagnosticSink) -> None:
    checked: dict[tuple, bool] = {}
    clean: set[tuple[str, str, int]] = set()  # replicas whose own slices passed every check
    for emu in m.emus.values():
        if emu.plan not in m.plans:
            sink.error(emu.plan_loc, f"emu refers to unknown plan @{emu.plan}", did_you_mean(emu.plan, m.plans))
            continue
        ctx = _Ctx(m, emu)
        if ctx.layout is None:
            assert ctx.plan is not None  # emu.plan is in m.plans
            sink.error(
                emu.loc,
                f"plan @{emu.plan} has no layout {emu.model_stage}",
                did_you_mean(emu.model_stage, ctx.plan.layouts),
            )
            continue
        lay = ctx.layout
        if emu.replica >= lay.replicas:
            sink.error(
                emu.loc,
                f"{emu.model_stage} has "
                + (f"dp x cp = {lay.dp} x {lay.cp}" if lay.cp > 1 else f"dp = {lay.dp}")
                + f", so replica {emu.replica} does not exist",
            )
            continue
        if ctx.model is None or len(lay.layers) != lay.pp or len(lay.mesh) != lay.world:
            continue  # the plan's own errors are reported by the plan rules
        structure = tuple(id(s.entries) for s in emu.shards)
        errors_before_shards = len(sink.diagnostics)
        seen_coords: dict[tuple[int, int], Loc] = {}
        for s in emu.shards:
            coord = (s.pp, s.tp)
            if s.pp >= lay.pp or s.tp >= lay.tp:
                sink.error(s.loc, f"shard [{s.pp}, {s.tp}] is outside {emu.model_stage}'s pp = {lay.pp}, tp = {lay.tp}")
                continue
            if coord in seen_coords:
                sink.error(
                    s.loc,
                    f"shard [{s.pp}, {s.tp}] appears twice in {emu.model_stage}[{emu.replica}]",
                    f"first at line {seen_coords[coord].line}",
                )
                continue
            seen_coords[coord] = s.loc
            if s.kv_cache is not None:
                stage_kind = "generate" if ctx.generates else None
                if stage_kind is None:
                    sink.error(s.loc, f"{emu.model_stage} does not generate, so shard [{s.pp}, {s.tp}] has no KV cache")
                elif ctx.cluster is not None and s.kv_cache > ctx.cluster.gpu_memory:
                    sink.error(s.loc, f"kv_cache of shard [{s.pp}, {s.tp}] exceeds the GPU's memory")
            want = lay.gpu(emu.replica, s.pp, s.tp)
            if s.gpu != want:
                sink.error(
                    s.loc,
                    f"replica {emu.replica} shard [{s.pp}, {s.tp}] of {emu.model_stage} is on GPU {s.gpu}, "
                    f"but plan @{emu.plan}'s mesh puts it on GPU {want}",
                )
        missing = [c for c in ((p, t) for p in range(lay.pp) for t in range(lay.tp)) if c not in seen_coords]
        shard_errors = len(sink.diagnostics) > errors_before_shards
        if missing:
            shown = ", ".join(f"[{p}, {t}]" for p, t in missing[:4]) + (" ..." if len(missing) > 4 else "")
            sink.error(
                emu.loc,
                f"{emu.model_stage}[{emu.replica}] has no shard for {shown}",
                "an EMU lists every (pp, tp) coordinate of its replica",
            )
        key = (emu.plan, emu.model_stage, structure)
        if key in checked:
            continue  # same slice lists as an already checked replica
        before = len(sink.diagnostics)
        for s in emu.shards:
            if s.pp < lay.pp and s.tp < lay.tp:
                for e in s.entries:
                    _entry(ctx, emu, s.pp, s.tp, e, sink)
        if len(sink.diagnostics) == before and not missing and not shard_errors:
            _coverage(ctx, emu, sink)
            clean.add(emu.key)
        checked[key] = True
    _dp_sharded_coverage(m, clean, sink)
    _expert_coverage(m, clean, sink)


def _entry(ctx: _Ctx, emu: Emu, pp: int, tp: int, e: SliceEntry, sink: DiagnosticSink) -> None:
    model, lay = ctx.model, ctx.layout
    assert model is not None and lay is not None  # called only for an EMU whose layout and model exist
    spec = model.tensors.get(e.family)
    if spec is None:
        sink.error(
            e.loc,
            f"model @{model.name} has no tensor {e.family}",
            did_you_mean(e.family, model.tensors) or "tensors: " + ", ".join(model.tensors),
        )
        return
    if e.state != "weight" and not ctx.trains:
        sink.error(e.loc, f"{emu.model_stage} does not train, so it holds no {e.state} state")
        return
    if spec.per_layer and e.layers is None:
        sink.error(e.loc, f"{e.family} is a per-layer tensor: write layers.N.{e.family} or layers.A..B.{e.family}")
        return
    if not spec.per_layer and e.layers is not None:
        sink.error(e.loc, f"{e.family} is not a per-layer tensor: write it without layers.")
        return
    if e.layers is not None:
        first, last = spec.span(model.layers)
        if e.layers[0] < first or e.layers[1] > last:
            sink.error(
                e.loc,
                f"{e.family} exists in layers {first}..{last} only, not in {e.layers[0]}..{e.layers[1]}",
                f"model @{model.name} has dense_layers = {model.dense_layers}" if model.dense_layers else None,
            )
            return
        lo, hi = lay.layers[pp]
        if e.layers[0] < lo or e.layers[1] > hi:
            sink.error(
                e.loc,
                f"shard [{pp}, {tp}] holds layers {e.layers[0]}..{e.layers[1]}, "
                f"outside its pipeline stage's layers {lo}..{hi}",
            )
            return
    elif pp not in model.stages_holding(spec, lay.pp):
        sink.error(
            e.loc, f"{e.family} lives on pipeline stage(s) {model.stages_holding(spec, lay.pp)}, not on stage {pp}"
        )
        return
    if len(e.box) != len(spec.shape):
        sink.error(
            e.loc,
            f"{e.tensor} has {plural(len(spec.shape), 'dimension')} {list(spec.shape)}, the slice gives {len(e.box)}",
        )
        return
    for d, ((a, b), n) in enumerate(zip(e.box, spec.shape)):
        if b > n:
            sink.error(
                e.loc,
                f"slice {format_box(e.box)} is outside {e.tensor} of shape {list(spec.shape)} (dimension {d} has {n})",
            )
            return
        if (
            d != spec.tp_dim
            and (a, b) != (0, n)
            and not (d == 0 and dp_sharded(e.state, lay.zero) and (lay.replicas > 1 or lay.expert_dp > 1))
        ):
            what = "is replicated" if spec.tp_dim is None else f"is split only along dimension {spec.tp_dim}"
            sink.error(
                e.loc,
                f"{e.family} {what} ({spec.rule}), but the slice cuts dimension {d} to {a}:{b}",
                f"dimension {d} must be whole: 0:{n}",
            )
            return


def _coverage(ctx: _Ctx, emu: Emu, sink: DiagnosticSink) -> None:
    model, lay = ctx.model, ctx.layout
    assert model is not None and lay is not None  # called only for an EMU whose layout and model exist
    groups: dict[tuple[str, str], list[tuple[Shard, SliceEntry]]] = defaultdict(list)
    for s in emu.shards:
        for e in s.entries:
            groups[(e.state, e.family)].append((s, e))
    states = {st for st, _ in groups} | {"weight"}
    for state in STATES:
        if state not in states or (dp_sharded(state, lay.zero) and lay.replicas > 1):
            continue  # sharded over DP: checked across replicas in _dp_sharded_coverage
        for spec in model.tensors.values():
            if lay.carves_experts and spec.family in model.expert_of:
                continue  # split over expert ranks: checked across replicas in _expert_coverage
            held = groups.get((state, spec.family), [])
            want = model.tp_replication(spec, lay.tp)
            if not spec.per_layer and spec.placement == "first_and_last" and lay.pp > 1:
                want *= 2
            bad = _bad_cell(spec, model.layers, [e for _, e in held], want)
            if bad is None:
                continue
            cell, count = bad
            layers, box = (cell[0], cell[1:]) if spec.per_layer else (None, cell)
            name = tensor_name(spec.family, None if layers is None else (layers[0], layers[1] - 1))
            label = ("" if state == "weight" else state + " ") + f"{name} {format_box(box)}"
            if count > want:
                # point at the last slice that holds the cell once too often
                holders = [e for _, e in held if _covers(e, layers, box)]
                loc = max(holders, key=lambda e: (e.loc.line, e.loc.col)).loc
                sink.error(
                    loc,
                    f"{emu.model_stage}[{emu.replica}]: {label} is held {plural(count, 'time')}, expected {want}",
                    "slices of one tensor may overlap only where its sharding rule replicates it",
                )
            else:
                loc, owner = _expected_owner(ctx, emu, spec, state, layers, box)
                what = "is not held by any shard" if count == 0 else f"is held {plural(count, 'time')}, expected {want}"
                sink.error(
                    loc,
                    f"{emu.model_stage}[{emu.replica}]: {label} {what}"
                    + (f"; by the {spec.rule} rule shard [{owner[0]}, {owner[1]}] holds it" if owner else ""),
                    "each element is held once per replica (tp times if replicated)",
                )


def _dp_sharded_coverage(m: Module, clean: set, sink: DiagnosticSink) -> None:
    """States ZeRO shards over DP: every element held once per TP replication over *all* replicas.

    Checked only where every replica of the model-stage is declared and passed its own checks.
    """
    by_stage: dict[tuple[str, str], list[Emu]] = defaultdict(list)
    for key in clean:
        by_stage[key[:2]].append(m.emus[key])
    for (plan, ms), emus in sorted(by_stage.items()):
        ctx = _Ctx(m, emus[0])
        lay, model = ctx.layout, ctx.model
        assert lay is not None and model is not None  # clean EMUs have a layout and a model
        if lay.replicas < 2 or len(emus) != lay.replicas:
            continue
        states = [
            st
            for st in STATES
            if dp_sharded(st, lay.zero) and any(e.state == st for emu in emus for s in emu.shards for e in s.entries)
        ]
        for state in states:
            for spec in model.tensors.values():
                if lay.carves_experts and spec.family in model.expert_of:
                    continue  # checked in _expert_coverage
                held = [
                    e
                    for emu in emus
                    for s in emu.shards
                    for e in s.entries
                    if e.state == state and e.family == spec.family
                ]
                want = model.tp_replication(spec, lay.tp)
                if not spec.per_layer and spec.placement == "first_and_last" and lay.pp > 1:
                    want *= 2
                bad = _bad_cell(spec, model.layers, held, want)
                if bad is None:
                    continue
                cell, count = bad
                layers, box = (cell[0], cell[1:]) if spec.per_layer else (None, cell)
                name = tensor_name(spec.family, None if layers is None else (layers[0], layers[1] - 1))
                emu0 = min(emus, key=lambda e: e.replica)
                sink.error(
                    emu0.loc,
                    f"{ms}: {state} {name} {format_box(box)} is held {plural(count, 'time')} across the {lay.replicas} "
                    f"replicas, expected {want}",
                    f"zero = {lay.zero} shards {state} over DP: the replicas "
                    "together hold each element once per TP replication",
                )


def _expert_coverage(m: Module, clean: set, sink: DiagnosticSink) -> None:
    """Routed experts under expert parallelism: every element of every expert held once per
    expert-DP rank over *all* replicas (once in all under ZeRO), as ``expert_rank`` carves them.

    Checked only where every replica of the model-stage is declared and passed its own checks.
    """
    by_stage: dict[tuple[str, str], list[Emu]] = defaultdict(list)
    for key in clean:
        by_stage[key[:2]].append(m.emus[key])
    for (plan, ms), emus in sorted(by_stage.items()):
        ctx = _Ctx(m, emus[0])
        lay, model = ctx.layout, ctx.model
        assert lay is not None and model is not None  # clean EMUs have a layout and a model
        if not (model.moe and lay.carves_experts) or len(emus) != lay.replicas:
            continue
        emus.sort(key=lambda e: e.replica)
        held: dict[tuple[str, str], list[tuple[bool, SliceEntry]]] = defaultdict(list)
        for emu in emus:
            for s in emu.shards:
                first, last = even_split(cast(int, model.experts), lay.ep, lay.expert_rank(emu.replica, s.tp)[0])
                for e in s.entries:
                    if e.family in model.expert_of:
                        held[(e.state, e.family)].append((first <= model.expert_of[e.family] < last, e))
        for state in [st for st in STATES if any(k[0] == st for k in held)]:
            want = 1 if dp_sharded(state, lay.zero) else lay.expert_dp
            for family in model.expert_of:
                spec = model.tensors[family]
                entries = held.get((state, family), [])
                bad = _bad_cell(spec, model.layers, [e for _, e in entries], want)
                if bad is None:
                    continue
                cell, count = bad
                layers, box = (cell[0][0], cell[0][1] - 1), cell[1:]
                name = tensor_name(family, layers)
                # an extra copy: at a slice off its EP rank, else the last; a missing one: the first replica
                extra = sorted(
                    ((ok, (e.loc.line, e.loc.col), e.loc) for ok, e in entries if _covers(e, cell[0], box)),
                    key=lambda x: (x[0], -x[1][0], -x[1][1]),
                )
                loc = extra[0][2] if count > want else emus[0].loc
                sink.error(
                    loc,
                    f"{ms}: {'' if state == 'weight' else state + ' '}{name} {format_box(box)} is held "
                    f"{plural(count, 'time')} across the {lay.replicas} replicas, expected {want}",
                    f"ep = {lay.ep}, etp = {lay.expert_tp}: each expert lives on its EP rank's GPUs, split by etp, "
                    f"once per expert-DP rank ({lay.expert_dp})" + (" and once in all under ZeRO" if want == 1 else ""),
                )


def _covers(e: SliceEntry, layers, box) -> bool:
    # a per-layer cell is checked only against entries _entry found to have layers
    if layers is not None and not (e.layers[0] <= layers[0] and layers[1] - 1 <= e.layers[1]):  # type: ignore[index]
        return False
    return all(a <= lo and hi <= b for (a, b), (lo, hi) in zip(e.box, box))


def _expected_owner(ctx: _Ctx, emu: Emu, spec: TensorSpec, state: str, layers, box):
    """Where a missing cell should be, by the sharding rule: that shard's slice of the tensor, or the shard."""
    model, lay = ctx.model, ctx.layout
    assert model is not None and lay is not None  # called only for an EMU whose layout and model exist
    for s in emu.shards:
        if spec.per_layer:
            lo, hi = lay.layers[s.pp]
            if not (lo <= layers[0] and layers[1] - 1 <= hi):
                continue
        elif s.pp not in model.stages_holding(spec, lay.pp):
            continue
        want = model.tp_box(spec, lay.tp, s.tp)
        if not all(a <= lo and hi <= b for (a, b), (lo, hi) in zip(want, box)):
            continue
        mine = [e for e in s.entries if e.family == spec.family and e.state == state]
        if mine and not any(_covers(e, layers, box) for e in mine):
            return mine[0].loc, (s.pp, s.tp)
        if not mine:
            return s.loc, (s.pp, s.tp)
    return emu.loc, None


def _bad_cell(spec: TensorSpec, num_layers: int, entries: list[SliceEntry], want: int):
    """None when the entries cover ``spec`` exactly ``want`` times, else (first bad cell, its count).

    The cell is a tuple of half-open spans, with the layer axis first for per-layer families.
    """
    shape = ((num_layers,) if spec.per_layer else ()) + spec.shape
    boxes = [e.region for e in entries]  # entries were checked: layers present exactly for per-layer families
    first, last = spec.span(num_layers)  # a family of some layers only is held 0 times elsewhere
    cuts = [
        sorted({0, n} | ({first, last + 1} if d == 0 and spec.per_layer else set()) | {x for b in boxes for x in b[d]})
        for d, n in enumerate(shape)
    ]
    index = [{x: i for i, x in enumerate(c)} for c in cuts]
    grid = np.zeros([len(c) - 1 for c in cuts], dtype=np.int32)
    for b in boxes:
        grid[tuple(slice(ix[lo], ix[hi]) for ix, (lo, hi) in zip(index, b))] += 1
    expect = np.full(grid.shape, want, dtype=np.int32)
    if spec.per_layer:
        outside = np.array([not (first <= a and b <= last + 1) for a, b in zip(cuts[0], cuts[0][1:])])
        expect[outside] = 0
    bad = np.argwhere(grid != expect)
    if not len(bad):
        return None
    cell = tuple(int(i) for i in bad[0])
    return tuple((cuts[d][i], cuts[d][i + 1]) for d, i in enumerate(cell)), int(grid[cell])


# ---------------------------------------------------------------- transitions


def holds_slice(outer: SliceEntry, state: str, family: str, layers, box) -> bool:
    if outer.state != state or outer.family != family:
        return False
    if layers is not None and (outer.layers is None or outer.layers[0] > layers[0] or outer.layers[1] < layers[1]):
        return False
    return all(a <= lo and hi <= b for (a, b), (lo, hi) in zip(outer.box, box)) and len(outer.box) == len(box)
