"""Rules for transitions: operations form a DAG, move real slices between real shards over the
right link, stage only what an ``unstage`` takes, and leave every destination EMU complete.

What each operation kind may read and write is its ``OpKind`` (``transition.OP_KINDS``).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from .diagnostics import DiagnosticSink, Loc, did_you_mean
from .emu import region_of, tensor_name, volume
from .model import state_dtype_bytes
from .module import Module
from .transition import HOST_READING_KINDS, HOST_WRITING_KINDS, HostRef, Op, ShardRef, Transition, unstage_feeders
from .verify_emus import format_box, holds_slice


def verify_transitions(m: Module, sink: DiagnosticSink) -> None:
    for t in m.transitions.values():
        plans = {}
        for side, key in (("source", t.source), ("target", t.target)):
            if key not in m.plans:
                sink.error(
                    t.locs.get(side, t.loc),
                    f"transition @{t.name} refers to unknown plan @{key}",
                    did_you_mean(key, m.plans),
                )
            plans[side] = m.plans.get(key)
        ids = {op.id: i for i, op in enumerate(t.ops)}
        index: dict = {}  # shard entries by tensor (``by_family``)
        for op in t.ops:
            for dep in op.deps:
                if dep not in ids:
                    sink.error(
                        op.locs.get("deps", op.loc),
                        f"{op.id} depends on unknown operation {dep}",
                        did_you_mean(dep, ids),
                    )
                elif dep == op.id:
                    sink.error(op.locs.get("deps", op.loc), f"{op.id} depends on itself")
            if plans["source"] is not None and plans["target"] is not None:
                _op(m, t, op, sink, index)
        _cycles(t, ids, sink)
        _staging(t, sink)
        if plans["source"] is not None and plans["target"] is not None and not sink.diagnostics:
            _destinations_complete(m, t, sink)


def _destinations_complete(m: Module, t: Transition, sink: DiagnosticSink) -> None:
    """After all operations, every slice of every destination EMU is held: delivered by an
    operation, or kept in place (the same model-stage's identical slice on the same GPU, not freed).
    A transition planned with ``restore`` (``restored`` set) leaves the slices only failed GPUs
    held to a read from a checkpoint at run time (``runtime.dcp.restore_lost``, which works out
    the same slices from the survivors' shards): it is not held to this."""
    target_emus = [e for e in m.emus.values() if e.plan == t.target]
    if not target_emus or t.restored is not None:
        return
    delivered: dict[tuple, list] = defaultdict(list)
    freed: set[tuple] = set()
    for op in t.ops:
        region = region_of(op.layers, op.box)
        if op.spec.frees:
            for ref in op.src:
                for st in op.states:
                    freed.add((ref, st, op.family, region))
        elif op.spec.delivers:  # (load and offload move a slice between a GPU and its host)
            for ref in op.dst:
                for st in op.states:
                    delivered[(ref, st, op.family)].append(region)
    in_place: dict[tuple, set] = defaultdict(set)
    for (plan, ms, dp), emu in m.emus.items():
        if plan != t.source:
            continue
        for s in emu.shards:
            ref = ShardRef(ms, dp, s.pp, s.tp)
            for e in s.entries:
                region = e.region
                if (ref, e.state, e.family, region) not in freed:
                    in_place[(s.gpu, ms, e.state, e.family)].add(region)
    for emu in sorted(target_emus, key=lambda e: e.key):
        for s in emu.shards:
            ref = ShardRef(emu.model_stage, emu.replica, s.pp, s.tp)
            for e in s.entries:
                region = e.region
                if region in in_place[(s.gpu, emu.model_stage, e.state, e.family)]:
                    continue
                boxes = delivered.get((ref, e.state, e.family), [])
                if _uncovered(region, boxes):
                    sink.error(
                        t.loc,
                        f"transition @{t.name} leaves {ref} without all of {e.state} {e.tensor} {format_box(e.box)}",
                        "no operation delivers part of it and it is not kept in place",
                    )
                    return


def _staging(t: Transition, sink: DiagnosticSink) -> None:
    """A slice staged in ``host[g]`` by a copy or send is moved onto GPU g by an ``unstage`` that
    depends on that operation, and an ``unstage`` reads exactly what the operations it depends on
    staged there: their slices of its tensor lie inside its box, overlap nowhere and fill it (one
    unstage may take the slices many senders staged for one new shard)."""
    by_id = {op.id: op for op in t.ops}
    taken: set[tuple[str, int]] = set()
    for op in t.ops:
        if not (op.spec.reads_host and op.spec.delivers) or not op.src or not isinstance(op.src[0], HostRef):
            continue
        g = op.src[0].gpu
        feeders = unstage_feeders(op, by_id)
        if not feeders:
            sink.error(
                op.locs.get("deps", op.loc),
                f"{op.id}: unstage reads {op.state} {op.tensor} {format_box(op.box)} "
                f"from {op.src[0]}, but depends on no operation that stages it there",
            )
            continue
        if not _tiles([f.box for f in feeders], op.box):
            sink.error(
                op.locs.get("deps", op.loc),
                f"{op.id}: unstage reads {op.state} {op.tensor} {format_box(op.box)} "
                f"from {op.src[0]}, but the slices its dependencies "
                f"({', '.join(f.id for f in feeders)}) stage there do not fill it once",
            )
        taken.update((f.id, g) for f in feeders)
    for op in t.ops:
        if op.spec.stages:
            for ref in op.dst:
                if isinstance(ref, HostRef) and (op.id, ref.gpu) not in taken:
                    sink.error(
                        op.loc,
                        f"{op.id} stages {op.state} {op.tensor} {format_box(op.box)} in {ref}, but no unstage "
                        f"moves it onto GPU {ref.gpu}",
                        f"add: unstage ... from [{ref}] to [SHARD] {{deps = [{op.id}]}}",
                    )


def _tiles(boxes: list, outer) -> bool:
    """Whether ``boxes``, each inside ``outer``, fill it exactly: no two overlap and their volumes add up to it."""
    if sum(volume(b) for b in boxes) != volume(outer):
        return False
    active: list = []  # a sweep along the first axis: boxes still open at the current start
    for b in sorted(boxes):
        active = [a for a in active if a[0][1] > b[0][0]]
        if any(all(lo < bb and aa < hi for (lo, hi), (aa, bb) in zip(a, b)) for a in active):
            return False
        active.append(b)
    return True


def _uncovered(region, boxes) -> bool:
    """Whether some element of ``region`` lies in none of ``boxes``."""
    inside = [b for b in boxes if all(lo < bb and aa < hi for (lo, hi), (aa, bb) in zip(region, b))]
    if not inside:
        return True
    cuts = [sorted({lo, hi} | {min(max(x, lo), hi) for b in inside for x in b[d]}) for d, (lo, hi) in enumerate(region)]
    index = [{x: i for i, x in enumerate(c)} for c in cuts]
    grid = np.zeros([len(c) - 1 for c in cuts], dtype=bool)
    for b in inside:
        grid[
            tuple(
                slice(ix[min(max(lo, c[0]), c[-1])], ix[min(max(hi, c[0]), c[-1])])
                for ix, c, (lo, hi) in zip(index, cuts, b)
            )
        ] = True
    return not grid.all()


def _cycles(t: Transition, ids: dict[str, int], sink: DiagnosticSink) -> None:
    color: dict[str, int] = {}
    deps = {op.id: [d for d in op.deps if d in ids and d != op.id] for op in t.ops}
    for root in deps:
        if color.get(root):
            continue
        stack = [(root, iter(deps[root]))]
        color[root] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                color[node] = 2
                stack.pop()
            elif color.get(nxt) == 1:
                op = t.ops[ids[node]]
                sink.error(
                    op.locs.get("deps", op.loc),
                    f"dependency cycle through {node} and {nxt}",
                    "operations must form a DAG",
                )
                return
            elif not color.get(nxt):
                color[nxt] = 1
                stack.append((nxt, iter(deps[nxt])))


def _either(kinds) -> str:
    return ", ".join(kinds[:-1]) + " and " + kinds[-1]


def _endpoint(m: Module, plan_name: str, ref, loc: Loc, sink: DiagnosticSink):
    """Resolve an endpoint to (gpu, shard entries or None for host, model); reports errors."""
    if isinstance(ref, HostRef):
        return ref.gpu, None, None
    emu = m.emus.get((plan_name, ref.model_stage, ref.dp))
    if emu is None:
        sink.error(
            loc,
            f"{ref} refers to EMU {ref.model_stage}[{ref.dp}] of plan @{plan_name}, which is not declared",
            "declare it with: emu @" + plan_name + f" {ref.model_stage}[{ref.dp}] {{ ... }}",
        )
        return None
    shard = emu.shard(ref.pp, ref.tp)
    if shard is None:
        sink.error(loc, f"{ref}: EMU {ref.model_stage}[{ref.dp}] has no shard [{ref.pp}, {ref.tp}]")
        return None
    plan = m.plans[plan_name]
    lay = plan.layouts.get(ref.model_stage)
    model = m.models.get(lay.model) if lay else None
    return shard.gpu, shard.entries, model


def by_family(index: dict, entries: list) -> dict:
    """``entries`` grouped by (family, state), cached in ``index`` by the list's identity: an
    operation checks only the entries of its tensor (a shard of a mixture of experts holds
    thousands of tensors, and a scan of them all per operation cost 250 of 300 s of a move's
    checks in the simulator)."""
    got = index.get(id(entries))
    if got is None or got[0] is not entries:
        groups: dict = {}
        for e in entries:
            groups.setdefault((e.family, e.state), []).append(e)
        got = index[id(entries)] = (entries, groups)
    return got[1]


def _op(m: Module, t: Transition, op: Op, sink: DiagnosticSink, index: dict) -> None:
    """``index``: each shard's entries by (family, state), built once per transition (``by_family``)."""
    kind = op.spec
    (smin, smax), (dmin, dmax) = kind.sources, kind.destinations
    for side, got, lo, hi in (("source", len(op.src), smin, smax), ("destination", len(op.dst), dmin, dmax)):
        if got < lo or (hi is not None and got > hi):
            want = f"exactly {lo}" if lo == hi else (f"at least {lo}" if hi is None else f"{lo} to {hi}")
            noun = side if hi == 1 else side + "s"  # "exactly 1 destination", "1 to 2 sources"
            sink.error(op.loc, f"{op.id}: {op.kind} takes {want} {noun}, got {got}")
            return
    locs = op.endpoint_locs or [op.loc] * (len(op.src) + len(op.dst))
    src_host = [isinstance(e, HostRef) for e in op.src]
    dst_host = [isinstance(e, HostRef) for e in op.dst]
    if kind.reads_host and not all(src_host) or not kind.reads_host and any(src_host):
        sink.error(
            op.loc,
            f"{op.id}: only {_either(HOST_READING_KINDS)} read from host memory"
            if any(src_host)
            else f"{op.id}: {op.kind} reads from host[GPU]",
        )
        return
    if kind.writes_host and not all(dst_host) or op.kind not in HOST_WRITING_KINDS and any(dst_host):
        sink.error(
            op.loc,
            f"{op.id}: only {_either(HOST_WRITING_KINDS)} write to host memory"
            if any(dst_host)
            else f"{op.id}: {op.kind} writes to host[GPU]",
        )
        return
    # which plan's EMUs the endpoints name: load restores a slice of plan A from host memory
    # before it is read; offload moves a slice of plan B to host memory after it arrived
    src_plan = t.target if kind.source_plan == "target" else t.source
    dst_plan = t.source if kind.destination_plan == "source" else t.target
    src = [_endpoint(m, src_plan, e, l, sink) for e, l in zip(op.src, locs)]
    dst = [_endpoint(m, dst_plan, e, l, sink) for e, l in zip(op.dst, locs[len(op.src) :])]
    if any(x is None for x in src + dst):
        return
    model = next((x[2] for x in src + dst if x[2] is not None), None)
    if model is None:
        return
    spec = model.tensors.get(op.family)
    if spec is None:
        sink.error(
            op.locs.get("tensor", op.loc),
            f"model @{model.name} has no tensor {op.family}",
            did_you_mean(op.family, model.tensors),
        )
        return
    tensor = tensor_name(op.family, op.layers)
    shape = spec.shape
    if (
        len(op.box) != len(shape)
        or any(hi > n for (_, hi), n in zip(op.box, shape))
        or (op.layers is None) == spec.per_layer
        or (op.layers is not None and op.layers[1] >= model.layers)
    ):
        sink.error(
            op.locs.get("tensor", op.loc),
            f"{op.id}: slice {tensor} {format_box(op.box)} is outside the tensor of shape {list(shape)}",
        )
        return

    def lacks(entries) -> str | None:
        """The first of the operation's states whose slice ``entries`` do not hold (None: all held)."""
        mine = by_family(index, entries)
        return next(
            (
                st
                for st in op.states
                if not any(holds_slice(e, st, op.family, op.layers, op.box) for e in mine.get((op.family, st), ()))
            ),
            None,
        )

    def what(st: str) -> str:
        return tensor if st == "weight" else f"{st} {tensor}"

    for (gpu, entries, _), ref, loc in zip(src, op.src, locs):
        if entries is None:
            continue
        st = lacks(entries)
        if st is not None:
            sink.error(loc, f"{op.id}: source {ref} does not hold {what(st)} {format_box(op.box)}")
    for (gpu, entries, _), ref, loc in zip(dst, op.dst, locs[len(op.src) :]):
        if entries is None:
            continue
        st = lacks(entries)
        if st is not None:
            sink.error(
                loc, f"{op.id}: destination {ref} does not hold {what(st)} {format_box(op.box)} in plan @{dst_plan}"
            )
    numel = 1 if op.layers is None else op.layers[1] - op.layers[0] + 1
    for lo, hi in op.box:
        numel *= hi - lo
    want_bytes = numel * state_dtype_bytes(model, op.state)
    if not kind.frees and op.bytes != want_bytes:
        sink.error(
            op.locs.get("bytes", op.loc),
            f"{op.id}: bytes = {op.bytes} but the slice is {want_bytes} bytes "
            f"({numel} elements of {state_dtype_bytes(model, op.state)} bytes)",
        )
    cluster = m.clusters.get(m.plans[t.target].cluster)
    if cluster is None:
        return
    gpus = [x[0] for x in src + dst]
    if kind.pcie or kind.local and any(dst_host):
        if (kind.delivers or kind.local) and any(g != gpus[0] for g in gpus):
            direction = "from host[g] onto GPU g" if kind.reads_host else "from GPU g into host[g]"
            sink.error(op.loc, f"{op.id}: {op.kind} moves a slice {direction}, not between GPUs {sorted(set(gpus))}")
            return
        link = "pcie"
    elif kind.frees or len(set(gpus)) == 1:
        link = "local"
    else:
        link = "nic" if len({cluster.node_of(g) for g in gpus}) > 1 else "nvlink"
    if op.link != link:
        sink.error(
            op.locs.get("link", op.loc),
            f"{op.id}: link = {op.link}, but GPUs {sorted(set(gpus))} communicate over {link}",
        )
