"""A reference executor of transitions on numpy arrays: each GPU a dict of slices.

Runs a transition's operations in dependency order on real arrays: plan A's slices are cut
from full tensors, operations copy, send and broadcast slices between the GPUs' dicts (or into
the host memory beside a GPU, to be unstaged later) and free them, and at the end every slice of
plan B is compared with the same slice of the full tensor. Along the way it records the most
bytes each GPU held (at the state's dtype) in a greedy order chosen to stress memory: copies,
receives and unstages as early as their dependencies allow, frees as late (``_order``; a
heuristic, not a proof that no order needs more). A ``free`` that does not match a held slice
exactly is an error.
It is the oracle the torch.distributed executor is tested against, and a dry run for users.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass, field, replace

import numpy as np

from ..ir import HostRef, Module, ShardRef, Transition
from ..ir.emu import SliceEntry, region_of
from ..ir.model import state_dtype_bytes


@dataclass
class SimulationResult:
    mismatches: list[str]  # destination slices that differ from the full tensor
    received_bytes: int  # bytes (at the state's dtype) delivered to GPUs other than the sender, once per GPU
    peak: dict[int, int] = field(default_factory=dict)  # GPU -> most bytes it held at once


def full_tensors(m: Module, plans: list[str], seed: int = 0) -> dict[tuple[str, str, str], np.ndarray]:
    """Random full tensors (layer axis first for per-layer families) for every (model, state, family) the plans hold."""
    rng = np.random.default_rng(seed)
    out = {}
    for (plan, ms, _), emu in sorted(m.emus.items()):
        if plan not in plans:
            continue
        model = m.models[ms.rpartition(".")[0]]
        for s in emu.shards:
            for e in s.entries:
                key = (model.name, e.state, e.family)
                if key not in out:
                    spec = model.tensors[e.family]
                    shape = ((model.layers,) if spec.per_layer else ()) + spec.shape
                    out[key] = rng.standard_normal(shape).astype(np.float32)
    return out


def _order(t: Transition) -> list:
    """A dependency order chosen to stress memory, greedily: whatever grows a GPU (copies,
    sends, unstages, loads) runs as soon as its dependencies allow, in listed order, and a
    ``free`` only when nothing else can run. A heuristic: it is not proven to be the order
    that needs the most memory, so a peak within the GPU's memory here is evidence, not proof."""
    index = {op.id: i for i, op in enumerate(t.ops)}
    waiting = {op.id: len(op.deps) for op in t.ops}
    after: dict[str, list[str]] = defaultdict(list)
    for op in t.ops:
        for d in op.deps:
            after[d].append(op.id)
    ready = [(op.spec.frees, i) for i, op in enumerate(t.ops) if not op.deps]
    heapq.heapify(ready)
    order = []
    while ready:
        _, i = heapq.heappop(ready)
        op = t.ops[i]
        order.append(op)
        for nxt in after[op.id]:
            waiting[nxt] -= 1
            if waiting[nxt] == 0:
                heapq.heappush(ready, (t.ops[index[nxt]].spec.frees, index[nxt]))
    if len(order) != len(t.ops):
        raise ValueError(f"transition @{t.name} has a dependency cycle")
    return order


def _offloaded(m: Module, plan: str, model_stage: str, state: str) -> bool:
    lay = m.plans[plan].layouts[model_stage]
    return ("weights" if state == "weight" else "optimizer") in lay.offload


