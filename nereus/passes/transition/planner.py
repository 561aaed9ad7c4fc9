"""The planner behind ``plan-transition`` (see that module's docstring for the algorithm): what
moves (the operations of one transition, family by family, then loads and offloads, and the
frees). The order that keeps every GPU within its memory, staging through host memory where
nothing else fits, is ``transition.memory.Memory``."""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict
from collections.abc import Collection, Sequence
from itertools import chain
from operator import itemgetter
from typing import cast

import numpy as np

from ...ir import Diagnostic, DiagnosticError, HostRef, Module, Op
from ...ir.emu import Box, volume
from ...ir.model import state_dtype_bytes
from .grid import Grid, Holding, local
from .memory import Memory, op_number

NO_DEPS: list = []  # shared by every operation planned without dependencies
NO_ENDPOINTS: list = []  # shared by every free's destinations


def _index(pieces: dict[tuple, list[Holding]]) -> dict[tuple, int]:
    """The index of each family's first piece when all pieces are numbered in key order."""
    out, n = {}, 0
    for key in sorted(pieces):
        out[key] = n
        n += len(pieces[key])
    return out


class Planner:
    """The operations of one transition, family by family. A piece is named by its number
    (``_index`` of its family plus its position), so that bookkeeping hashes integers."""

    def __init__(self, m: Module, source: str, target: str, cluster, src_all, dst_all, restore: bool = False) -> None:
        self.m, self.source, self.target, self.cluster = m, source, target, cluster
        # restore: the cells of plan B that no GPU of plan A holds (their GPUs failed) are left to
        # a read from the last checkpoint (counted, per receiving GPU, in ``restored``)
        self.restore, self.restored = restore, 0
        self.plan_a, self.plan_b = m.plans[source], m.plans[target]
        self.src_all, self.dst_all = src_all, dst_all
        self.sbase, self.dbase = _index(src_all), _index(dst_all)
        self.ops: list[Op] = []  # op "%i" is ops[i]
        top = max((p.gpu for pieces in src_all.values() for p in pieces), default=0)
        # bytes each GPU sends, kept as bytes x GPUs + GPU: the least of several is the least
        # loaded GPU of lowest number (``_senders``)
        self.load = list(range(top + 1))
        self.bytes_moved = 0
        self.reads: dict[int, list[str]] = defaultdict(list)  # source piece -> ops that read it (for frees)
        self.kept: set[int] = set()  # source pieces reused in place
        self.kept_b: set[int] = set()  # destination pieces kept in place
        # (family, destination shard) -> ops writing it: only for the (model, state)s plan B
        # offloads, whose offloads wait for them (``residency``)
        self.delivers: dict[tuple[int, int], list[str]] = defaultdict(list)
        # memory that receives take on each GPU: once per destination shard written (two
        # model-stages on one GPU each hold their copy) and the receiving ops with their share.
        # Sends are listed per GPU as they are made; a broadcast only in its fan's list (``fan``),
        # counted onto its receivers' GPUs once planning is done (``_count_broadcasts``) and
        # listed per GPU only where memory is tight (``received``): at 1,024 GPUs, broadcasts
        # have millions of (operation, receiver) pairs, and most GPUs never need theirs listed
        self.recv_bytes: dict[int, int] = defaultdict(int)
        self.recv_ops: dict[int, list[tuple[str, int]]] = defaultdict(list)
        self.fan_records: list[tuple] = []  # every fan: (GPUs, shards per GPU, its broadcasts)
        self.fans_on: dict[int, list[tuple]] = defaultdict(list)  # GPU -> the fan records that write it
        self.copy_bytes: dict[int, int] = defaultdict(int)  # bytes local copies write, per GPU
        self.copy_ops: dict[int, list[str]] = defaultdict(list)
        self.loaded: set[int] = set()  # plan A's offloaded pieces that a load brings onto their GPU
        self.load_ops: dict[int, list[tuple[str, int]]] = defaultdict(list)  # GPU -> (load, bytes)
        self.fans: dict[tuple[int, ...], dict] = {}  # destination shards of a family -> its receivers' look-ups
        # one endpoint list per shard, and one empty list, shared by the operations naming them:
        # a million operations each with lists of their own are millions of objects that the
        # cyclic collector traverses after the pass (an operation's lists are replaced, never
        # changed in place, as for the shared receivers' lists of broadcasts)
        self.from_a: dict[int, list] = {}  # shard of plan A (rid) -> [its reference]
        self.to_b: dict[int, list] = {}  # shard of plan B (rid) -> [its reference]
        self.structures: dict[tuple, Structure] = {}  # structures families to come share (``_structure``)
        self.expected: dict[tuple, int] = {}  # structure -> families to come that have it
        self.prepared: dict[tuple, tuple[Grid, tuple]] = {}  # family to come -> its grid and structure's signature

    @property
    def sent_bytes(self) -> list[int]:
        """Bytes each GPU sends in the operations planned so far."""
        return [x // len(self.load) for x in self.load]

    def op(self, kind, state, family, region, src, dst, nbytes, link, per_layer: bool) -> Op:
        if per_layer:
            (l0, l1), box = region[0], region[1:]
            layers = (l0, l1 - 1)
        else:
            layers, box = None, region
        op = Op(
            id=f"%{len(self.ops)}",
            kind=kind,
            state=state,
            family=family,
            layers=layers,
            box=tuple(box),
            src=src,
            dst=dst,
            bytes=nbytes,
            link=link,
            deps=NO_DEPS,
        )
        self.ops.append(op)
        return op

    def src_of(self, p: Holding) -> list:
        """``[p.ref]`` for a piece of plan A, one list per shard."""
        out = self.from_a.get(p.rid)
        if out is None:
            out = self.from_a[p.rid] = [p.ref]
        return out

    def dst_of(self, p: Holding) -> list:
        """``[p.ref]`` for a piece of plan B, one list per shard."""
        out = self.to_b.get(p.rid)
        if out is None:
            out = self.to_b[p.rid] = [p.ref]
        return out

    def family(self, key: tuple[str, str, str], srcs: list[Holding], dsts: list[Holding]) -> None:
        """Keep, copy, send and broadcast the cells of one (model, state, family)."""
        model_name, state, family = key
        _, itemsize, per_layer = family_spec(self.m, model_name, state, family)
        if not srcs and self.restore:
            self.restored += sum(volume(p.region) for p in dsts) * itemsize
            return
        if not srcs:
            raise DiagnosticError(
                [
                    Diagnostic(
                        self.plan_a.loc,
                        f"plan @{self.source} holds no {state} of {family} of "
                        f"@{model_name}, which plan @{self.target} needs",
                        "both plans must carry the same state",
                    )
                ]
            )
        # mypy takes pop's overload without a default type from the unpacking's context
        grid, sig = self.prepared.pop(key, None) or self._prepare(srcs, dsts)  # type: ignore[arg-type]
        st = self._structure(grid, srcs, dsts, sig)
        sbase, dbase = self.sbase[key], self.dbase[key]
        for i, j in st.keeps:
            self.kept.add(sbase + i)
            self.kept_b.add(dbase + j)
        copies = st.copies
        transfers = self._senders(key, grid, srcs, dsts, st, itemsize)
        reads, op = self.reads, self.op
        delivers = self.delivers if _any_offloaded(self.plan_b, model_name, state) else None
        for si, dj, cells in copies:
            s, d = srcs[si], dsts[dj]
            for region in grid.boxes(cells):
                o = op(
                    "copy",
                    state,
                    family,
                    region,
                    self.src_of(s),
                    self.dst_of(d),
                    volume(region) * itemsize,
                    "local",
                    per_layer,
                )
                reads[sbase + si].append(o.id)
                if delivers is not None:
                    delivers[(dbase, d.rid)].append(o.id)
                self.copy_bytes[d.gpu] += o.bytes
                self.copy_ops[d.gpu].append(o.id)
        per_node = self.cluster.gpus_per_node  # Cluster.node_of, inline
        src_of, dst_of = self.src_of, self.dst_of
        recv_bytes, recv_ops = self.recv_bytes, self.recv_ops
        # receivers -> their GPUs, shards and references; shared by the families whose destination
        # pieces are the same shards in the same order (a piece's shard fixes its GPU and reference)
        fan: dict[tuple[int, ...], tuple] = self.fans.setdefault(tuple([p.rid for p in dsts]), {})
        for (si, receivers), cells in transfers.items():
            s = srcs[si]
            node = s.gpu // per_node
            if len(receivers) == 1 and len(cells) == 1:  # the common case: one cell to one GPU
                d = dsts[receivers[0]]
                region, n = grid.info(cells[0])
                nbytes = n * itemsize
                oid = op(
                    "send",
                    state,
                    family,
                    region,
                    src_of(s),
                    dst_of(d),
                    nbytes,
                    "nvlink" if d.gpu // per_node == node else "nic",
                    per_layer,
                ).id
                reads[sbase + si].append(oid)
                if delivers is not None:
                    delivers[(dbase, d.rid)].append(oid)
                self.bytes_moved += nbytes
                recv_bytes[d.gpu] += nbytes
                recv_ops[d.gpu].append((oid, nbytes))
                continue
            got = fan.get(receivers)
            if got is None:
                rgpus = sorted({dsts[j].gpu for j in receivers})
                to = {dsts[j].rid: dsts[j].ref for j in receivers}  # one per destination shard, in order
                shards_on = Counter(dsts[j].gpu for j in {dsts[j].rid: j for j in receivers}.values())
                # one list for every operation to these receivers (replaced, never changed in place),
                # and the broadcasts to them (``_count_broadcasts``)
                got = fan[receivers] = (rgpus, to, shards_on, list(to.values()), [])
                self.fan_records.append((rgpus, shards_on, got[4]))
            rgpus, to, shards_on, refs, sent = got
            kind = "send" if len(receivers) == 1 else "broadcast"
            link = "nic" if any(g // per_node != node for g in rgpus) else "nvlink"
            for region in grid.boxes(cells):
                nbytes = volume(region) * itemsize
                o = op(kind, state, family, region, src_of(s), refs, nbytes, link, per_layer)
                reads[sbase + si].append(o.id)
                if delivers is not None:
                    for rid in to:
                        delivers[(dbase, rid)].append(o.id)
                self.bytes_moved += nbytes * len(rgpus)
                if len(rgpus) == 1:  # a send: listed on its GPU now
                    g = rgpus[0]
                    recv_bytes[g] += nbytes * shards_on[g]
                    recv_ops[g].append((o.id, nbytes * shards_on[g]))
                else:
                    sent.append(o)

    def _count_broadcasts(self) -> None:
        """Add every broadcast's bytes to its receivers' GPUs (once per shard written there), fan by fan."""
        for rgpus, shards_on, sent in self.fan_records:
            if not sent:
                continue
            total = sum([o.bytes for o in sent])
            for g in rgpus:
                self.recv_bytes[g] += total * shards_on[g]
                self.fans_on[g].append((shards_on[g], sent))

    def received(self, g: int) -> list[tuple[str, int]]:
        """The sends and broadcasts writing GPU g, in the order they were made: (id, bytes on g)."""
        lists = [self.recv_ops.get(g, [])] + [
            [(o.id, o.bytes * k) for o in sent] for k, sent in self.fans_on.get(g, ())
        ]
        if len(lists) == 1:
            return list(lists[0])
        return list(heapq.merge(*lists, key=lambda e: op_number(e[0])))

    def _prepare(self, srcs: list[Holding], dsts: list[Holding]) -> tuple[Grid, tuple]:
        grid = Grid({p.region for p in srcs} | {p.region for p in dsts})
        return grid, structure_signature(grid, srcs, dsts)

    def expect(self, families: dict[tuple, tuple[list[Holding], list[Holding]]]) -> None:
        """The families to come (key -> (sources, destinations)): their grids, and how many
        share each structure, so that one is remembered only while a family to come needs it
        (``_structure``)."""
        for key, (srcs, dsts) in families.items():
            if srcs:
                grid, sig = self.prepared[key] = self._prepare(srcs, dsts)
                self.expected[sig] = self.expected.get(sig, 0) + 1

    def _structure(self, grid: Grid, srcs: list[Holding], dsts: list[Holding], sig: tuple) -> Structure:
        """What a family's pieces decide by where they lie alone (``Structure``), remembered for
        the families after it that lie alike (``structure_signature``: the same pieces, so shards, GPUs
        and model-stages, cut into the same cells of their grids). The projections a tensor-parallel
        layout splits alike (q, k, v, gate and up; o and down) are such families, and their
        optimizer states: 72 families, 36 structures, on the largest move of the combined trace.
        Remembered until the last family expected to share it (``expect``)."""
        st = self.structures.get(sig)
        if st is None:
            st = decide_structure(grid, srcs, dsts)
        left = self.expected.get(sig, 0) - 1
        if left > 0:
            self.expected[sig] = left
            self.structures[sig] = st
        else:
            self.expected.pop(sig, None)
            self.structures.pop(sig, None)
        return st

    def _senders(
        self, key, grid: Grid, srcs: list[Holding], dsts: list[Holding], st: Structure, itemsize: int
    ) -> dict[tuple[int, tuple[int, ...]], list[int]]:
        """Senders for the missing cells (``st.missing``: the cells ascending, each cell's parts of
        its receivers, and the parts, as ``decide_structure`` finds them): (sender, receivers) -> cells.

        A cell's receivers are split into parts that hold the same slice (``_by_cell``): the
        replicas of an inference layout need the same long run of cells, a ZeRO-3 slice of a
        training layout a few of them, and one broadcast to both for every cell would cut the
        replicas' run into a broadcast per cell. Each part gets the cell from a GPU holding it:
        the one that sent the part's last cell while that GPU's load stays within the part's
        fair share (its largest slice's bytes times its GPUs) of the least loaded holder's (so
        that a run goes out as one box), otherwise the least loaded; the load grows by the
        cell's bytes times the part's GPUs. Ties go to the lowest (GPU, model-stage, piece): a
        load is kept as bytes x GPUs + GPU, so the least of the holders' loads is the lowest
        least loaded GPU. The least of a set of holders is read again only where the part's last
        sender is beyond its share of the least read before (loads only grow: that is a lower
        bound), so a run that stays with its sender reads one load per cell."""
        members, group_of, holders = st.members, st.group_of, st.holders
        # groups -> [a getter of their GPUs' loads, the least of them when last read]: loads only
        # grow, so that is at most their least now
        ranked: dict[tuple[int, ...], list] = {}
        gpus_in = st.gpus_in  # each group's GPUs, made at the first need
        first_on = st.first_on  # each group's GPU -> its piece there of lowest (model-stage, piece)
        load = self.load
        span = len(load)
        volumes: dict[Box, int] = {}
        missing_cells, parts_of, pieces_of = st.missing
        gpus_of = [0] * len(pieces_of)  # by part number: its GPUs (0: not yet counted)
        share_of = [0] * len(pieces_of)  # by part number: its fair share in bytes
        last = [-1] * len(pieces_of)  # by part number: the piece that sent it its last cell (-1: none yet)
        transfers: dict[tuple[int, int], list[int]] = {}  # (sender, part number) -> cells
        sizes = grid.sizes(missing_cells).tolist()
        src_gpu = [p.gpu for p in srcs]
        for c, size, parts in zip(missing_cells, sizes, parts_of):
            gs = holders.get(c)
            if not gs and self.restore:
                self.restored += size * itemsize * sum(len(pieces_of[part]) for part in parts)
                continue
            if not gs:
                model_name, state, family = key
                raise DiagnosticError(
                    [
                        Diagnostic(
                            self.plan_b.loc,
                            f"no GPU of plan @{self.source} holds part of {state} "
                            f"{family} of @{model_name} that plan @{self.target} needs",
                        )
                    ]
                )
            nbytes = size * itemsize
            if len(gs) == 1 and len(members[gs[0]]) == 1:
                r = None
                only = members[gs[0]][0]
            else:
                gs = tuple(gs)
                r = ranked.get(gs)
                if r is None:
                    if not gpus_in:
                        for pieces in members:
                            on: dict[int, int] = {}
                            for i in sorted(pieces, key=lambda i: (srcs[i].ref.model_stage, i), reverse=True):
                                on[srcs[i].gpu] = i
                            first_on.append(on)
                            gpus_in.append(list(on))
                    # their GPUs' loads read by one getter (of two GPUs or more: it returns a tuple)
                    at = list(chain.from_iterable(map(gpus_in.__getitem__, gs)))
                    r = ranked[gs] = [itemgetter(*at) if len(at) > 1 else itemgetter(at[0], at[0]), 0]
            for pid in parts:
                gpus = gpus_of[pid]
                if not gpus:
                    part = pieces_of[pid]
                    largest = 0
                    for j in part:
                        region = dsts[j].region
                        n = volumes.get(region)
                        if n is None:
                            n = volumes[region] = volume(region)
                        largest = max(largest, n)
                    gpus_of[pid] = gpus = 1 if len(part) == 1 else len({dsts[j].gpu for j in part})
                    share_of[pid] = largest * itemsize * gpus
                if r is None:
                    best = only
                else:
                    best = last[pid]
                    # the last sender's bytes, where it holds this cell (None: it does not, or none yet)
                    mine = load[src_gpu[best]] // span if best >= 0 and group_of[best] in gs else None
                    # within its share of the least's lower bound: within its share of the least
                    if mine is None or mine > r[1] // span + share_of[pid]:
                        least = r[1] = min(r[0](load))  # bytes x span + GPU: the least loaded GPU of lowest number
                        if mine is None or mine > least // span + share_of[pid]:
                            g = least % span  # its piece of lowest (model-stage, piece) among the groups'
                            best = min(
                                [on[g] for on in map(first_on.__getitem__, gs) if g in on],
                                key=lambda i: (srcs[i].ref.model_stage, i),
                            )
                last[pid] = best
                load[src_gpu[best]] += nbytes * gpus * span
                t = transfers.get((best, pid))
                if t is None:
                    transfers[(best, pid)] = [c]
                else:
                    t.append(c)
        return {(best, pieces_of[pid]): cells for (best, pid), cells in transfers.items()}

    def residency(self) -> None:
        """Loads and offloads where the plans differ in what lives in host memory.

        At a step boundary, plan A's offloaded state is in host memory: a slice that is read, or
        kept in place for a model-stage plan B keeps on the GPU, is loaded first (``load`` into
        plan A's shard; its readers wait for it). Plan B's offloaded state goes to host memory once
        it has arrived (``offload`` from plan B's shard, after the operations that wrote it); a slice
        both plans keep in host memory stays there.
        """
        plan_a, plan_b, reads, ops = self.plan_a, self.plan_b, self.reads, self.ops
        for key, pieces in sorted(self.src_all.items()):
            model_name, state, family = key
            if not _any_offloaded(plan_a, model_name, state):
                continue
            _, itemsize, per_layer = family_spec(self.m, model_name, state, family)
            base = self.sbase[key]
            for i, p in enumerate(pieces):
                ms = p.ref.model_stage
                if not _offloaded(plan_a, ms, state):
                    continue
                n = base + i
                stays_on_host = n in self.kept and ms in plan_b.layouts and _offloaded(plan_b, ms, state)
                readers = reads.get(n, [])
                if not readers and (n not in self.kept or stays_on_host):
                    continue
                op = self.op(
                    "load",
                    state,
                    family,
                    p.region,
                    [HostRef(p.gpu)],
                    [p.ref],
                    volume(p.region) * itemsize,
                    "pcie",
                    per_layer,
                )
                self.loaded.add(n)
                self.load_ops[p.gpu].append((op.id, op.bytes))
                for reader in readers:
                    r = ops[int(reader[1:])]
                    r.deps = sorted(set(r.deps) | {op.id}, key=op_number)
                reads[n] = [op.id] + readers  # its free waits for the load too
        for key, pieces in sorted(self.dst_all.items()):
            model_name, state, family = key
            if not _any_offloaded(plan_b, model_name, state):
                continue
            _, itemsize, per_layer = family_spec(self.m, model_name, state, family)
            base = self.dbase[key]
            for j, p in enumerate(pieces):
                ms = p.ref.model_stage
                if not _offloaded(plan_b, ms, state):
                    continue
                if base + j in self.kept_b and ms in plan_a.layouts and _offloaded(plan_a, ms, state):
                    continue  # already in host memory, and stays there
                op = self.op(
                    "offload",
                    state,
                    family,
                    p.region,
                    self.dst_of(p),
                    [HostRef(p.gpu)],
                    volume(p.region) * itemsize,
                    "pcie",
                    per_layer,
                )
                op.deps = list(self.delivers.get((base, p.rid), []))

    def frees_and_memory(self) -> list[Diagnostic]:
        """Free every source slice not kept in place, after the operations that read it; then
        order what grows each GPU's memory after frees, staging through host memory where
        nothing else fits (``Memory``)."""
        mem_a: dict[int, int] = defaultdict(int)
        freeable: dict[int, list[Op]] = defaultdict(list)
        frees: dict[int, list[Op]] = defaultdict(list)
        for key, pieces in sorted(self.src_all.items()):
            model_name, state, family = key
            _, itemsize, per_layer = family_spec(self.m, model_name, state, family)
            base = self.sbase[key]
            volumes: dict[Box, int] = {}
            offloaded = {ms: _offloaded(self.plan_a, ms, state) for ms in {p.ref.model_stage for p in pieces}}
            for i, p in enumerate(pieces):
                nbytes = volumes.get(p.region)
                if nbytes is None:
                    nbytes = volumes[p.region] = volume(p.region) * itemsize
                on_gpu = not offloaded[p.ref.model_stage]  # at the step boundary; a load brings the others
                if on_gpu:
                    mem_a[p.gpu] += nbytes
                if base + i in self.kept:
                    continue
                op = self.op("free", state, family, p.region, self.src_of(p), NO_ENDPOINTS, nbytes, "local", per_layer)
                op.deps = list(self.reads.get(base + i, ()))  # already in creation order
                if on_gpu or base + i in self.loaded:  # a slice that never left host memory frees no GPU memory
                    frees[p.gpu].append(op)
                    if not op.deps:
                        freeable[p.gpu].append(op)
        gpu_b = {p.ref: p.gpu for pieces in self.dst_all.values() for p in pieces}
        self._count_broadcasts()
        return Memory(self, mem_a, freeable, frees, gpu_b).order()


def structure_signature(grid: Grid, srcs: list[Holding], dsts: list[Holding]) -> tuple:
    """A family's pieces as ``decide_structure`` reads them: the grid's radix and how the pieces lie on it
    (``Grid.pattern``), each by its shard (``rid``: a shard fixes its GPU and model-stage)."""
    return tuple(grid.radix), grid.pattern(srcs, "rid"), grid.pattern(dsts, "rid")


class Structure:
    """What a family's pieces decide by where they lie, whatever their bytes (``decide_structure``): by
    position in its source and destination lists, the slices kept in place, the copies on a GPU
    (source, destination, cells) and the missing cells (``_by_cell``'s: the cells ascending,
    each one's parts, the parts' pieces); and for choosing senders, the source pieces grouped by
    slice (``members``, ``group_of``), each cell's holding groups (``holders``), and each group's
    GPUs with its piece of lowest (model-stage, piece) there (``gpus_in``, ``first_on``: made at
    the first need). Read only, except the last two, filled once."""

    __slots__ = ("keeps", "copies", "missing", "members", "group_of", "holders", "gpus_in", "first_on")

    def __init__(self, keeps, copies, missing, members, group_of, holders):
        self.keeps, self.copies, self.missing = keeps, copies, missing
        self.members, self.group_of, self.holders = members, group_of, holders
        self.gpus_in: list[list[int]] = []
        self.first_on: list[dict[int, int]] = []


def decide_structure(grid: Grid, srcs: list[Holding], dsts: list[Holding], shared: bool | None = None) -> Structure:
    """Keep in place, or copy from a source piece on the same GPU; collect the rest (the
    missing cells ascending and, for each, the destination pieces needing it, by GPU ascending,
    split into parts: ``_by_cell``). Where there are at least twice as many destination pieces
    as slices, GPUs holding the same slices (replicas) decide the same: once. Then the source
    pieces by slice and the holders of each cell, for ``Planner._senders``. ``shared``: whether
    to decide once for replicas (None: as above); the result is the same either way."""
    if shared is None:
        shared = 2 * len({p.region for p in dsts}) <= len(dsts)
    keeps: list[tuple[int, int]] = []
    cells_of = grid.cells
    src_on: dict[int, list[int]] = defaultdict(list)
    for i, p in enumerate(srcs):
        src_on[p.gpu].append(i)
    dst_on: dict[int, list[int]] = defaultdict(list)
    for j, p in enumerate(dsts):
        dst_on[p.gpu].append(j)
    memo: dict[tuple, tuple] = {}
    copies: list[tuple[int, int, list[int]]] = []
    # the missing cells and the destination pieces needing them, GPU by GPU (ascending):
    # chunks of (cells, pieces) pairs, grouped by cell at the end (``_by_cell``)
    miss_cells: list = []
    miss_pieces: list = []
    sl: Sequence[int] | None
    for g in sorted(dst_on):
        sl, dl = src_on.get(g), dst_on[g]
        if not shared and len(dl) == 1 and (sl is None or len(sl) == 1):
            # one slice needed, at most one held: decided inline, as ``local`` decides it
            j = dl[0]
            d = dsts[j]
            s = srcs[sl[0]] if sl else None
            if s is not None and s.region == d.region and s.ref.model_stage == d.ref.model_stage:
                assert sl is not None  # s is one of them
                keeps.append((sl[0], j))
                continue
            held: Collection[int] = () if s is None else cells_of(s.region)
            if len(held) > 8:
                held = set(held)
            copied, miss = [], []
            for c in cells_of(d.region):
                if c in held:
                    copied.append(c)
                else:
                    miss.append(c)
            if copied:
                assert sl is not None  # copied from s, one of them
                copies.append((sl[0], j, copied))
            if miss:
                miss_cells.append(miss)
                miss_pieces.append([j] * len(miss))
            continue
        sl = sl or ()
        s_items = [(srcs[i].ref.model_stage, srcs[i].region) for i in sl]
        d_items = [(dsts[j].ref.model_stage, dsts[j].region) for j in dl]
        sig = (tuple(s_items), tuple(d_items)) if shared else None
        got = memo.get(cast(tuple, sig)) if shared else None
        if got is None:
            res = local(grid, s_items, d_items)
            cells, where = res.missing  # the missing (cell, piece) pairs, pieces by their place on this GPU
            got = (res, cells, where)
            if shared:
                assert sig is not None  # made when shared
                memo[sig] = got
        res, cells, where = got
        for i, j in res.keeps:
            keeps.append((sl[i], dl[j]))
        for i, j, cs in res.copies:
            copies.append((sl[i], dl[j], cs))
        if len(cells):
            miss_cells.append(cells)
            miss_pieces.append(np.asarray(dl, dtype=np.int64)[where])
    groups: dict[Box, list[int]] = defaultdict(list)
    for i, p in enumerate(srcs):
        groups[p.region].append(i)
    members = list(groups.values())
    holders: dict[int, list[int]] = defaultdict(list)  # cell -> the groups of source pieces holding it
    for g, region in enumerate(groups):
        for c in cells_of(region):
            holders[c].append(g)
    group_of = [0] * len(srcs)  # each source piece's group
    for g, pieces in enumerate(members):
        for i in pieces:
            group_of[i] = g
    return Structure(keeps, copies, _by_cell(miss_cells, miss_pieces, dsts), members, group_of, holders)


def _by_cell(
    cells: list, pieces: list, dsts: list[Holding]
) -> tuple[list[int], list[tuple[int, ...]], list[tuple[int, ...]]]:
    """Chunks of (cell, destination piece) pairs, in the order they were found, as the missing
    cells ascending and, for each, the pieces needing it split into parts: the pieces of one
    slice (a region) form a part, in the order they were found (a stable sort by cell), and the
    parts of a cell that share a GPU are one (a GPU receives a cell once, whichever of its
    shards need it). Returns the cells, each cell's parts as part numbers (in the order of
    their regions' first piece in ``dsts``), and the parts by number: a part is numbered once
    (every piece of a slice needing the cell, as the replicas of an inference layout do cell
    after cell, is its slice's number; others by their pieces), so that cells share them."""
    if not cells:
        return [], [], []
    c = np.concatenate([np.asarray(x, dtype=np.int64) for x in cells])
    p = np.concatenate([np.asarray(x, dtype=np.int64) for x in pieces])
    index: dict[Box, int] = {}
    region = np.fromiter((index.setdefault(d.region, len(index)) for d in dsts), dtype=np.int64, count=len(dsts))
    nk = len(index)
    k = region[p]
    order = np.argsort(c * nk + k, kind="stable")
    c, p, k = c[order], p[order], k[order]
    new_cell = np.r_[True, c[1:] != c[:-1]]
    part_starts = np.flatnonzero(new_cell | np.r_[True, k[1:] != k[:-1]])
    part_ends = np.r_[part_starts[1:], len(c)]
    part_k = k[part_starts]
    whole = (part_ends - part_starts) == np.bincount(region, minlength=nk)[part_k]  # every piece of its slice
    pid = np.where(whole, part_k, -1)
    pl = p.tolist()
    pieces_of: list = [None] * nk  # a part's pieces by its number (a slice's number: its first whole part)
    numbers: dict[tuple[int, ...], int] = {}

    def number(part: tuple[int, ...]) -> int:
        n = numbers.get(part)
        if n is None:
            n = numbers[part] = len(pieces_of)
            pieces_of.append(part)
        return n

    firsts = np.unique(part_k[whole], return_index=True)[1]
    for i in np.flatnonzero(whole)[firsts].tolist():
        part = pieces_of[part_k[i]] = tuple(pl[part_starts[i] : part_ends[i]])
        numbers[part] = int(part_k[i])
    for i, a, b in zip(np.flatnonzero(~whole).tolist(), part_starts[~whole].tolist(), part_ends[~whole].tolist()):
        pid[i] = number(tuple(pl[a:b]))
    cell_starts = np.flatnonzero(new_cell)
    ids = pid.tolist()
    first = np.searchsorted(part_starts, cell_starts).tolist() + [len(ids)]
    out = [tuple(ids[a:b]) for a, b in zip(first[:-1], first[1:])]
    if len(ids) > len(out):  # a cell of several parts: join those that share a GPU
        gpu = np.fromiter((d.gpu for d in dsts), dtype=np.int64, count=len(dsts))[p]
        key = c * (int(gpu.max()) + 1) + gpu
        o = np.argsort(key, kind="stable")
        clash = (key[o][1:] == key[o][:-1]) & (k[o][1:] != k[o][:-1])
        if clash.any():
            gpus_of: dict[tuple[int, ...], frozenset[int]]
            done: dict[tuple, tuple]
            cell_list, gpus_of, done = c[cell_starts], {}, {}
            for i in np.searchsorted(cell_list, np.unique(c[o][1:][clash])).tolist():
                got = done.get(out[i])  # cells whose parts are the same join the same
                if got is None:
                    parts = tuple(pieces_of[n] for n in out[i])
                    joined = _join_sharing(parts, dsts, gpus_of)
                    got = done[out[i]] = out[i] if joined is parts else tuple(number(part) for part in joined)
                out[i] = got
    return c[cell_starts].tolist(), out, pieces_of


def _join_sharing(
    parts: tuple[tuple[int, ...], ...], dsts: list[Holding], gpus_of: dict
) -> tuple[tuple[int, ...], ...]:
    """``parts`` with every two that share a GPU joined (their pieces by GPU, then index, as
    found); ``gpus_of``: each part's GPUs, remembered across cells (a replicas' part recurs)."""
    merged: list[tuple[list, frozenset]] = []
    for part in parts:
        gpus = gpus_of.get(part)
        if gpus is None:
            gpus = gpus_of[part] = frozenset([dsts[j].gpu for j in part])
        js = list(part)
        for other in [x for x in merged if not x[1].isdisjoint(gpus)]:
            merged.remove(other)
            js, gpus = js + other[0], gpus | other[1]
        merged.append((js, gpus))
    if len(merged) == len(parts):
        return parts
    return tuple(
        sorted(tuple(js) if len(js) == 1 else tuple(sorted(js, key=lambda j: (dsts[j].gpu, j))) for js, _ in merged)
    )


def family_spec(m: Module, model_name: str, state: str, family: str):
    """(model, bytes per element of the state, whether the family is per layer)."""
    model = m.models[model_name]
    return model, state_dtype_bytes(model, state), model.tensors[family].per_layer


def _offloaded(plan, model_stage: str, state: str) -> bool:
    """Whether the plan keeps this state of the model-stage in host memory between stages."""
    return ("weights" if state == "weight" else "optimizer") in plan.layouts[model_stage].offload


def _any_offloaded(plan, model_name: str, state: str) -> bool:
    """Whether the plan keeps this state of any model-stage of the model in host memory."""
    return any(ms.rpartition(".")[0] == model_name and _offloaded(plan, ms, state) for ms in plan.layouts)
