"""The planner behind ``plan-transition`` (see that module's docstring for the algorithm): the
operations of one transition, family by family, then loads and offloads, frees, and the
memory ordering of receives."""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict

from ..ir import Diagnostic, DiagnosticError, HostRef, Loc, Module, Op
from ..ir.verify_state import state_dtype_bytes
from .transition_grid import Box, Grid, Local, Piece, local


def _index(pieces: dict[tuple, list[Piece]]) -> dict[tuple, int]:
    """The index of each family's first piece when all pieces are numbered in key order."""
    out, n = {}, 0
    for key in sorted(pieces):
        out[key] = n
        n += len(pieces[key])
    return out


class Planner:
    """The operations of one transition, family by family. A piece is named by its number
    (``_index`` of its family plus its position), so that bookkeeping hashes integers."""

    def __init__(self, m: Module, source: str, target: str, cluster, src_all, dst_all) -> None:
        self.m, self.source, self.target, self.cluster = m, source, target, cluster
        self.plan_a, self.plan_b = m.plans[source], m.plans[target]
        self.src_all, self.dst_all = src_all, dst_all
        self.sbase, self.dbase = _index(src_all), _index(dst_all)
        self.ops: list[Op] = []  # op "%i" is ops[i]
        self.load: dict[int, int] = defaultdict(int)  # bytes each GPU sends
        self.bytes_moved = self.lower = 0
        self.reads: dict[int, list[str]] = defaultdict(list)  # source piece -> ops that read it (for frees)
        self.kept: set[int] = set()  # source pieces reused in place
        self.kept_b: set[int] = set()  # destination pieces kept in place
        self.delivers: dict[tuple[int, int], list[str]] = defaultdict(list)  # (family, destination shard) -> ops writing it
        # memory that receives take on each GPU: once per destination shard written (two
        # model-stages on one GPU each hold their copy) and the receiving ops with their share
        self.recv_bytes: dict[int, int] = defaultdict(int)
        self.recv_ops: dict[int, list[tuple[str, int]]] = defaultdict(list)
        self.copy_bytes: dict[int, int] = defaultdict(int)  # bytes local copies write, per GPU
        self.copy_ops: dict[int, list[str]] = defaultdict(list)
        self.loaded: set[int] = set()  # plan A's offloaded pieces that a load brings onto their GPU
        self.load_ops: dict[int, list[tuple[str, int]]] = defaultdict(list)  # GPU -> (load, bytes)

    def op(self, kind, state, family, region, src, dst, nbytes, link, per_layer: bool) -> Op:
        if per_layer:
            (l0, l1), box = region[0], region[1:]
            layers = (l0, l1 - 1)
        else:
            layers, box = None, region
        op = Op(id=f"%{len(self.ops)}", kind=kind, state=state, family=family, layers=layers, box=tuple(box), src=src,
                dst=dst, bytes=nbytes, link=link)
        self.ops.append(op)
        return op

    def family(self, key: tuple[str, str, str], srcs: list[Piece], dsts: list[Piece]) -> None:
        """Keep, copy, send and broadcast the cells of one (model, state, family)."""
        model_name, state, family = key
        _, itemsize, per_layer = _family(self.m, model_name, state, family)
        if not srcs:
            raise DiagnosticError([Diagnostic(self.plan_a.loc, f"plan @{self.source} holds no {state} of {family} of "
                                                               f"@{model_name}, which plan @{self.target} needs",
                                              "both plans must carry the same state")])
        dst_regions = {p.region for p in dsts}
        grid = Grid({p.region for p in srcs} | dst_regions)
        copies, missing = self._local(key, grid, srcs, dsts, shared=2 * len(dst_regions) <= len(dsts))
        transfers = self._senders(key, grid, srcs, dsts, missing, itemsize)
        sbase, dbase = self.sbase[key], self.dbase[key]
        reads, delivers, op = self.reads, self.delivers, self.op
        for si, dj, cells in copies:
            s, d = srcs[si], dsts[dj]
            for region in grid.boxes(cells):
                o = op("copy", state, family, region, [s.ref], [d.ref], _volume(region) * itemsize, "local", per_layer)
                reads[sbase + si].append(o.id)
                delivers[(dbase, d.rid)].append(o.id)
                self.copy_bytes[d.gpu] += o.bytes
                self.copy_ops[d.gpu].append(o.id)
        per_node = self.cluster.gpus_per_node  # Cluster.node_of, inline
        recv_bytes, recv_ops = self.recv_bytes, self.recv_ops
        for (si, receivers), cells in transfers.items():
            s = srcs[si]
            node = s.gpu // per_node
            if len(receivers) == 1 and len(cells) == 1:  # the common case: one cell to one GPU
                d = dsts[receivers[0]]
                region, n = grid.info(cells[0])
                nbytes = n * itemsize
                oid = op("send", state, family, region, [s.ref], [d.ref], nbytes,
                         "nvlink" if d.gpu // per_node == node else "nic", per_layer).id
                reads[sbase + si].append(oid)
                delivers[(dbase, d.rid)].append(oid)
                self.bytes_moved += nbytes
                recv_bytes[d.gpu] += nbytes
                recv_ops[d.gpu].append((oid, nbytes))
                continue
            rgpus = sorted({dsts[j].gpu for j in receivers})
            to = {dsts[j].rid: dsts[j].ref for j in receivers}  # one per destination shard, in order
            shards_on = Counter(dsts[j].gpu for j in {dsts[j].rid: j for j in receivers}.values())
            kind = "send" if len(receivers) == 1 else "broadcast"
            link = "nic" if any(g // per_node != node for g in rgpus) else "nvlink"
            for region in grid.boxes(cells):
                nbytes = _volume(region) * itemsize
                oid = op(kind, state, family, region, [s.ref], list(to.values()), nbytes, link, per_layer).id
                reads[sbase + si].append(oid)
                for rid in to:
                    delivers[(dbase, rid)].append(oid)
                self.bytes_moved += nbytes * len(rgpus)
                for g in rgpus:
                    recv_bytes[g] += nbytes * shards_on[g]
                    recv_ops[g].append((oid, nbytes * shards_on[g]))

    def _local(self, key, grid: Grid, srcs: list[Piece], dsts: list[Piece], shared: bool):
        """Keep in place, or copy from a source piece on the same GPU; collect the rest.

        Returns the copies (source, destination, cells) and the missing cells (cell -> the
        destination pieces needing it, by GPU ascending). With ``shared``, GPUs holding the same
        slices (replicas) decide the same: once.
        """
        sbase, dbase, kept, kept_b = self.sbase[key], self.dbase[key], self.kept, self.kept_b
        cells_of = grid.cells
        src_on: dict[int, list[int]] = defaultdict(list)
        for i, p in enumerate(srcs):
            src_on[p.gpu].append(i)
        dst_on: dict[int, list[int]] = defaultdict(list)
        for j, p in enumerate(dsts):
            dst_on[p.gpu].append(j)
        memo: dict[tuple, Local] = {}
        copies: list[tuple[int, int, list[int]]] = []
        missing: dict[int, list[int]] = defaultdict(list)
        for g in sorted(dst_on):
            sl, dl = src_on.get(g), dst_on[g]
            if not shared and len(dl) == 1 and (sl is None or len(sl) == 1):
                # one slice needed, at most one held: ``local`` without its per-cell tables
                j = dl[0]
                d = dsts[j]
                s = srcs[sl[0]] if sl else None
                if s is not None and s.region == d.region and s.ref.model_stage == d.ref.model_stage:
                    kept.add(sbase + sl[0])
                    kept_b.add(dbase + j)
                    continue
                held = () if s is None else cells_of(s.region)
                if len(held) > 8:
                    held = set(held)
                copied = []
                for c in cells_of(d.region):
                    if c in held:
                        copied.append(c)
                    else:
                        missing[c].append(j)
                if copied:
                    copies.append((sl[0], j, copied))
                continue
            sl = sl or ()
            s_items = [(srcs[i].ref.model_stage, srcs[i].region) for i in sl]
            d_items = [(dsts[j].ref.model_stage, dsts[j].region) for j in dl]
            if shared:
                sig = (tuple(s_items), tuple(d_items))
                res = memo.get(sig)
                if res is None:
                    res = memo[sig] = local(grid, s_items, d_items)
            else:
                res = local(grid, s_items, d_items)
            for i, j in res.keeps:
                kept.add(sbase + sl[i])
                kept_b.add(dbase + dl[j])
            for i, j, cells in res.copies:
                copies.append((sl[i], dl[j], cells))
            for c, js in res.missing:
                missing[c].extend(dl[j] for j in js)
        return copies, missing

    def _senders(self, key, grid: Grid, srcs: list[Piece], dsts: list[Piece], missing,
                 itemsize: int) -> dict[tuple[int, tuple[int, ...]], list[int]]:
        """One sender per missing cell, the least loaded GPU holding it: (sender, receivers) -> cells.

        Every receiving GPU misses the cell: its bytes count toward the lower bound once per GPU.
        """
        groups: dict[Box, list[int]] = defaultdict(list)
        for i, p in enumerate(srcs):
            groups[p.region].append(i)
        holders: dict[int, list[list[int]]] = defaultdict(list)  # cell -> groups of source pieces holding it
        for region, idx in groups.items():
            for c in grid.cells(region):
                holders[c].append(idx)
        load, info = self.load, grid.info
        lower = 0
        transfers: dict[tuple[int, tuple[int, ...]], list[int]] = {}
        for c in sorted(missing):
            recv = tuple(missing[c])
            cands = holders.get(c)
            if not cands:
                model_name, state, family = key
                raise DiagnosticError([Diagnostic(self.plan_b.loc, f"no GPU of plan @{self.source} holds part of {state} "
                                                                   f"{family} of @{model_name} that plan @{self.target} needs")])
            if len(cands) == 1 and len(cands[0]) == 1:
                best = cands[0][0]
            else:  # ties: the first holder in plan order
                best = min((i for idx in cands for i in idx),
                           key=lambda i: (load[srcs[i].gpu], srcs[i].gpu, srcs[i].ref.model_stage, i))
            gpus = 1 if len(recv) == 1 else len({dsts[j].gpu for j in recv})
            nbytes = info(c)[1] * itemsize * gpus
            load[srcs[best].gpu] += nbytes
            lower += nbytes
            t = transfers.get((best, recv))
            if t is None:
                transfers[(best, recv)] = [c]
            else:
                t.append(c)
        self.lower += lower
        return transfers

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
            _, itemsize, per_layer = _family(self.m, model_name, state, family)
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
                op = self.op("load", state, family, p.region, [HostRef(p.gpu)], [p.ref], _volume(p.region) * itemsize,
                             "pcie", per_layer)
                self.loaded.add(n)
                self.load_ops[p.gpu].append((op.id, op.bytes))
                for reader in readers:
                    r = ops[int(reader[1:])]
                    r.deps = sorted(set(r.deps) | {op.id}, key=_number)
                reads[n] = [op.id] + readers  # its free waits for the load too
        for key, pieces in sorted(self.dst_all.items()):
            model_name, state, family = key
            if not _any_offloaded(plan_b, model_name, state):
                continue
            _, itemsize, per_layer = _family(self.m, model_name, state, family)
            base = self.dbase[key]
            for j, p in enumerate(pieces):
                ms = p.ref.model_stage
                if not _offloaded(plan_b, ms, state):
                    continue
                if base + j in self.kept_b and ms in plan_a.layouts and _offloaded(plan_a, ms, state):
                    continue  # already in host memory, and stays there
                op = self.op("offload", state, family, p.region, [p.ref], [HostRef(p.gpu)], _volume(p.region) * itemsize,
                             "pcie", per_layer)
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
            _, itemsize, per_layer = _family(self.m, model_name, state, family)
            base = self.sbase[key]
            volume: dict[Box, int] = {}
            offloaded = {ms: _offloaded(self.plan_a, ms, state) for ms in {p.ref.model_stage for p in pieces}}
            for i, p in enumerate(pieces):
                nbytes = volume.get(p.region)
                if nbytes is None:
                    nbytes = volume[p.region] = _volume(p.region) * itemsize
                on_gpu = not offloaded[p.ref.model_stage]  # at the step boundary; a load brings the others
                if on_gpu:
                    mem_a[p.gpu] += nbytes
                if base + i in self.kept:
                    continue
                op = self.op("free", state, family, p.region, [p.ref], [], nbytes, "local", per_layer)
                op.deps = list(self.reads.get(base + i, ()))  # already in creation order
                if on_gpu or base + i in self.loaded:  # a slice that never left host memory frees no GPU memory
                    frees[p.gpu].append(op)
                    if not op.deps:
                        freeable[p.gpu].append(op)
        gpu_b = {p.ref: p.gpu for pieces in self.dst_all.values() for p in pieces}
        return Memory(self, mem_a, freeable, frees, gpu_b).order()


def _family(m: Module, model_name: str, state: str, family: str):
    """(model, bytes per element of the state, whether the family is per layer)."""
    model = m.models[model_name]
    return model, state_dtype_bytes(model, state), model.tensors[family].per_layer


def _offloaded(plan, model_stage: str, state: str) -> bool:
    """Whether the plan keeps this state of the model-stage in host memory between stages."""
    return ("weights" if state == "weight" else "optimizer") in plan.layouts[model_stage].offload


def _any_offloaded(plan, model_name: str, state: str) -> bool:
    """Whether the plan keeps this state of any model-stage of the model in host memory."""
    return any(ms.rpartition(".")[0] == model_name and _offloaded(plan, ms, state) for ms in plan.layouts)


def _number(op_id: str) -> int:
    return int(op_id[1:])


WAVE_BYTES = 64 * 2**20  # smallest wave of unstages that waits for one prefix of frees
WAVES = 32  # at most this many waves per GPU (more: earlier unstages, more buckets to schedule)


class Memory:
    """Order what grows each GPU's memory so that no GPU ever holds more than its memory, in
    any order the dependencies allow.

    A GPU g holds ``mem_a`` bytes of plan A (what is not offloaded at the step boundary) and
    grows by what loads bring back, what local copies write and what it receives (once per
    destination shard); the frees of slices that never left host memory free nothing on it. Where that
    does not fit, each copy or receive, in order, waits for the shortest prefix of g's frees of
    slices no one reads (``dead``) that leaves room for it and those before it. Where even all
    dead frees leave too little room, g stages: the loads (whose data is in host memory already),
    then the copies, then the receives, go to the GPU while they fit; each of the others writes ``host[g]`` instead (a copy over PCIe, a send
    over its link) and an ``unstage`` moves it onto the GPU. Unstages go in waves, each after
    the dead frees and the shortest prefix of g's other frees that leaves room for it, so that
    unstaging overlaps the sends those frees wait for. That always fits when plans A and B
    each fit on the GPU.
    """

    def __init__(self, planner: Planner, mem_a, dead, frees, gpu_b) -> None:
        self.p, self.mem_a, self.dead, self.frees, self.gpu_b = planner, mem_a, dead, frees, gpu_b
        self.cap = planner.cluster.gpu_memory
        self.staged_on_node: dict[int, int] = defaultdict(int)
        self.unstaged: dict[tuple[str, object], str] = {}  # (staged op, destination shard) -> unstage op

    def order(self) -> list[Diagnostic]:
        p, problems = self.p, []
        for g in sorted(set(p.recv_bytes) | set(p.copy_bytes) | set(p.load_ops)):
            loads = p.load_ops.get(g, [])
            loaded = sum(n for _, n in loads)
            grow = loaded + p.copy_bytes.get(g, 0) + p.recv_bytes.get(g, 0)
            if self.mem_a[g] + grow <= self.cap:
                continue
            dead = self.dead.get(g, [])
            room = self.cap - self.mem_a[g] + sum(op.bytes for op in dead)
            ops = [(oid, p.ops[_number(oid)].bytes) for oid in p.copy_ops.get(g, [])] + p.recv_ops.get(g, [])
            direct = loads + (ops if grow <= room else self._stage(g, room - loaded, grow, ops, problems))
            self._after_dead(g, direct, dead)
        self._offloads_after_unstage()
        host = self.p.cluster.host_memory
        for node, nbytes in sorted(self.staged_on_node.items()):
            if host is not None and nbytes > host:
                problems.append(Diagnostic(Loc(0, 0, None), f"staging needs {nbytes:,} bytes of host memory on node {node}, "
                                                             f"which has {host:,}", "transition in two steps"))
        return problems

    def _after_dead(self, g: int, direct: list[tuple[str, int]], dead: list[Op]) -> None:
        """Each copy or receive that writes GPU g directly waits for the shortest prefix of g's
        dead frees that leaves room for it and the ones before it (the first need none)."""
        p = self.p
        avail, k, need, prefix = self.cap - self.mem_a[g], 0, 0, []
        for op_id, nbytes in direct:
            need += nbytes
            while avail < need and k < len(dead):
                avail += dead[k].bytes
                prefix.append(dead[k].id)  # frees are numbered in creation order: the prefix stays sorted
                k += 1
            if prefix:
                op = p.ops[_number(op_id)]
                op.deps = prefix[:] if not op.deps else sorted({*op.deps, *prefix}, key=_number)

    def _stage(self, g: int, room: int, grow: int, ops: list[tuple[str, int]],
               problems: list[Diagnostic]) -> list[tuple[str, int]]:
        """Stage the copies and receives of GPU g that do not fit in ``room``; returns the others."""
        p = self.p
        kept = self.mem_a[g] - sum(op.bytes for op in self.frees.get(g, []))
        if room < 0 or kept + grow > self.cap:
            a_state = "plan A's state and its loads" if p.load_ops.get(g) else "plan A's state"
            what, short = (a_state, -room) if room < 0 else ("plan B's state", kept + grow - self.cap)
            problems.append(Diagnostic(Loc(0, 0, None), f"no order fits on GPU {g}: {what} alone would take {short:,} bytes "
                                                         "more than its memory", "choose a plan that fits"))
            return []
        direct, staged = [], []
        for op_id, nbytes in ops:
            if nbytes <= room:
                room -= nbytes
                direct.append((op_id, nbytes))
            else:
                staged.append((p.ops[_number(op_id)], nbytes))
        # unstages go in waves of at least WAVE_BYTES (or an eighth of what g stages): a wave
        # waits for the dead frees and for the shortest prefix of the other frees that leaves
        # room for it and the waves before, so unstaging overlaps the sends that free the rest
        # (room left >= 0, and all frees together cover every staged byte since plan B fits)
        dead = [f.id for f in self.dead.get(g, [])]
        live = [f for f in self.frees.get(g, []) if f.deps]
        wave_bytes = max(WAVE_BYTES, sum(n for _, n in staged) // WAVES)
        freed, k, need, wave, in_wave = room, 0, 0, [], 0
        for i, (op, nbytes) in enumerate(staged):
            need += nbytes
            wave.append(op)
            in_wave += nbytes
            if in_wave < wave_bytes and i + 1 < len(staged):
                continue
            while freed < need:
                freed += live[k].bytes
                k += 1
            deps = sorted({*dead, *(f.id for f in live[:k])}, key=_number) if dead else [f.id for f in live[:k]]
            for w in wave:
                self._unstage(g, w, deps)
            wave, in_wave = [], 0
        return direct

    def _unstage(self, g: int, op: Op, frees: list[str]) -> None:
        """Send or copy ``op``'s slice for GPU g into host[g]; an unstage moves it on after
        ``frees`` (sorted by number, as all dependency lists are)."""
        p = self.p
        mine = [r for r in op.dst if not isinstance(r, HostRef) and self.gpu_b[r] == g]
        at = op.dst.index(mine[0])
        rest = [r for r in op.dst if r not in mine]
        op.dst = rest[:at] + [HostRef(g)] + rest[at:]
        if op.kind == "copy":
            op.link = "pcie"  # device to its own host memory
        un = Op(id=f"%{len(p.ops)}", kind="unstage", state=op.state, family=op.family, layers=op.layers, box=op.box,
                src=[HostRef(g)], dst=mine, bytes=op.bytes, link="pcie", deps=list(frees))
        bisect.insort(un.deps, op.id, key=_number)
        p.ops.append(un)
        for r in mine:
            self.unstaged[(op.id, r)] = un.id
        self.staged_on_node[p.cluster.node_of(g)] += op.bytes

    def _offloads_after_unstage(self) -> None:
        """An offload of plan B's slice waits for the unstage that put a staged part of it on the GPU."""
        if not self.unstaged:
            return
        for op in self.p.ops:
            if op.kind == "offload":
                extra = {self.unstaged[(d, op.src[0])] for d in op.deps if (d, op.src[0]) in self.unstaged}
                if extra:
                    op.deps = sorted(set(op.deps) | extra, key=_number)


def _volume(region: Box) -> int:
    n = 1
    for lo, hi in region:
        n *= hi - lo
    return n
