"""``plan-transition{to=@plan_b}``: the global transition graph from the module's plan to plan B.

For every model, every state it carries across a step (weights; fp32 master and Adam moments of
trained models) and every tensor family:

1. the source pieces (EMU slices of plan A, on their GPUs) and the destination pieces (EMU
   slices of plan B) are cut along every boundary of either, per dimension (the layer axis
   included), into cells;
2. a destination GPU that already holds a cell keeps it: nothing to do when the same
   model-stage keeps the same slice on the same GPU, a local ``copy`` otherwise;
3. every other cell a GPU needs is received once, from the least-loaded GPU that holds it (any
   replica of any model-stage of the same model), so senders are balanced; a cell that several
   GPUs need from one sender is one ``broadcast``;
4. cells with the same sender and receivers are merged back into boxes, and every source slice
   that plan B does not keep in place is freed after the operations that read it;
5. where the plans differ in what they keep in host memory, plan A's offloaded slices are
   loaded before they are read and plan B's are offloaded once they arrived.

Source slices on GPUs that plan B's cluster marks unavailable are lost: their data comes from
other replicas, and the pass reports what no surviving GPU holds.

Bytes moved (each received byte counted once per receiving GPU) and the lower bound
``sum over GPUs of |destination slices \\ slices already there|`` are recorded on the
transition; by construction every missing byte is received exactly once, so the ratio is 1.000.
Memory: where a GPU would exceed its memory holding plan A's state plus what it receives,
receives wait for the frees of that GPU's slices that no one reads; if that is not enough the
pass reports the GPU and the shortfall.
"""

from __future__ import annotations

import bisect
import itertools
from collections import defaultdict
from dataclasses import dataclass

from ..ir import Diagnostic, DiagnosticError, HostRef, Loc, Module, Op, ShardRef, Transition
from ..ir.verify_state import state_dtype_bytes
from .pass_manager import ModulePass, register

Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Piece:
    ref: ShardRef
    gpu: int
    region: Box  # half-open spans; the layer axis first for per-layer families


def ensure_emus(m: Module, plan_name: str) -> None:
    """Derive the EMUs of every model-stage of a plan that the module does not declare."""
    from .derive_emus import model_stage_emus

    for ms in m.plans[plan_name].layouts:
        if not m.emus_of(plan_name, ms):
            for e in model_stage_emus(m, plan_name, ms):
                m.emus[e.key] = e


def _pieces(m: Module, plan_name: str) -> dict[tuple[str, str, str], list[Piece]]:
    """(model, state, family) -> pieces, from the plan's EMUs."""
    out: dict[tuple[str, str, str], list[Piece]] = defaultdict(list)
    for (plan, ms, dp), emu in sorted(m.emus.items()):
        if plan != plan_name:
            continue
        model = ms.rpartition(".")[0]
        for s in emu.shards:
            ref = ShardRef(ms, dp, s.pp, s.tp)
            for e in s.entries:
                out[(model, e.state, e.family)].append(Piece(ref, s.gpu, e.region))
    return out


def _cells(region: Box, cuts: list[list[int]]):
    """The cells of ``cuts`` inside ``region`` (as tuples of interval indices)."""
    ranges = []
    for (lo, hi), c in zip(region, cuts):
        i, j = bisect.bisect_left(c, lo), bisect.bisect_left(c, hi)
        ranges.append(range(i, j))
    return itertools.product(*ranges)


def _merge(cells: list[tuple[int, ...]]) -> list[tuple[tuple[int, int], ...]]:
    """Merge a set of grid cells into boxes of cell-index spans (greedy along each axis)."""
    if len(cells) == 1:  # the common case: one cell, one box
        return [tuple((i, i + 1) for i in cells[0])]
    boxes = [tuple((i, i + 1) for i in c) for c in sorted(cells)]
    for axis in reversed(range(len(boxes[0]) if boxes else 0)):
        boxes.sort(key=lambda b: (tuple(x for k, x in enumerate(b) if k != axis), b[axis]))
        merged: list = []
        for b in boxes:
            if merged:
                p = merged[-1]
                if all(p[k] == b[k] for k in range(len(b)) if k != axis) and p[axis][1] == b[axis][0]:
                    merged[-1] = tuple((p[k][0], b[k][1]) if k == axis else p[k] for k in range(len(b)))
                    continue
            merged.append(b)
        boxes = merged
    return boxes


