"""The memory order of a transition (``plan-transition``, after ``transition.planner`` decided
what moves): copies and receives wait for frees where a GPU has no room, and where even that
does not fit they are staged through the host memory beside the GPU and unstaged in waves."""

from __future__ import annotations

from collections import defaultdict

from ...ir import Diagnostic, HostRef, Loc, Op
from ...ir.emu import volume


def op_number(op_id: str) -> int:
    """``%12`` -> 12: the creation order of an operation."""
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
    then the copies, then the receives, go to the GPU while they fit; each of the others writes ``host[g]`` instead (a
    copy over PCIe, a send
    over its link) and an ``unstage`` moves it onto the GPU; the slices of one tensor staged in
    one wave for the same shards, which together fill a box (a new shard gathered from many
    senders), are moved by one unstage (``merge_boxes``). Unstages go in waves, each after
    the dead frees and the shortest prefix of g's other frees that leaves room for it, so that
    unstaging overlaps the sends those frees wait for. That always fits when plans A and B
    each fit on the GPU.
    """

    def __init__(self, planner, mem_a, dead, frees, gpu_b) -> None:
        self.p, self.mem_a, self.dead, self.frees, self.gpu_b = planner, mem_a, dead, frees, gpu_b
        self.cap = planner.cluster.gpu_memory
        self.staged_on_node: dict[int, int] = defaultdict(int)
        self.unstaged: dict[str, dict[int, str]] = {}  # staged op -> GPU -> its unstage there
        self.staged: dict[str, tuple[Op, set[int]]] = {}  # staged op -> (it, the GPUs it writes host memory of)
        self._mine: dict[int, dict[int, list]] = {}  # id of a destination list -> GPU -> its shards there
        self._shards: dict[int, tuple] = {}  # id of such a list of shards -> the same as a tuple
        # operation -> the prefixes of dead frees it waits for, one per GPU it writes: (frees,
        # their numbers, length); added to its dependencies once, at the end (``_add_waits``)
        self.waits: dict[str, list[tuple[list[str], list[int], int]]] = defaultdict(list)

    def order(self) -> list[Diagnostic]:
        problems: list[Diagnostic]
        p, problems = self.p, []
        for g in sorted(set(p.recv_bytes) | set(p.copy_bytes) | set(p.load_ops)):
            loads = p.load_ops.get(g, [])
            loaded = sum(n for _, n in loads)
            grow = loaded + p.copy_bytes.get(g, 0) + p.recv_bytes.get(g, 0)
            if self.mem_a[g] + grow <= self.cap:
                continue
            dead = self.dead.get(g, [])
            room = self.cap - self.mem_a[g] + sum(op.bytes for op in dead)
            ops = [(oid, p.ops[op_number(oid)].bytes) for oid in p.copy_ops.get(g, [])] + p.received(g)
            direct = loads + (ops if grow <= room else self._stage(g, room - loaded, grow, ops, problems))
            self._after_dead(g, direct, dead)
        self._add_waits()
        self._write_host()
        self._offloads_after_unstage()
        host = self.p.cluster.host_memory
        for node, nbytes in sorted(self.staged_on_node.items()):
            if host is not None and nbytes > host:
                problems.append(
                    Diagnostic(
                        Loc(0, 0, None),
                        f"staging needs {nbytes:,} bytes of host memory on node {node}, which has {host:,}",
                        "transition in two steps",
                    )
                )
        return problems

    def _after_dead(self, g: int, direct: list[tuple[str, int]], dead: list[Op]) -> None:
        """Each copy or receive that writes GPU g directly waits for the shortest prefix of g's
        dead frees that leaves room for it and the ones before it (the first need none)."""
        avail, k, need, prefix, numbers = self.cap - self.mem_a[g], 0, 0, [], []
        for op_id, nbytes in direct:
            need += nbytes
            while avail < need and k < len(dead):
                avail += dead[k].bytes
                prefix.append(dead[k].id)  # frees are numbered in creation order: the prefix stays sorted
                numbers.append(op_number(dead[k].id))
                k += 1
            if prefix:  # the prefix only grows: its length now says which part this one waits for
                self.waits[op_id].append((prefix, numbers, len(prefix)))

    def _stage(
        self, g: int, room: int, grow: int, ops: list[tuple[str, int]], problems: list[Diagnostic]
    ) -> list[tuple[str, int]]:
        """Stage the copies and receives of GPU g that do not fit in ``room``; returns the others."""
        p = self.p
        kept = self.mem_a[g] - sum(op.bytes for op in self.frees.get(g, []))
        if room < 0 or kept + grow > self.cap:
            a_state = "plan A's state and its loads" if p.load_ops.get(g) else "plan A's state"
            what, short = (a_state, -room) if room < 0 else ("plan B's state", kept + grow - self.cap)
            problems.append(
                Diagnostic(
                    Loc(0, 0, None),
                    f"no order fits on GPU {g}: {what} alone would take {short:,} bytes more than its memory",
                    "choose a plan that fits",
                )
            )
            return []
        direct, staged = [], []
        for op_id, nbytes in ops:
            if nbytes <= room:
                room -= nbytes
                direct.append((op_id, nbytes))
            else:
                staged.append((p.ops[op_number(op_id)], nbytes))
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
            deps = sorted({*dead, *(f.id for f in live[:k])}, key=op_number) if dead else [f.id for f in live[:k]]
            self._unstage_wave(g, wave, deps)
            wave, in_wave = [], 0
        return direct

    def _stage_one(self, g: int, op: Op) -> list:
        """Send or copy ``op``'s slice for GPU g into host[g] (its destinations are rewritten once
        for all its GPUs, by ``_write_host``); returns its destination shards on g."""
        on = self._mine.get(id(op.dst))  # destination lists are shared between operations, and alive all along
        if on is None:
            on = self._mine[id(op.dst)] = defaultdict(list)
            for r in op.dst:
                on[self.gpu_b[r]].append(r)
        got = self.staged.get(op.id)
        if got is None:
            self.staged[op.id] = (op, {g})
        else:
            got[1].add(g)
        if op.spec.local:
            op.link = "pcie"  # a copy staged: device to its own host memory
        return on[g]

    def _unstage_wave(self, g: int, wave: list[Op], frees: list[str]) -> None:
        """Stage ``wave``'s slices for GPU g in host[g]; unstages move them onto g after ``frees``
        (sorted by number, as all dependency lists are). Slices of one tensor for the same shards
        that together fill a box (a new shard gathered from many senders) take one unstage."""
        p = self.p
        groups: dict[tuple, list[Op]] = {}
        mine_of: dict[tuple, list] = {}
        shards = self._shards
        for op in wave:
            mine = self._stage_one(g, op)
            on = shards.get(id(mine))  # the shards as a key, once per list (the lists live in ``_mine``)
            if on is None:
                on = shards[id(mine)] = tuple(mine)
            key = (op.state, op.family, op.layers, on)
            got = groups.get(key)
            if got is None:
                groups[key] = [op]
                mine_of[key] = mine
            else:
                got.append(op)
        node = p.cluster.node_of(g)
        for key, ops in groups.items():
            state, family, layers, _ = key
            for box, members in merge_boxes([op.box for op in ops]):
                fed = [ops[i] for i in members]
                nbytes = sum(op.bytes for op in fed)
                deps = frees if not fed else sorted([*frees, *(op.id for op in fed)], key=op_number)
                un = Op(
                    id=f"%{len(p.ops)}",
                    kind="unstage",
                    state=state,
                    family=family,
                    layers=layers,
                    box=box,
                    src=[HostRef(g)],
                    dst=list(mine_of[key]),
                    bytes=nbytes,
                    link="pcie",
                    deps=deps,
                )
                p.ops.append(un)
                unstaged = self.unstaged
                for op in fed:
                    by_gpu = unstaged.get(op.id)
                    if by_gpu is None:
                        unstaged[op.id] = {g: un.id}
                    else:
                        by_gpu[g] = un.id
                self.staged_on_node[node] += nbytes

    def _add_waits(self) -> None:
        """Every copy or receive waits for the prefixes of dead frees recorded for it, merged
        into its dependencies in number order, without repeats."""
        ops = self.p.ops
        for op_id, waits in self.waits.items():
            op = ops[op_number(op_id)]
            if len(waits) == 1 and not op.deps:
                prefix, _, k = waits[0]
                op.deps = prefix[:k]
                continue
            by_number = dict(zip(map(op_number, op.deps), op.deps))
            for prefix, numbers, k in waits:
                by_number.update(zip(numbers[:k], prefix[:k]))
            op.deps = [by_number[n] for n in sorted(by_number)]

    def _write_host(self) -> None:
        """A staged operation writes host[g] in place of its destination shards on each GPU g it
        stages for (where the first of them stood)."""
        for op, gpus in self.staged.values():
            dst, put = [], set()
            for r in op.dst:
                g = self.gpu_b[r]
                if g not in gpus:
                    dst.append(r)
                elif g not in put:
                    put.add(g)
                    dst.append(HostRef(g))
            op.dst = dst

    def _offloads_after_unstage(self) -> None:
        """An offload of plan B's slice waits for the unstage that put a staged part of it on the GPU."""
        if not self.unstaged:
            return
        unstaged = self.unstaged
        for op in self.p.ops:
            if op.kind == "offload":
                # its dependencies write its shard (they deliver it), so a staged one was staged for its GPU
                g = self.gpu_b[op.src[0]]
                extra = {u for u in (unstaged[d].get(g) for d in op.deps if d in unstaged) if u is not None}
                if extra:
                    op.deps = sorted(set(op.deps) | extra, key=op_number)


