"""The cell grid of one (model, state, family) for ``plan-transition``, and what one GPU keeps,
copies and misses on it.

Every boundary of every source and destination slice, per dimension, cuts the tensor into
cells. A cell is an ``int``: its interval indices in mixed radix, so that the order of cells is
the lexicographic order of their index tuples and dictionary keys hash as machine integers.
The replicas of a layout hold the same slices (derive-emus shares one entry list between them),
so a region is cut into cells once, and the decisions of a GPU are computed once per distinct
set of slices on a GPU and reused for every GPU holding the same set.
"""

from __future__ import annotations

import bisect
from typing import Any, NamedTuple

import numpy as np

from ...ir import ShardRef
from ...ir.emu import Box


class Holding(NamedTuple):
    """A slice one GPU holds under a plan: one EMU shard's entry of one (model, state, family)."""

    ref: ShardRef
    gpu: int
    region: Box  # half-open spans; the layer axis first for per-layer families
    rid: int  # the shard's index in its plan: ``ref`` as an integer key


class Grid:
    """The cells of the regions of one (model, state, family)."""

    def __init__(self, regions) -> None:
        regions = list(regions)
        ndim = len(regions[0])
        self.cuts = [sorted({x for r in regions for x in r[d]}) for d in range(ndim)]
        self.radix = [max(len(c) - 1, 1) for c in self.cuts]
        self._cells: dict[Box, list[int]] = {}
        self._spans: dict[Box, tuple[tuple[int, int], ...]] = {}
        self._info: dict[int, tuple[Box, int]] = {}

    def span(self, region: Box) -> tuple[tuple[int, int], ...]:
        """``region`` as half-open spans of interval indices, per dimension."""
        out = self._spans.get(region)
        if out is None:
            out = self._spans[region] = tuple(
                (bisect.bisect_left(c, lo), bisect.bisect_left(c, hi)) for (lo, hi), c in zip(region, self.cuts)
            )
        return out

    def pattern(self, pieces: list[Holding], by: str) -> tuple[bytes, bytes, tuple]:
        """How ``pieces`` lie on this grid, whatever its cuts' values: each piece's ``by``
        (``gpu`` or ``rid``) and its slice, a slice by the index of its first piece and the
        slices by their spans of interval indices. Two families with the same radix and pattern
        cut their grids alike (a slice's cells are fixed by its spans), so their cells, in
        cell numbers, lie alike; only their sizes differ."""
        first: dict[Box, int] = {}
        who = np.fromiter((getattr(p, by) for p in pieces), dtype=np.int64, count=len(pieces)).tobytes()
        slices = np.fromiter(
            (first.setdefault(p.region, len(first)) for p in pieces), dtype=np.int64, count=len(pieces)
        ).tobytes()
        return who, slices, tuple(map(self.span, first))

    def cells(self, region: Box) -> list[int]:
        """The cells inside ``region``, in ascending order."""
        out = self._cells.get(region)
        if out is None:
            out = [0]
            for (lo, hi), c, n in zip(region, self.cuts, self.radix):
                r = range(bisect.bisect_left(c, lo), bisect.bisect_left(c, hi))
                out = [x * n + i for x in out for i in r]
            self._cells[region] = out
        return out

    def cell_arrays(self, regions: list[Box]) -> list[np.ndarray]:
        """``cells(r)`` of every region, as arrays, made at once with numpy (a 1,024-GPU plan holds
        100,000 distinct slices of a tensor: one call each cost more than the cells)."""
        if not regions:
            return []
        ndim = len(self.radix)
        lo = np.empty((len(regions), ndim), dtype=np.int64)
        hi = np.empty((len(regions), ndim), dtype=np.int64)
        for d, cuts in enumerate(self.cuts):
            spans = np.asarray([r[d] for r in regions], dtype=np.int64).reshape(-1, 2)
            lo[:, d] = np.searchsorted(cuts, spans[:, 0])
            hi[:, d] = np.searchsorted(cuts, spans[:, 1])
        extent = np.maximum(hi - lo, 0)
        count = extent.prod(axis=1)
        total = int(count.sum())
        which = np.repeat(np.arange(len(regions)), count)
        rest = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)  # offset in its region
        cell = np.zeros(total, dtype=np.int64)
        stride = 1
        for d in reversed(range(ndim)):  # row-major inside each region: the last axis fastest
            e = extent[which, d]
            rest, i = np.divmod(rest, np.maximum(e, 1))
            cell += (lo[which, d] + i) * stride
            stride *= self.radix[d]
        return np.split(cell, np.cumsum(count)[:-1])

    def index(self, cell: int) -> tuple[int, ...]:
        """The interval index of ``cell`` along every dimension."""
        out = []
        for n in reversed(self.radix):
            cell, i = divmod(cell, n)
            out.append(i)
        return tuple(reversed(out))

    def sizes(self, cells) -> np.ndarray:
        """Elements of each cell (``info``'s count), for a sequence of cells at once."""
        rest = np.array(cells, dtype=np.int64)
        size = np.ones(len(rest), dtype=np.int64)
        for cuts, n in zip(reversed(self.cuts), reversed(self.radix)):
            rest, i = np.divmod(rest, n)
            size *= np.diff(np.asarray(cuts, dtype=np.int64))[i]
        return size

    def info(self, cell: int) -> tuple[Box, int]:
        """``cell`` as a region in elements, and its number of elements."""
        out = self._info.get(cell)
        if out is None:
            region = tuple((c[i], c[i + 1]) for c, i in zip(self.cuts, self.index(cell)))
            n = 1
            for lo, hi in region:
                n *= hi - lo
            out = self._info[cell] = (region, n)
        return out

    def boxes(self, cells: list[int]) -> list[Box]:
        """Merge cells into boxes (greedy along each axis), as regions in elements."""
        if len(cells) <= 1:
            return [self.info(c)[0] for c in cells]
        cuts = self.cuts
        if len(cells) < BOXES_ARRAYS:  # a few cells: numpy's cost per call is more than their work
            boxes = merge([self.index(c) for c in cells])  # (its bounding-box case first)
            return [tuple((c[a], c[b]) for c, (a, b) in zip(cuts, box)) for box in boxes]
        idx = np.empty((len(cells), len(self.radix)), dtype=np.int64)  # every cell's interval indices, at once
        rest = np.asarray(cells, dtype=np.int64)
        for d in reversed(range(len(self.radix))):
            rest, idx[:, d] = np.divmod(rest, self.radix[d])
        lo, hi = idx.min(axis=0).tolist(), idx.max(axis=0).tolist()
        n = 1
        for a, b in zip(lo, hi):
            n *= b - a + 1
        if n == len(cells):  # every cell of their bounding box: that box (``merge``'s first case)
            boxes = [tuple((a, b + 1) for a, b in zip(lo, hi))]
        elif len(cells) >= MERGE_ARRAYS:
            boxes = merge_arrays(idx)
        else:
            boxes = merge([tuple(x) for x in idx.tolist()])
        return [tuple((c[a], c[b]) for c, (a, b) in zip(cuts, box)) for box in boxes]


