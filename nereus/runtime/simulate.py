"""A reference executor of transitions on numpy arrays: each GPU a dict of slices.

Runs a transition's operations in dependency order on real arrays: plan A's slices are cut
from full tensors, operations copy, send and broadcast slices between the GPUs' dicts and free
them, and at the end every slice of plan B is compared with the same slice of the full tensor.
It is the oracle the torch.distributed executor is tested against, and a dry run for users.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from ..ir import Module, ShardRef, Transition
from ..ir.emu import SliceEntry
from ..ir.verify_state import state_dtype_bytes


@dataclass
class SimulationResult:
    mismatches: list[str]  # destination slices that differ from the full tensor
    received_bytes: int  # bytes (at the state's dtype) delivered to GPUs other than the sender, once per GPU


def _region(layers, box) -> tuple:
    return (((layers[0], layers[1] + 1),) if layers is not None else ()) + tuple(box)


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
    """Operations in a valid order: each after its dependencies, otherwise as listed."""
    by_id = {op.id: op for op in t.ops}
    done, order = set(), []
    for op in t.ops:
        stack = [(op, iter(op.deps))]
        while stack:
            cur, it = stack[-1]
            if cur.id in done:
                stack.pop()
                continue
            nxt = next(it, None)
            if nxt is None:
                done.add(cur.id)
                order.append(cur)
                stack.pop()
            elif nxt not in done:
                stack.append((by_id[nxt], iter(by_id[nxt].deps)))
    return order


def simulate(m: Module, t: Transition, tensors=None) -> SimulationResult:
    tensors = tensors or full_tensors(m, [t.source, t.target])
    # memory: (plan, ref, state, family) -> list of (region, array); a shard may hold pieces
    mem: dict[tuple, list[tuple[tuple, np.ndarray]]] = defaultdict(list)
    gpu_of: dict[tuple[str, ShardRef], int] = {}
    for (plan, ms, dp), emu in m.emus.items():
        model = ms.rpartition(".")[0]
        for s in emu.shards:
            ref = ShardRef(ms, dp, s.pp, s.tp)
            gpu_of[(plan, ref)] = s.gpu
            if plan != t.source:
                continue
            for e in s.entries:
                region = _region(e.layers, e.box)
                arr = tensors[(model, e.state, e.family)][tuple(slice(a, b) for a, b in region)].copy()
                mem[(plan, ref, e.state, e.family)].append((region, arr))

    def read(plan, ref, state, family, region) -> np.ndarray:
        for reg, arr in mem[(plan, ref, state, family)]:
            if all(a <= lo and hi <= b for (a, b), (lo, hi) in zip(reg, region)):
                return arr[tuple(slice(lo - a, hi - a) for (a, _), (lo, hi) in zip(reg, region))]
        raise KeyError(f"{ref} of @{plan} holds no {state} {family} {region} (freed too early?)")

    received = 0
    for op in _order(t):
        model = op.src[0].model_stage.rpartition(".")[0] if op.src else None
        region = _region(op.layers, op.box)
        if op.kind == "free":
            for ref in op.src:
                key = (t.source, ref, op.state, op.family)
                mem[key] = [(r, a) for r, a in mem[key] if r != region]
            continue
        data = read(t.source, op.src[0], op.state, op.family, region)
        src_gpu = gpu_of[(t.source, op.src[0])]
        nbytes = data.size * state_dtype_bytes(m.models[model], op.state)
        receivers = set()
        for ref in op.dst:
            mem[(t.target, ref, op.state, op.family)].append((region, data.copy()))
            g = gpu_of[(t.target, ref)]
            if g != src_gpu:
                receivers.add(g)
        received += len(receivers) * nbytes
    # what stayed in place: source slices (not freed) by GPU and model-stage
    in_place: dict[tuple, list] = defaultdict(list)
    for (plan, ref, state, family), pieces in mem.items():
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
                if not _complete(mem[(t.target, ref, e.state, e.family)], kept, e, tensors[(model, e.state, e.family)]):
                    mismatches.append(f"{ref} {e.state} {e.tensor} {list(e.box)}")
    return SimulationResult(mismatches, received)


def _complete(arrived, kept, e: SliceEntry, full: np.ndarray) -> bool:
    """Assemble the destination slice from what arrived (or stayed in place) and compare with the truth."""
    region = _region(e.layers, e.box)
    out = np.full(tuple(hi - lo for lo, hi in region), np.nan, dtype=np.float32)
    # kept in place: the same model-stage's identical source slice on the same GPU, never freed
    pieces = list(arrived) + [(r, a) for r, a in kept if r == region]
    for reg, arr in pieces:
        if all(a <= lo and hi <= b for (lo, hi), (a, b) in zip(reg, region)):
            out[tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(reg, region))] = arr
    truth = full[tuple(slice(a, b) for a, b in region)]
    return bool(np.array_equal(out, truth))