def plan_transition(m: Module, source: str, target: str, name: str, lost: set[int] | None = None) -> Transition:
    """Build the transition graph; see the module docstring.

    ``lost``: GPUs whose state is gone (default: those plan B's cluster marks unavailable). Pass
    an empty set for GPUs that leave with notice (a planned scale-in): they still send.
    """
    plan_a, plan_b = m.plans[source], m.plans[target]
    cluster = m.clusters[plan_b.cluster]
    for p in (source, target):
        ensure_emus(m, p)
    src_all, dst_all = _pieces(m, source), _pieces(m, target)
    # GPUs that failed since plan A (unavailable in plan B's cluster) hold nothing any more
    lost = set(cluster.unavailable) if lost is None else set(lost)
    src_all = {k: [p for p in v if p.gpu not in lost] for k, v in src_all.items()}
    ops: list[Op] = []
    load: dict[int, int] = defaultdict(int)  # bytes each GPU sends
    bytes_moved = lower = 0
    reads: dict[tuple, list[str]] = defaultdict(list)  # source slice -> ops that read it (for frees)
    kept: set[tuple] = set()  # (ref, state, family, region) of source slices reused in place
    recv_bytes: dict[int, int] = defaultdict(int)
    recv_ops: dict[int, list[str]] = defaultdict(list)
    kept_b: set[tuple] = set()  # (ref, state, family, region) of destination slices kept in place
    delivers: dict[tuple, list[str]] = defaultdict(list)  # (destination ref, state, family) -> ops writing it
    counter = itertools.count()

    def new_id() -> str:
        return f"%{next(counter)}"

    for key in sorted(dst_all):
        model_name, state, family = key
        model, itemsize, per_layer = _family(m, model_name, state, family)
        srcs, dsts = src_all.get(key, []), dst_all[key]
        if not srcs:
            raise DiagnosticError([Diagnostic(plan_a.loc, f"plan @{source} holds no {state} of {family} of @{model_name}, "
                                                          f"which plan @{target} needs", "both plans must carry the same state")])
        ndim = len(dsts[0].region)
        cuts = [sorted({x for p in srcs + dsts for x in p.region[d]}) for d in range(ndim)]
        sizes = [[c[i + 1] - c[i] for i in range(len(c) - 1)] for c in cuts]

        def cell_bytes(cell) -> int:
            n = itemsize
            for d, i in enumerate(cell):
                n *= sizes[d][i]
            return n

        cell_cache: dict[Box, list[tuple]] = {}  # replicas share regions: cut each region once

        def cells_of(region: Box) -> list[tuple]:
            if region not in cell_cache:
                cell_cache[region] = list(_cells(region, cuts))
            return cell_cache[region]

        holders: dict[tuple, list[Piece]] = defaultdict(list)
        on_gpu: dict[int, dict[tuple, list[Piece]]] = defaultdict(lambda: defaultdict(list))  # gpu -> cell -> local pieces
        for p in srcs:
            for cell in cells_of(p.region):
                holders[cell].append(p)
                on_gpu[p.gpu][cell].append(p)
        need: dict[int, dict[tuple, list[Piece]]] = defaultdict(lambda: defaultdict(list))  # gpu -> cell -> dst pieces
        for p in dsts:
            for cell in cells_of(p.region):
                need[p.gpu][cell].append(p)
        # local: keep in place, or copy from a source piece on the same GPU
        local_copies: dict[tuple, list[tuple]] = defaultdict(list)  # (src ref, dst ref) -> cells
        missing: dict[tuple, list[int]] = defaultdict(list)  # cell -> receiving GPUs
        for gpu in sorted(need):
            for cell, pieces in sorted(need[gpu].items()):
                local = on_gpu[gpu].get(cell)
                if not local:
                    missing[cell].append(gpu)
                    lower += cell_bytes(cell)
                    continue
                for d in pieces:
                    same = next((p for p in local if p.ref.model_stage == d.ref.model_stage and p.region == d.region), None)
                    if same is not None:  # the same model-stage keeps this very slice here: nothing to do
                        kept.add((same.ref, state, family, same.region))
                        kept_b.add((d.ref, state, family, d.region))
                    else:  # merged boxes must stay inside one source slice and one destination slice
                        local_copies[(local[0].ref, local[0].region, d.ref, d.region)].append(cell)
        # remote: one sender per cell, least loaded first; several receivers make a broadcast
        transfers: dict[tuple, list[tuple]] = defaultdict(list)  # (sender piece ref, receivers) -> cells
        for cell in sorted(missing):
            gpus = missing[cell]
            cands = holders.get(cell)
            if not cands:
                raise DiagnosticError([Diagnostic(plan_b.loc, f"no GPU of plan @{source} holds part of {state} {family} "
                                                              f"of @{model_name} that plan @{target} needs")])
            best = min(cands, key=lambda p: (load[p.gpu], p.gpu, p.ref.model_stage))
            load[best.gpu] += cell_bytes(cell) * len(gpus)
            receivers = tuple(dict.fromkeys((g, d.ref, d.region) for g in gpus for d in need[g][cell]))
            transfers[(best.ref, best.gpu, best.region, receivers)].append(cell)
        # insertion order is deterministic (it follows the sorted loops above): no need to sort
        for (sref, sregion, dref, _), cells in local_copies.items():
            for box in _merge(cells):
                region = tuple((cuts[d][a], cuts[d][b]) for d, (a, b) in enumerate(box))
                nbytes = _volume(region) * itemsize
                op = _op(new_id(), "copy", state, family, region, [sref], [dref], nbytes, "local", per_layer)
                ops.append(op)
                reads[(sref, state, family, sregion)].append(op.id)
                delivers[(dref, state, family)].append(op.id)
        for (sref, sgpu, sregion, receivers), cells in transfers.items():
            rgpus = sorted({g for g, _, _ in receivers})
            link = "nic" if any(cluster.node_of(g) != cluster.node_of(sgpu) for g in rgpus) else "nvlink"
            for box in _merge(cells):
                region = tuple((cuts[d][a], cuts[d][b]) for d, (a, b) in enumerate(box))
                nbytes = _volume(region) * itemsize
                kind = "send" if len(receivers) == 1 else "broadcast"
                op = _op(new_id(), kind, state, family, region, [sref], list(dict.fromkeys(r for _, r, _ in receivers)), nbytes, link, per_layer)
                ops.append(op)
                reads[(sref, state, family, sregion)].append(op.id)
                for dref in op.dst:
                    delivers[(dref, state, family)].append(op.id)
                bytes_moved += nbytes * len(rgpus)
                for g in rgpus:
                    recv_bytes[g] += nbytes
                    recv_ops[g].append(op.id)
    _residency(m, plan_a, plan_b, src_all, dst_all, ops, reads, kept, kept_b, delivers, new_id)
    # frees: every source slice not kept in place, after the operations that read it
    mem_a: dict[int, int] = defaultdict(int)
    freeable: dict[int, list[Op]] = defaultdict(list)
    for key, srcs in sorted(src_all.items()):
        model_name, state, family = key
        model, itemsize, per_layer = _family(m, model_name, state, family)
        for p in srcs:
            nbytes = _volume(p.region) * itemsize
            mem_a[p.gpu] += nbytes
            if (p.ref, state, family, p.region) in kept:
                continue
            op = _op(new_id(), "free", state, family, p.region, [p.ref], [], nbytes, "local", per_layer)
            op.deps = list(reads.get((p.ref, state, family, p.region), []))  # already in creation order
            ops.append(op)
            if not op.deps:
                freeable[p.gpu].append(op)
    problems = _order_for_memory(cluster, ops, mem_a, recv_ops, recv_bytes, freeable)
    if problems:
        raise DiagnosticError(problems)
    return Transition(name=name, source=source, target=target, ops=ops, bytes_moved=bytes_moved, lower_bound=lower)