def merge_boxes(boxes: list) -> list[tuple[tuple, list[int]]]:
    """Disjoint boxes merged, greedily along each axis, where two are equal but on one axis and
    adjacent on it: (box, the indices of the boxes it is made of) for each result."""
    if len(boxes) == 1:
        return [(boxes[0], [0])]
    # the common case, one new shard's slices from many senders: disjoint boxes whose volumes add
    # up to their bounding box's fill it, and the greedy merge ends with that box
    hull = tuple((min(b[k][0] for b in boxes), max(b[k][1] for b in boxes)) for k in range(len(boxes[0])))
    if sum(volume(b) for b in boxes) == volume(hull):
        return [(hull, list(range(len(boxes))))]
    items = [(b, [i]) for i, b in enumerate(boxes)]
    for axis in reversed(range(len(boxes[0]))):
        items.sort(key=lambda it: (tuple(x for k, x in enumerate(it[0]) if k != axis), it[0][axis]))
        merged: list = []
        for b, members in items:
            if merged:
                q, into = merged[-1]
                if q[axis][1] == b[axis][0] and all(q[k] == b[k] for k in range(len(b)) if k != axis):
                    merged[-1] = (
                        tuple((q[k][0], b[k][1]) if k == axis else q[k] for k in range(len(b))),
                        into + members,
                    )
                    continue
            merged.append((b, members))
        items = merged
    return [(b, sorted(members)) for b, members in items]
