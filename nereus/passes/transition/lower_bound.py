"""The bytes a transition must move at least, from the EMU boxes alone.

For every GPU g that plan B puts state on: the bytes of what plan B needs on g (every state of
every tensor, each element once however many model-stages of the model hold it there) that plan
A does not already hold on g (any model-stage of the same model; nothing on a GPU whose state
is lost). No transition can do with less: each such byte must arrive at g over some link.

This routine shares nothing with the planner (``transition.planner`` cuts cells on a grid of
every slice of both plans and picks senders): it intersects, per GPU and tensor, the union of
plan B's boxes with the union of plan A's by inclusion-exclusion-free coordinate compression
over that GPU's boxes only. ``plan-transition`` records it as the transition's ``lower_bound``,
so that ``bytes_moved == lower_bound`` is a check, not an identity.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Set
from functools import lru_cache

import numpy as np

from ...ir import Module
from ...ir.emu import Box, volume
from ...ir.model import state_dtype_bytes


def lower_bound(m: Module, source: str, target: str, lost: Set[int] = frozenset()) -> int:
    """Sum over GPUs of the bytes plan ``target`` needs there that plan ``source`` does not hold
    there; GPUs in ``lost`` hold nothing. Needs both plans' EMUs.

    Where a GPU holds, for a model, every slice list plan B puts there already under plan A
    (the same entries, compared by value; replicas share a list, so each is read once), nothing
    is missing there and its boxes are not intersected: the GPUs a move leaves alone cost a
    comparison, not the boxes of every tensor."""
    lists_a = _lists_on(m, source, lost)
    lists_b = _lists_on(m, target, frozenset())
    content: dict[int, tuple] = {}  # id of an entry list (alive in the EMUs) -> its entries by value

    def of(entries: tuple) -> tuple:
        out = content.get(id(entries))
        if out is None:
            out = content[id(entries)] = tuple((e.state, e.family, e.region) for e in entries)
        return out

    total = 0
    for (gpu, model), needed in lists_b.items():
        have = lists_a.get((gpu, model), ())
        if {of(x) for x in needed} <= {of(x) for x in have}:
            continue  # every slice plan B needs here is held here
        held: dict[tuple, set[Box]] = defaultdict(set)  # (state, family) -> regions
        need: dict[tuple, set[Box]] = defaultdict(set)
        for lists, into in ((have, held), (needed, need)):
            for entries in lists:
                for e in entries:
                    into[(e.state, e.family)].add(e.region)
        for (state, family), regions in need.items():
            missing = missing_volume(frozenset(regions), frozenset(held.get((state, family), ())))
            total += missing * state_dtype_bytes(m.models[model], state)
    return total


def _lists_on(m: Module, plan: str, lost) -> dict[tuple[int, str], list[tuple]]:
    """(GPU, model) -> the entry lists of the plan's shards on that GPU (none on ``lost`` GPUs)."""
    out: dict[tuple[int, str], list[tuple]] = defaultdict(list)
    for (p, ms, _dp), emu in m.emus.items():
        if p != plan:
            continue
        model = ms.rpartition(".")[0]
        for s in emu.shards:
            if s.gpu not in lost:
                out[(s.gpu, model)].append(s.entries)
    return out


def _inside(a: Box, b: Box) -> bool:
    return all(blo <= alo and ahi <= bhi for (alo, ahi), (blo, bhi) in zip(a, b))


def _meet(a: Box, b: Box) -> bool:
    return all(alo < bhi and blo < ahi for (alo, ahi), (blo, bhi) in zip(a, b))


@lru_cache(maxsize=1 << 16)
def missing_volume(need: frozenset[Box], have: frozenset[Box]) -> int:
    """Volume of union(need) minus union(have), on the grid of these boxes' own boundaries."""
    if len(need) == 1:  # the common case, a GPU's one slice of a tensor: inside a held box, or apart from all
        (b,) = need
        if any(_inside(b, h) for h in have):
            return 0
        if not any(_meet(b, h) for h in have):
            return volume(b)
    boxes = list(need) + list(have)
    ndim = len(boxes[0])
    cuts = [np.unique([x for b in boxes for x in b[d]]) for d in range(ndim)]
    shape = [len(c) - 1 for c in cuts]
    wanted = np.zeros(shape, dtype=bool)
    there = np.zeros(shape, dtype=bool)
    for grid, group in ((wanted, need), (there, have)):
        for b in group:
            grid[
                tuple(slice(int(np.searchsorted(c, lo)), int(np.searchsorted(c, hi))) for c, (lo, hi) in zip(cuts, b))
            ] = True
    sizes = np.ones(shape, dtype=np.int64)
    for d, c in enumerate(cuts):
        widths = np.diff(c).astype(np.int64)
        sizes *= widths.reshape([-1 if i == d else 1 for i in range(ndim)])
    return int(sizes[wanted & ~there].sum())