def _family(m: Module, model_name: str, state: str, family: str):
    """(model, bytes per element of the state, whether the family is per layer)."""
    model = m.models[model_name]
    return model, state_dtype_bytes(model, state), model.tensors[family].per_layer


def _offloaded(plan, model_stage: str, state: str) -> bool:
    """Whether the plan keeps this state of the model-stage in host memory between stages."""
    return ("weights" if state == "weight" else "optimizer") in plan.layouts[model_stage].offload


def _residency(m, plan_a, plan_b, src_all, dst_all, ops, reads, kept, kept_b, delivers, new_id) -> None:
    """Loads and offloads where the plans differ in what lives in host memory.

    At a step boundary, plan A's offloaded state is in host memory: a slice that is read, or
    kept in place for a model-stage plan B keeps on the GPU, is loaded first (``load`` into
    plan A's shard; its readers wait for it). Plan B's offloaded state goes to host memory once
    it has arrived (``offload`` from plan B's shard, after the operations that wrote it); a slice
    both plans keep in host memory stays there.
    """
    by_id = {op.id: op for op in ops}
    gpu_of = {}
    for key, pieces in list(src_all.items()) + list(dst_all.items()):
        for p in pieces:
            gpu_of[p.ref] = p.gpu
    for (model_name, state, family), pieces in sorted(src_all.items()):
        model, itemsize, per_layer = _family(m, model_name, state, family)
        for p in pieces:
            if not _offloaded(plan_a, p.ref.model_stage, state):
                continue
            key = (p.ref, state, family, p.region)
            stays_on_host = key in kept and p.ref.model_stage in plan_b.layouts and _offloaded(plan_b, p.ref.model_stage, state)
            if not reads.get(key) and (key not in kept or stays_on_host):
                continue
            op = _op(new_id(), "load", state, family, p.region, [HostRef(p.gpu)], [p.ref], _volume(p.region) * itemsize,
                     "pcie", per_layer)
            ops.append(op)
            for reader in reads.get(key, []):
                by_id[reader].deps = sorted(set(by_id[reader].deps) | {op.id}, key=lambda x: int(x[1:]))
            reads[key] = [op.id] + reads.get(key, [])  # its free waits for the load too
    for (model_name, state, family), pieces in sorted(dst_all.items()):
        model, itemsize, per_layer = _family(m, model_name, state, family)
        for p in pieces:
            if not _offloaded(plan_b, p.ref.model_stage, state):
                continue
            if (p.ref, state, family, p.region) in kept_b and p.ref.model_stage in plan_a.layouts \
                    and _offloaded(plan_a, p.ref.model_stage, state):
                continue  # already in host memory, and stays there
            op = _op(new_id(), "offload", state, family, p.region, [p.ref], [HostRef(p.gpu)],
                     _volume(p.region) * itemsize, "pcie", per_layer)
            op.deps = list(delivers.get((p.ref, state, family), []))
            ops.append(op)


