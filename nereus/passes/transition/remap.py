"""``remap{to=@plan_b}``: place plan B on the GPUs so that the transition moves the fewest bytes.

A plan's parallel shape (TP, PP, DP, which model-stages share GPUs) fixes its step time and
memory; which physical GPU plays which part does not, as long as GPUs in one node stay in one
node. Plan B as written (by hand or by ``plan-search``) puts its parts on GPUs in mesh order,
blind to where plan A's state is. This pass renames plan B's GPUs by the permutation, among
those that keep every node's GPUs together (GPUs permuted inside their node, whole nodes
permuted), that maximizes the bytes every GPU already holds of what plan B needs there:

    value(i, j) = bytes of the state plan B puts on GPU j that GPU i holds under plan A

(any model-stage of the same model, every state and tensor, cut into the cells both plans'
slices define; ``scipy.sparse`` products per group of tensor families whose slices sit on the
GPUs alike). The best permutation is exact for
that group: for every pair of nodes the best assignment of the GPUs inside them (Hungarian,
``linear_sum_assignment``), then the best assignment of nodes on those values. A GPU that plan
B's cluster marks unavailable hosts none of plan B's state; a GPU lost since plan A holds
nothing. Plan B's meshes and EMUs are rewritten; its estimated time and memory do not change.

The transition's lower bound is ``sum_j need(j) - value(pi(j), j)``, so maximizing the value
minimizes what ``plan-transition`` must move. The bytes before and after are recorded on the
plan (``remap``), and the pass leaves plan B alone where no permutation keeps more in place.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace

import numpy as np
from scipy.optimize import linear_sum_assignment
from scipy.sparse import csr_matrix

from ...ir import Diagnostic, DiagnosticError, Module
from ...ir.diagnostics import plural
from ...ir.plan import RemapRecord
from ..infra.pass_manager import Gpus, ModulePass, Ref, register
from .derive_emus import emus_required
from .grid import Grid
from .holdings import lost_gpus, plan_holdings, plan_pair

NEVER = -1e18  # the value of putting plan B's state on a GPU that cannot take it


def reuse_matrix(m: Module, source: str, target: str, gpus: int, lost: set[int]) -> tuple[np.ndarray, np.ndarray]:
    """``value[i, j]``: bytes of plan B's state on GPU j that GPU i holds under plan A, and
    ``need[j]``: bytes of plan B's state on GPU j (each once per GPU, as the lower bound counts)."""
    from ...ir.model import state_dtype_bytes

    for p in (source, target):
        m.require_emus(p, "remap")
    src_all, dst_all = plan_holdings(m, source), plan_holdings(m, target)
    outside = sorted({p.gpu for pieces in src_all.values() for p in pieces if p.gpu >= gpus})
    if outside:
        raise DiagnosticError(
            [
                Diagnostic(
                    m.plans[source].loc,
                    f"remap: plan @{source} holds state on GPUs {outside}, "
                    f"outside plan @{target}'s cluster of {plural(gpus, 'GPU')}",
                )
            ]
        )
    itemsize = {key: state_dtype_bytes(m.models[key[0]], key[1]) for key in dst_all}
    return reuse_of(src_all, dst_all, itemsize, gpus, lost)


def reuse_of(src_all: dict, dst_all: dict, itemsize: dict, gpus: int, lost: set[int]) -> tuple[np.ndarray, np.ndarray]:
    """``reuse_matrix`` of the holdings of plans A and B (``plan_holdings``), each family's
    elements of ``itemsize[key]`` bytes."""
    need = np.zeros(gpus)
    # families that lie alike (the same pieces on the same GPUs, cutting their grids alike: q,
    # k, v, gate and up under one tensor-parallel split, say) share their terms and differ only
    # in the bytes of their cells: their terms are found once and their cells' bytes added up
    # (``Alike``); then families whose terms sit on the GPUs alike add their overlaps up, and
    # each such group is spread onto GPU pairs once
    alike: dict[tuple, Alike | None] = {}
    for key, dsts in dst_all.items():
        srcs = [p for p in src_all.get(key, []) if p.gpu not in lost]
        grid = Grid({p.region for p in srcs} | {p.region for p in dsts})
        sig = (tuple(grid.radix), grid.pattern(srcs, "gpu"), grid.pattern(dsts, "gpu"))
        if sig not in alike:
            alike[sig] = _alike(grid, srcs, dsts)
        a = alike[sig]
        if a is not None:
            a.bytes += grid.sizes(a.cells).astype(np.float64) * itemsize[key]
    groups: dict[tuple, list] = {}
    for a in alike.values():
        if a is None:
            continue
        tb = csr_matrix((a.bytes[a.col], (a.b_rows, a.col)), shape=(a.b_terms, len(a.cells)))  # term x cell: bytes
        at_b = csr_matrix((np.ones(len(a.b_gpu)), (a.b_gpu, a.b_term)), shape=(gpus, a.b_terms))
        need += at_b @ np.asarray(tb.sum(axis=1)).ravel()
        if a.ta is None:
            continue
        overlap = (a.ta @ tb.T).tocsr()  # bytes shared by every (plan A term, plan B term): sparse
        sig = tuple(x.tobytes() for x in (a.a_gpu, a.a_term, a.b_gpu, a.b_term))
        if sig in groups:
            groups[sig][2] += overlap
        else:
            at_a = csr_matrix((np.ones(len(a.a_gpu)), (a.a_gpu, a.a_term)), shape=(gpus, a.ta.shape[0]))
            groups[sig] = [at_a, at_b, overlap]
    reuse = np.zeros((gpus, gpus))
    for at_a, at_b, overlap in groups.values():
        # value[i, j] = sum over i's A terms and j's B terms, as sparse products: most pairs of
        # terms share nothing (a ZeRO shard overlaps a few of the other plan's slices)
        reuse += (at_a @ overlap @ at_b.T).toarray()
    return reuse, need