def simulate(m: Module, t: Transition, tensors=None) -> SimulationResult:
    tensors = tensors or full_tensors(m, [t.source, t.target])
    # memory: (plan, ref, state, family, where) -> list of (region, array); where is gpu or host
    mem: dict[tuple, list[tuple[tuple, np.ndarray]]] = defaultdict(list)
    gpu_of: dict[tuple[str, ShardRef], int] = {}
    held: dict[int, int] = defaultdict(int)  # bytes on each GPU now
    peak: dict[int, int] = defaultdict(int)
    itemsize = {
        (name, state): state_dtype_bytes(md, state)
        for name, md in m.models.items()
        for state in ("weight", "grad", "master", "exp_avg", "exp_avg_sq")
    }

    def put(key, region, arr, model: str) -> None:
        """Store a slice; on a GPU it counts toward that GPU's bytes."""
        mem[key].append((region, arr))
        plan, ref, state, _, where = key
        if where == "gpu":
            g = gpu_of[(plan, ref)]
            held[g] += arr.size * itemsize[(model, state)]
            peak[g] = max(peak[g], held[g])

    for (plan, ms, dp), emu in m.emus.items():
        model = ms.rpartition(".")[0]
        for s in emu.shards:
            ref = ShardRef(ms, dp, s.pp, s.tp)
            gpu_of[(plan, ref)] = s.gpu
            if plan != t.source:
                continue
            for e in s.entries:
                region = region_of(e.layers, e.box)
                arr = tensors[(model, e.state, e.family)][tuple(slice(a, b) for a, b in region)].copy()
                where = "host" if _offloaded(m, plan, ms, e.state) else "gpu"  # at a step boundary
                put((plan, ref, e.state, e.family, where), region, arr, model)

    def take(key, region) -> np.ndarray:
        """``region`` of what ``key`` holds, assembled from the pieces it received; KeyError if incomplete."""
        out = np.full(tuple(hi - lo for lo, hi in region), np.nan, dtype=np.float32)
        for reg, arr in mem[key]:
            inter = [(max(a, lo), min(b, hi)) for (a, b), (lo, hi) in zip(reg, region)]
            if all(lo < hi for lo, hi in inter):
                out[tuple(slice(lo - r0, hi - r0) for (lo, hi), (r0, _) in zip(inter, region))] = arr[
                    tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(inter, reg))
                ]
        if np.isnan(out).any():
            plan, ref, state, family, where = key
            raise KeyError(
                f"{ref} of @{plan} holds no {state} {family} {region} on its {where} (read too early, or freed?)"
            )
        return out

    received = 0
    for op in (replace(o, state=st) if len(o.states) > 1 else o for o in _order(t) for st in o.states):
        # an operation on a group of states (``optimizer``) runs as one per member state here
        region = region_of(op.layers, op.box)
        model = (op.src[0] if isinstance(op.src[0], ShardRef) else op.dst[0]).model_stage.rpartition(".")[0]
        kind = op.spec
        if kind.frees:
            for ref in op.src:
                key = (t.source, ref, op.state, op.family, "gpu")
                if not any(r == region for r, _ in mem[key]):
                    host = (t.source, ref, op.state, op.family, "host")
                    if any(r == region for r, _ in mem[host]):  # never left host memory: frees no GPU memory
                        mem[host] = [(r, a) for r, a in mem[host] if r != region]
                        continue
                    raise ValueError(
                        f"{op.id} frees {op.state} {op.tensor} {list(op.box)} of {ref}, which neither "
                        f"its GPU nor its host memory holds as one slice (a free must match a slice exactly)"
                    )
                gone = sum(a.size for r, a in mem[key] if r == region)
                held[gpu_of[(t.source, ref)]] -= gone * itemsize[(model, op.state)]
                mem[key] = [(r, a) for r, a in mem[key] if r != region]
            continue
        if kind.reads_host and kind.writes == "a":  # load: plan A's slice, from its host memory back onto its GPU
            for ref in op.dst:
                data = take((t.source, ref, op.state, op.family, "host"), region)
                put((t.source, ref, op.state, op.family, "gpu"), region, data.copy(), model)
            continue
        if kind.reads_host:  # unstage: a staged slice, from the host memory beside GPU g onto g
            data = take(_staging(op.src[0], model, op.state, op.family), region)
            for ref in op.dst:
                put((t.target, ref, op.state, op.family, "gpu"), region, data.copy(), model)
            continue
        if kind.writes_host:  # offload: plan B's slice, once arrived (or kept in place), to host memory
            for ref in op.src:
                try:
                    data = take((t.target, ref, op.state, op.family, "gpu"), region)
                except KeyError:  # kept in place: plan A's identical slice of the same model-stage on that GPU
                    g = gpu_of[(t.target, ref)]
                    data = next(
                        a
                        for (plan, r, st, fam, where), pieces in mem.items()
                        if plan == t.source
                        and where == "gpu"
                        and st == op.state
                        and fam == op.family
                        and r.model_stage == ref.model_stage
                        and gpu_of[(plan, r)] == g
                        for reg, a in pieces
                        if reg == region
                    )
                mem[(t.target, ref, op.state, op.family, "host")].append((region, data.copy()))
                g = gpu_of[(t.target, ref)]
                arrived = mem[(t.target, ref, op.state, op.family, "gpu")]
                gone = sum(
                    a.size for r, a in arrived if all(lo <= a0 and b0 <= hi for (a0, b0), (lo, hi) in zip(r, region))
                )
                held[g] -= gone * itemsize[(model, op.state)]
            continue
        data = take((t.source, op.src[0], op.state, op.family, "gpu"), region)
        src_gpu = gpu_of[(t.source, op.src[0])]
        nbytes = data.size * state_dtype_bytes(m.models[model], op.state)
        receivers = set()
        for ref in op.dst:
            if isinstance(ref, HostRef):  # staged beside GPU g
                mem[_staging(ref, model, op.state, op.family)].append((region, data.copy()))
                g = ref.gpu
            else:
                put((t.target, ref, op.state, op.family, "gpu"), region, data.copy(), model)
                g = gpu_of[(t.target, ref)]
            if g != src_gpu:
                receivers.add(g)
        received += len(receivers) * nbytes
    # what stayed in place: source slices (not freed) by GPU, model-stage and location
    in_place: dict[tuple, list] = defaultdict(list)
    for (plan, ref, state, family, where), pieces in mem.items():
        if plan == t.source:
            in_place[(gpu_of[(plan, ref)], ref.model_stage, state, family)].extend(pieces)
    mismatches = []
    for (plan, ms, dp), emu in sorted(m.emus.items()):
        if plan != t.target:
            continue
        model = ms.rpartition(".")[0]
        for s in emu.shards:
            ref = ShardRef(ms, dp, s.pp, s.tp)
            for e in s.entries:
                kept = in_place[(s.gpu, ms, e.state, e.family)]
                arrived = (
                    mem[(t.target, ref, e.state, e.family, "gpu")] + mem[(t.target, ref, e.state, e.family, "host")]
                )
                if not _complete(arrived, kept, e, tensors[(model, e.state, e.family)]):
                    mismatches.append(f"{ref} {e.state} {e.tensor} {list(e.box)}")
    return SimulationResult(mismatches, received, dict(peak))


def _staging(host: HostRef, model: str, state: str, family: str) -> tuple:
    """Where a staged slice waits: the host memory beside GPU ``host.gpu`` (a ``take`` key)."""
    return (f"staging of @{model}", host, state, family, "host")


def _complete(arrived, kept, e: SliceEntry, full: np.ndarray) -> bool:
    """Assemble the destination slice from what arrived (or stayed in place) and compare with the truth."""
    region = region_of(e.layers, e.box)
    out = np.full(tuple(hi - lo for lo, hi in region), np.nan, dtype=np.float32)
    # kept in place: the same model-stage's identical source slice on the same GPU, never freed
    pieces = list(arrived) + [(r, a) for r, a in kept if r == region]
    for reg, arr in pieces:
        if all(a <= lo and hi <= b for (lo, hi), (a, b) in zip(reg, region)):
            out[tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(reg, region))] = arr
    truth = full[tuple(slice(a, b) for a, b in region)]
    return bool(np.array_equal(out, truth))