def merge(cells: list[tuple[int, ...]]) -> list[tuple[tuple[int, int], ...]]:
    """Merge a set of distinct grid cells into boxes of cell-index spans (greedy along each axis)."""
    if len(cells) == 1:  # the common case: one cell, one box
        return [tuple((i, i + 1) for i in cells[0])]
    lo, hi = [min(x) for x in zip(*cells)], [max(x) for x in zip(*cells)]
    n = 1
    for a, b in zip(lo, hi):
        n *= b - a + 1
    if n == len(cells):  # every cell of their bounding box: the greedy merge ends with that box
        return [tuple((a, b + 1) for a, b in zip(lo, hi))]
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


BOXES_ARRAYS = 32
"""From this many cells ``Grid.boxes`` finds their interval indices with numpy: below, one call of
``index`` each is faster (a 1,024-GPU move sends a million runs of a few cells each)."""
MERGE_ARRAYS = 64  # from this many cells ``merge_arrays`` (numpy) is faster than ``merge``


def merge_arrays(idx: np.ndarray) -> list[tuple[tuple[int, int], ...]]:
    """``merge`` on the cells whose interval indices are the rows of ``idx`` (distinct), with
    numpy: the same boxes in the same order. Each axis, last first: the boxes sorted as ``merge``
    sorts them (the other axes' spans, then this axis's), and each run of consecutive boxes that
    agree on the other axes and touch on this one becomes one box."""
    lo = idx.astype(np.int64, copy=True)
    hi = lo + 1
    ndim = lo.shape[1]
    for axis in reversed(range(ndim)):
        others = [k for k in range(ndim) if k != axis]
        keys = [x for k in others for x in (lo[:, k], hi[:, k])] + [lo[:, axis], hi[:, axis]]
        order = np.lexsort(keys[::-1])  # lexsort's last key is its first
        lo, hi = lo[order], hi[order]
        joins = hi[:-1, axis] == lo[1:, axis]
        if others:
            joins &= (lo[1:, others] == lo[:-1, others]).all(axis=1) & (hi[1:, others] == hi[:-1, others]).all(axis=1)
        starts = np.flatnonzero(np.r_[True, ~joins])
        ends = np.r_[starts[1:], len(lo)] - 1
        end = hi[ends, axis]
        lo, hi = lo[starts], hi[starts]
        hi[:, axis] = end
    return [tuple(zip(a, b)) for a, b in zip(lo.tolist(), hi.tolist())]