class Alike:
    """The terms of the families that lie alike (``_alike``), and the bytes of their cells
    added up over those families (float64: exact below 2**53 bytes, 9 PB)."""

    __slots__ = ("cells", "col", "b_rows", "b_terms", "b_gpu", "b_term", "a_gpu", "a_term", "ta", "bytes")

    def __init__(self, cells, col, b_rows, b_terms, b_gpu, b_term, a_gpu, a_term, ta):
        self.cells, self.col, self.b_rows, self.b_terms = cells, col, b_rows, b_terms
        self.b_gpu, self.b_term, self.a_gpu, self.a_term, self.ta = b_gpu, b_term, a_gpu, a_term, ta
        self.bytes = np.zeros(len(cells))


def _alike(grid: Grid, srcs, dsts) -> Alike | None:
    """A family's terms, whatever its bytes: plan B's cells on each GPU as shared disjoint terms
    (the distinct cells they hold, ``cells``; each held cell's place in them, ``col``, by term,
    ``b_rows``), which terms make up which GPU on either side, and which of plan A's terms hold
    which of those cells (``ta``: term x cell, None where plan A holds none). None where plan B
    holds no cell."""
    b_cells, b_gpu, b_term = _union_terms(grid, dsts)
    if not b_cells:
        return None
    cells, col = np.unique(np.concatenate(b_cells), return_inverse=True)
    if not len(cells):  # empty slices only
        return None
    b_rows = np.repeat(np.arange(len(b_cells)), [len(c) for c in b_cells])
    a_cells, a_gpu, a_term = _union_terms(grid, srcs)
    ta = None
    if a_cells:
        hc = np.concatenate(a_cells)  # plan A's cells; only those plan B needs count
        a_rows = np.repeat(np.arange(len(a_cells)), [len(c) for c in a_cells])
        at = np.minimum(np.searchsorted(cells, hc), len(cells) - 1)
        ok = cells[at] == hc
        ta = csr_matrix((np.ones(int(ok.sum())), (a_rows[ok], at[ok])), shape=(len(a_cells), len(cells)))
    return Alike(cells, col, b_rows, len(b_cells), b_gpu, b_term, a_gpu, a_term, ta)


def _union_terms(grid: Grid, pieces) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """The cells of the union of the regions each GPU holds, as a sum of disjoint terms that GPUs
    share: (the terms' cells, and GPU and term arrays saying which terms make up which GPU).

    A GPU's regions are taken most widely held first; its k-th term is the cells of its k-th
    region not in the first k - 1. Replicas share all their terms, and a GPU with one region of
    its own (a ZeRO shard) adds one small term, so the work grows with the distinct terms, not
    with GPUs times cells (a GPU may hold overlapping slices of several model-stages)."""
    regions_on: dict[int, set] = defaultdict(set)
    for p in pieces:
        regions_on[p.gpu].add(p.region)
    held_by: dict = defaultdict(int)
    for rs in regions_on.values():
        for r in rs:
            held_by[r] += 1
    regions = list(held_by)
    cells_of = dict(zip(regions, grid.cell_arrays(regions)))
    region_cells = cells_of.__getitem__

    unions: dict[tuple, np.ndarray] = {(): np.zeros(0, np.int64)}

    def union(prefix: tuple) -> np.ndarray:  # the cells of the regions in ``prefix``, computed when a term needs them
        out = unions.get(prefix)
        if out is None:
            out = unions[prefix] = np.union1d(union(prefix[:-1]), region_cells(prefix[-1]))
        return out

    terms: list[np.ndarray] = []
    term_of: dict[tuple, int] = {}
    gs, ts = [], []
    for g in sorted(regions_on):
        prefix: tuple = ()
        for r in sorted(regions_on[g], key=lambda r: (-held_by[r], r)):
            t = term_of.get((prefix, r))
            if t is None:
                t = term_of[(prefix, r)] = len(terms)
                cells = region_cells(r)
                if any(_meet(r, q) for q in prefix):  # else none of its cells is in the union
                    cells = np.setdiff1d(cells, union(prefix), assume_unique=True)
                terms.append(cells)
            gs.append(g)
            ts.append(t)
            prefix += (r,)
    return terms, np.asarray(gs, dtype=np.int64), np.asarray(ts, dtype=np.int64)