def _order_for_memory(cluster, ops: list[Op], mem_a, recv_ops, recv_bytes, freeable) -> list[Diagnostic]:
    """Make receives wait for frees of dead slices on GPUs that would otherwise overflow."""
    problems = []
    by_id = {op.id: op for op in ops}
    for g, rb in sorted(recv_bytes.items()):
        if mem_a[g] + rb <= cluster.gpu_memory:
            continue
        dead = freeable.get(g, [])
        short = mem_a[g] - sum(op.bytes for op in dead) + rb - cluster.gpu_memory
        if short > 0:
            problems.append(Diagnostic(Loc(0, 0, None), f"no order fits on GPU {g}: it would need {short:,} bytes more than "
                                                         "its memory even after freeing every slice no one reads first",
                                       "stage state through host memory, or transition in two steps"))
            continue
        for op_id in recv_ops[g]:
            op = by_id[op_id]
            op.deps = sorted(set(op.deps) | {d.id for d in dead}, key=lambda s: int(s[1:]))
    return problems


def _volume(region: Box) -> int:
    n = 1
    for lo, hi in region:
        n *= hi - lo
    return n


def _op(op_id, kind, state, family, region, src, dst, nbytes, link, per_layer: bool) -> Op:
    if per_layer:
        (l0, l1), box = region[0], region[1:]
        layers = (l0, l1 - 1)
    else:
        layers, box = None, region
    return Op(id=op_id, kind=kind, state=state, family=family, layers=layers, box=tuple(box), src=list(src),
              dst=list(dst), bytes=nbytes, link=link)


@register
@dataclass(frozen=True)
class PlanTransition(ModulePass):
    """Options: ``to`` (``@plan_b``), ``source`` (``@plan_a``; default: the other plan of the job),
    ``into`` (name of the transition), ``drain`` (true: GPUs plan B cannot use leave with notice
    and still send; default false: they failed and their state is lost)."""

    name = "plan-transition"
    to: str = ""
    source: str = ""
    into: str = ""
    drain: bool = False

    def apply(self, module: Module) -> None:
        target = self.to.lstrip("@")
        if target not in module.plans:
            raise DiagnosticError([Diagnostic(Loc(0, 0, module.filename), f"plan-transition: no plan @{target}",
                                              "plan-transition{to=@plan_b}")])
        source = self.source.lstrip("@")
        if not source:
            others = [p for p in module.plans if p != target and module.plans[p].workload == module.plans[target].workload]
            if len(others) != 1:
                raise DiagnosticError([Diagnostic(Loc(0, 0, module.filename),
                                                  f"plan-transition needs source=@plan_a: {len(others)} other plans of the job")])
            source = others[0]
        name = self.into.lstrip("@") or f"{source}_to_{target}"
        module.transitions[name] = plan_transition(module, source, target, name, lost=set() if self.drain else None)
