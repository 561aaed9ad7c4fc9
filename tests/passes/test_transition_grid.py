"""``transition.grid.local`` (what one GPU keeps, copies and misses) against a scan of every cell.

The reference is the rule itself, cell by cell: a destination slice with a source slice of the
same model-stage and region on the GPU is kept; any other cell of a destination slice is copied
from the first source slice (in list order) whose region covers it, else it is missing. Copies
come in the order in which that scan (cells ascending, destinations in order) first meets them.
"""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from nereus.passes.transition.grid import Grid, local, merge, merge_arrays


def _scan(grid: Grid, srcs, dsts):
    need: dict[int, list[int]] = {}
    for j, (_, r) in enumerate(dsts):
        for c in grid.cells(r):
            need.setdefault(c, []).append(j)
    on_gpu: dict[int, list[int]] = {}
    for i, (_, r) in enumerate(srcs):
        for c in grid.cells(r):
            on_gpu.setdefault(c, []).append(i)
    keeps, copies, missing = {}, {}, []
    for c in sorted(need):
        held = on_gpu.get(c)
        if held is None:
            missing.append((c, need[c]))
            continue
        for j in need[c]:
            same = next((i for i in held if srcs[i] == dsts[j]), None)
            if same is not None:
                keeps[(same, j)] = None
            else:
                copies.setdefault((held[0], j), []).append(c)
    return sorted(keeps), [(i, j, cs) for (i, j), cs in copies.items()], missing


SHAPES = [(8,), (8, 6), (4, 6, 5)]  # 1-D, 2-D and 3-D (a per-layer family: layers first)


@st.composite
def _gpu(draw):
    """Slices of one tensor on one GPU: a few sources and destinations, some equal."""
    shape = draw(st.sampled_from(SHAPES))

    def box():
        out = []
        for n in shape:
            a = draw(st.integers(0, n - 1))
            out.append((a, draw(st.integers(a + 1, n))))
        return tuple(out)

    stages = ["m.train", "m.infer", "m.generate"]
    srcs = [(draw(st.sampled_from(stages)), box()) for _ in range(draw(st.integers(0, 3)))]
    dsts = []
    for _ in range(draw(st.integers(1, 3))):
        if srcs and draw(st.booleans()):
            dsts.append(draw(st.sampled_from(srcs)))  # a slice that some source holds as it is
        else:
            dsts.append((draw(st.sampled_from(stages)), box()))
    return srcs, dsts


@settings(max_examples=300, deadline=None)
@given(_gpu())
def test_local_equals_a_scan_of_every_cell(case):
    srcs, dsts = case
    grid = Grid({r for _, r in srcs} | {r for _, r in dsts})
    got = local(grid, srcs, dsts)
    keeps, copies, missing = _scan(grid, srcs, dsts)
    assert sorted(got.keeps) == keeps
    assert got.copies == copies
    cells, where = got.missing
    assert list(zip(cells.tolist(), where.tolist())) == [(c, j) for c, js in missing for j in js]


@settings(max_examples=200, deadline=None)
@given(_gpu(), st.data())
def test_cell_arrays_are_the_cells_of_every_region(case, data):
    """``Grid.cell_arrays`` (every region at once, numpy) against ``Grid.cells`` region by region,
    for regions drawn from the grid's own slices and boxes of its cuts (empty ones too)."""
    srcs, dsts = case
    grid = Grid({r for _, r in srcs} | {r for _, r in dsts})
    regions = [r for _, r in srcs + dsts]
    for _ in range(data.draw(st.integers(0, 3))):  # any box on the cuts, possibly empty along an axis
        box = []
        for cuts in grid.cuts:
            a = data.draw(st.sampled_from(cuts))
            box.append((a, data.draw(st.sampled_from([c for c in cuts if c >= a]))))
        regions.append(tuple(box))
    got = grid.cell_arrays(regions)
    assert [a.tolist() for a in got] == [grid.cells(r) for r in regions]


@settings(max_examples=200, deadline=None)
@given(_gpu(), st.data())
def test_boxes_merge_cells_as_the_greedy_merge_does_and_cover_them_exactly(case, data):
    """``Grid.boxes`` (interval indices decoded one by one below ``BOXES_ARRAYS`` cells, at once
    from there) against ``merge`` on the cells one by one, and the boxes hold exactly the cells
    they were made of."""
    srcs, dsts = case
    grid = Grid({r for _, r in srcs} | {r for _, r in dsts})
    every = sorted({c for _, r in srcs + dsts for c in grid.cells(r)})
    cells = sorted(data.draw(st.sets(st.sampled_from(every), min_size=1)))
    boxes = grid.boxes(cells)
    assert boxes == [
        tuple((c[a], c[b]) for c, (a, b) in zip(grid.cuts, box)) for box in merge([grid.index(x) for x in cells])
    ]
    covered = sorted(c for b in boxes for c in grid.cells(b))
    assert covered == cells


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=3), st.data())
def test_merge_arrays_gives_merge_s_boxes_in_merge_s_order(shape, data):
    """The numpy merge that ``Grid.boxes`` takes from ``MERGE_ARRAYS`` cells on: the very boxes
    of ``merge``, in its order, on any set of distinct cells (1 to 3 axes, up to 729 cells)."""
    every = list(itertools.product(*(range(n) for n in shape)))
    cells = data.draw(st.lists(st.sampled_from(every), min_size=1, max_size=len(every), unique=True))
    assert merge_arrays(np.array(cells, dtype=np.int64)) == merge(cells)