def _meet(a, b) -> bool:
    """Whether boxes ``a`` and ``b`` share an element."""
    return all(lo < hi2 and lo2 < hi for (lo, hi), (lo2, hi2) in zip(a, b))


def best_permutation(value: np.ndarray, per_node: int, can_host: np.ndarray, used: np.ndarray) -> list[int] | None:
    """``pi`` with ``pi[j]`` the GPU that takes plan B's part j, among permutations that keep
    nodes together, maximizing ``sum_j value[pi[j], j]``, with used parts only on GPUs that can
    host; None if no such permutation puts every used part on a GPU that can host it."""
    gpus = len(value)
    v = np.where(can_host[:, None] | ~used[None, :], value, NEVER)
    nodes = gpus // per_node
    inner: dict[tuple[int, int], tuple[float, np.ndarray]] = {}
    node_value = np.zeros((nodes, nodes))
    for a in range(nodes):  # physical node a takes plan B's node b
        for b in range(nodes):
            block = v[a * per_node : (a + 1) * per_node, b * per_node : (b + 1) * per_node]
            rows, cols = linear_sum_assignment(block, maximize=True)
            node_value[a, b] = block[rows, cols].sum()
            inner[(a, b)] = (node_value[a, b], rows[np.argsort(cols)])  # part j of b -> GPU rows[..] of a
    rows, cols = linear_sum_assignment(node_value, maximize=True)
    pi = [0] * gpus
    for a, b in zip(rows, cols):
        local = inner[(a, b)][1]
        for j in range(per_node):
            pi[int(b) * per_node + j] = int(a) * per_node + int(local[j])
    if any(used[j] and not can_host[pi[j]] for j in range(gpus)):
        return None
    return pi


def remap(m: Module, source: str, target: str, lost: set[int] | None = None) -> RemapRecord:
    """Rename plan B's GPUs (see the module docstring); returns what it did. ``lost``: GPUs
    whose state is gone, as for ``plan_transition`` (default: those plan B cannot use)."""
    plan_b = m.plans[target]
    cluster = m.clusters[plan_b.cluster]
    per_node = cluster.gpus_per_node
    gpus = cluster.nodes * per_node
    unavailable = set(cluster.unavailable)
    value, need = reuse_matrix(m, source, target, gpus, lost=unavailable if lost is None else set(lost))
    used = need > 0
    can_host = np.array([g not in unavailable for g in range(gpus)])
    identity = list(range(gpus))
    pi = best_permutation(value, per_node, can_host, used)
    base = float(np.trace(value))
    before = round(need.sum() - base)
    gain = base if pi is None else float(sum(value[pi[j], j] for j in range(gpus)))
    if gain <= base:  # as written is as good
        return RemapRecord(before, before, 0)
    assert pi is not None  # else gain == base
    for lay in plan_b.layouts.values():
        lay.mesh = [pi[g] for g in lay.mesh]
    for key, emu in list(m.emus.items()):
        if key[0] == target:
            # a list: Emu.__post_init__ makes it a tuple
            m.emus[key] = replace(
                emu,
                shards=[
                    replace(s, gpu=pi[s.gpu])  # type: ignore[arg-type]
                    for s in emu.shards
                ],
            )
    return RemapRecord(before, round(need.sum() - gain), sum(int(p != i) for i, p in zip(identity, pi)))


@register
@dataclass(frozen=True)
class Remap(ModulePass):
    """Options: ``to`` (``@plan_b``, whose GPUs are renamed), ``source`` (``@plan_a``; default:
    the other plan of the job), ``drain`` and ``lost`` (as for ``plan-transition``: which GPUs'
    state is gone). Plan B's bytes to receive after renaming are the transition's lower bound:
    kept in the module's analyses, where ``plan-transition`` on the same plans and GPUs finds them."""

    name = "remap"
    to: Ref = ""
    source: Ref = ""
    drain: bool = False
    lost: Gpus = None

    def requires(self, module: Module) -> list[ModulePass]:
        return emus_required(module, *plan_pair(module, self.name, self.source, self.to))

    def apply(self, module: Module) -> None:
        source, target = plan_pair(module, self.name, self.source, self.to)
        lost = lost_gpus(module, self.name, target, self.drain, self.lost)
        rec = module.plans[target].remap = remap(module, source, target, lost=lost)
        # the reuse matrix sums what every GPU already holds of plan B, in float64: exact for
        # integers below 2**53 bytes (9 PB); the tests hold it equal to ``lower_bound``
        module.analyses.put(module, "lower-bound", (source, target), frozenset(lost), rec.after)