class Local(NamedTuple):
    """What one GPU does with its cells, by position in its source and destination slice lists."""

    keeps: list[tuple[int, int]]  # (source, destination): the same model-stage keeps this slice here
    copies: list[tuple[int, int, list[int]]]  # (source, destination, cells) copied on the GPU
    # the missing (cell, destination) pairs as two arrays: cells ascending, and for each cell the
    # destinations needing it ascending
    missing: tuple[np.ndarray, np.ndarray]


def local(grid: Grid, srcs: list[tuple[str, Box]], dsts: list[tuple[str, Box]]) -> Local:
    """Decisions of a GPU holding source slices ``srcs`` and needing ``dsts`` ((model-stage, region) each).

    A destination slice that a source slice of the same model-stage and region on the GPU holds
    is kept. Any other destination cell that some source slice on the GPU covers is copied from
    the first source slice covering it; the rest is missing and will be received.
    """
    cells = grid.cells
    if len(dsts) == 1 and len(srcs) <= 1:  # the common case, one slice needed and at most one held
        if srcs and srcs[0] == dsts[0]:
            return Local([(0, 0)], [], (np.zeros(0, np.int64), np.zeros(0, np.int64)))
        held = set(cells(srcs[0][1])) if srcs else ()
        copied: list[int]
        lack: list[int]
        copied, lack = [], []
        for c in cells(dsts[0][1]):
            (copied if c in held else lack).append(c)
        return Local(
            [], [(0, 0, copied)] if copied else [], (np.asarray(lack, dtype=np.int64), np.zeros(len(lack), np.int64))
        )
    keeps: list[tuple[int, int]] = []
    copies: list[tuple[int, int, int, list[int]]] = []  # (first cell, destination, source, cells)
    miss_cells: list = []  # per destination, the cells it misses (arrays, ascending)
    miss_dsts: list[int] = []
    src_spans = [grid.span(r) for _, r in srcs]
    for j, d in enumerate(dsts):
        same = next((i for i, s in enumerate(srcs) if s == d), None)
        if same is not None:  # every cell of the slice is there, in the same model-stage's slice
            keeps.append((same, j))
            continue
        # which source slice covers each cell first: boxes of interval indices, cut out of the
        # destination's own box (cells ascend in row-major order of that box)
        span = grid.span(d[1])
        owner = None
        for i, sspan in enumerate(src_spans):
            box: list[Any] = []  # slices (numpy's stubs take no list of them with an Ellipsis)
            for (a, b), (sa, sb) in zip(span, sspan):
                lo, hi = max(a, sa), min(b, sb)
                if lo >= hi:
                    break
                box.append(slice(lo - a, hi - a))
            else:
                if owner is None:
                    owner = np.full([b - a for a, b in span], -1, dtype=np.int32)
                view = owner[(*box, Ellipsis)]  # a view, also of a 0-d box
                view[view < 0] = i
        arr = np.asarray(cells(d[1]), dtype=np.int64)
        if owner is None:
            miss = arr
        else:
            flat = owner.ravel()
            for i in np.unique(flat[flat >= 0]).tolist():
                got = arr[flat == i].tolist()
                copies.append((got[0], j, i, got))
            miss = arr[flat < 0]
        if len(miss):
            miss_cells.append(miss)
            miss_dsts.append(j)
    copies.sort(key=lambda x: (x[0], x[1]))  # in the order of their first cell, as a scan of the cells meets them
    if not miss_cells:
        missing = (np.zeros(0, np.int64), np.zeros(0, np.int64))
    else:  # by cell; a stable sort keeps each cell's destinations in the order they were met, ascending
        c = np.concatenate(miss_cells)
        js = np.repeat(np.asarray(miss_dsts, dtype=np.int64), [len(x) for x in miss_cells])
        order = np.argsort(c, kind="stable")
        missing = (c[order], js[order])
    return Local(keeps, [(i, j, cs) for _, j, i, cs in copies], missing)
