"""``lower-collectives``: a transition graph becomes a collective program (see ``program.py``).

The transition's operations name EMU shards and regions that may span a pipeline stage's whole
layer range; the runtime moves tensors as a training loop names them, one per layer. Lowering:

1. expands plan A's and plan B's EMUs into every rank's shard specs (``plan_layout``) and finds
   the destination shards that stay in place (same key, same box on the same rank);
2. gives every operation a level (0 without dependencies, else one more than its deepest
   dependency); the operations of one level run together: local loads and copies, then one
   round of batched point-to-point messages, then the broadcasts, then the copies from what
   arrived to a second model-stage on the same rank;
3. cuts every transfer into per-layer pieces and groups them per (level, sender, receiver):
   a piece of at least ``direct_bytes`` that is contiguous in the sender's source shard or in
   the receiver's destination shard travels alone (``direct``: the contiguous side sends from or
   receives into the shard itself, only a strided side copies); the rest is packed into
   buckets of at most ``bucket_bytes`` (one message each), as verl and NeMo-RL pack weights;
   with ``waves`` > 1 a level's messages go in that many successive rounds, the model's tensors
   in the order an engine loads them (the first stage's, layer 0 to the last, the last
   stage's) cut into runs of equal length: a consumer takes each run's tensors as its round
   lands while the next is on the wire (``execute``'s ``ready``, the weight push's stream);
4. a ``broadcast`` operation is sent from its root to each receiver inside the same round
   (``broadcast="p2p"``); or as a pipelined chain (``"chain"``): the payload in chunks of
   ``chunk_bytes`` passes from the root through the receivers in ring order, chunk c crossing
   hop h in sub-round c + h, so each rank sends to one neighbour and every link is busy; or as
   one ``dist.broadcast`` in a subgroup created once per program (``"collective"``). ``"auto"``
   (the default) chains a broadcast to three receivers or more when its root is the busiest
   sender: sent directly, the root would send more than any rank receives (one source to many);
   where every rank is a root of its own share (full replication) direct sends are balanced and
   use every connection at once, and they stay direct;
5. a copy or transfer that the transition stages in ``host[g]`` writes a host buffer on g's
   rank instead of the destination shard (such a broadcast is sent directly, never chained),
   and the ``unstage`` that waits for it copies the buffer into the shard;
6. frees become ``release`` steps at commit and offloads follow them, so that the source state
   survives until every destination slice has arrived and checked out;
7. checks that every destination shard that is not kept is written exactly once (by volume), and
   that every piece reads and writes inside its rank's shards (``check_program``).

Each stage is a method of ``_Lowering``, in this order; what an operation does is its kind's
definition (``ir.transition.OpKind``), never its name.
"""

from __future__ import annotations

from collections import defaultdict

from ..ir import Diagnostic, DiagnosticError, HostRef, Loc, Module, Op, ShardRef, bare_name
from ..ir.diagnostics import did_you_mean
from ..ir.gc_pause import gc_paused
from ..ir.transition import unstage_feeders
from .check_program import check_coverage, check_slices
from .program import Message, Piece, Program, Step
from .shards import ShardSpec, StateKey, plan_layout

DEFAULT_BUCKET = 64 * 2**20
DEFAULT_DIRECT = 64 * 2**10
DEFAULT_CHUNK = 8 * 2**20
BROADCASTS = ("auto", "p2p", "chain", "collective")
CHAIN_MIN = 3  # auto: a broadcast to this many remote receivers or more may become a chain


def contiguous(outer: tuple, inner: tuple) -> bool:
    """Whether box ``inner`` of a row-major tensor whose box is ``outer`` is one contiguous run."""
    dims = [(lo - o_lo, hi - o_lo, o_hi - o_lo) for (lo, hi), (o_lo, o_hi) in zip(inner, outer)]
    k = 0
    while k < len(dims) and dims[k][1] - dims[k][0] == 1:
        k += 1  # leading dimensions of extent 1
    return all(lo == 0 and hi == n for lo, hi, n in dims[k + 1 :])


def lower(
    m: Module,
    transition: str,
    bucket_bytes: int = DEFAULT_BUCKET,
    direct_bytes: int = DEFAULT_DIRECT,
    broadcast: str = "auto",
    gpus: list[int] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK,
    waves: int = 1,
) -> Program:
    """The collective program of ``transition``; see the module docstring.

    ``gpus``: the GPUs of the process group, rank r on ``gpus[r]`` (default: every GPU that holds
    state under either plan, except those lost, in order). It must include all of those. The
    plans' EMUs must be in the module (``derive-emus``); lowering never derives them.
    """
    if broadcast not in BROADCASTS:
        raise ValueError(f"broadcast is one of {', '.join(BROADCASTS)}")
    if waves < 1:
        raise ValueError(f"waves = {waves}: a level's messages need at least one round")
    t = m.transitions[transition]
    for p in (t.source, t.target):
        m.require_emus(p, "lower-collectives")
    with gc_paused():  # 40% of a 32-GPU lowering went to the collector (ir/gc_pause.py)
        # 1. ranks and shards
        low = _Lowering(m, transition, gpus, bucket_bytes, direct_bytes, broadcast, chunk_bytes, waves)
        for op in t.ops:  # 2.-6. levels; every operation cut into per-layer pieces and steps
            low.cut(op)
        check_coverage(low.dst, low.kept, low.written, t.restored is not None)  # 7. every destination byte written once
        low.chain()  # 4. chained broadcasts become sub-rounds of point-to-point messages
        prog = low.assemble()  # 3. pieces packed into messages and rounds; the program, rank by rank
        check_slices(prog)  # 7. every piece inside its rank's shards
    return prog


def load_wave(model, name: str, waves: int) -> int:
    """Which of ``waves`` runs a tensor of ``model`` falls in when the model's tensors are taken
    in the order an engine loads them (the first pipeline stage's, layer 0 to the last, the last
    stage's) and cut into ``waves`` runs of equal length."""
    if name.startswith("layers."):
        place = 1 + int(name.split(".")[1])
    else:
        place = model.layers + 1 if model.tensors[name].placement == "last" else 0
    return min(waves - 1, place * waves // (model.layers + 2))


def _levels(ops: list[Op]) -> dict[str, int]:
    """Operation id -> level: 0 without dependencies, else one more than its deepest dependency."""
    by_id = {op.id: op for op in ops}
    level: dict[str, int] = {}
    for op in ops:
        stack = [op]
        while stack:
            cur = stack[-1]
            if cur.id in level:
                stack.pop()
                continue
            todo = [by_id[d] for d in cur.deps if d not in level]
            if todo:
                stack.extend(todo)
                continue
            level[cur.id] = 1 + max((level[d] for d in cur.deps), default=-1)
            stack.pop()
    return level


def _names(op: Op) -> list[tuple[str, str]]:
    """(state, per-layer tensor name) of every tensor an operation's slice covers: each of its
    states (``optimizer``: master, exp_avg, exp_avg_sq) of each layer."""
    if op.layers is None:
        names = [op.family]
    else:
        names = [f"layers.{i}.{op.family}" for i in range(op.layers[0], op.layers[1] + 1)]
    return [(st, n) for st in op.states for n in names]


def _nbytes(box, itemsize: int) -> int:
    n = itemsize
    for lo, hi in box:
        n *= hi - lo
    return n


def _error(msg: str, hint: str | None = None, file: str | None = None) -> DiagnosticError:
    return DiagnosticError([Diagnostic(Loc(0, 0, file), msg, hint)])


class _Lowering:
    """The state of one lowering, built stage by stage (see the module docstring)."""

    def __init__(
        self,
        m: Module,
        transition: str,
        gpus: list[int] | None,
        bucket_bytes: int,
        direct_bytes: int,
        broadcast: str,
        chunk_bytes: int,
        waves: int = 1,
    ):
        t = self.t = m.transitions[transition]
        self.m, self.waves = m, waves
        self._wave: dict[tuple[str, str], int] = {}
        self.name, self.bucket_bytes, self.direct_bytes = transition, bucket_bytes, direct_bytes
        self.broadcast, self.chunk_bytes = broadcast, chunk_bytes
        # 1. every rank's shards under both plans, and the destination shards that stay in place
        self.gpu_of: dict[tuple[str, ShardRef], int] = {}
        for (plan, ms, dp), emu in m.emus.items():
            for s in emu.shards:
                self.gpu_of[(plan, ShardRef(ms, dp, s.pp, s.tp))] = s.gpu
        # one StateKey object per key (its hash computed once; lookups find it by identity)
        self._keys: dict[tuple[str, str, str], StateKey] = {}
        src_by_gpu, dst_by_gpu = plan_layout(m, t.source, self._keys), plan_layout(m, t.target, self._keys)
        cluster = m.clusters[m.plans[t.target].cluster]
        senders = {self.gpu_of[(t.source, op.src[0])] for op in t.ops if op.spec.transfer and op.src}
        lost = set(cluster.unavailable) - senders
        needed = (set(src_by_gpu) | set(dst_by_gpu)) - lost
        if gpus is None:
            gpus = sorted(needed)
        elif not needed <= set(gpus) or len(set(gpus)) != len(gpus):
            raise _error(f"lower-collectives: the process group's GPUs {gpus} must include {sorted(needed)}, once each")
        self.gpus = list(gpus)
        self.rank_of = {g: r for r, g in enumerate(self.gpus)}
        self.src: dict[int, list[ShardSpec]] = {self.rank_of[g]: src_by_gpu.get(g, []) for g in self.gpus}
        self.dst: dict[int, list[ShardSpec]] = {self.rank_of[g]: dst_by_gpu.get(g, []) for g in self.gpus}
        self.src_spec = {(r, s.key): s for r, specs in self.src.items() for s in specs}
        self.dst_spec = {(r, s.key): s for r, specs in self.dst.items() for s in specs}
        self.kept = {
            (r, s.key)
            for r, specs in self.dst.items()
            for s in specs
            if (r, s.key) in self.src_spec and self.src_spec[(r, s.key)].box == s.box
        }
        # 2. levels: the operations of one level run together
        self.level = _levels(t.ops)
        self.n_levels = 1 + max(self.level.values(), default=-1)
        self.before: dict[tuple[int, int], list[Step]] = defaultdict(list)  # (rank, level) -> loads, copies, unstages
        self.after: dict[tuple[int, int], list[Step]] = defaultdict(list)  # (rank, level) -> copies from what arrived
        self.pending: dict[tuple[int, int, int, int, int], list[Piece]] = defaultdict(
            list
        )  # (level, wave, sub-round, sender, receiver)
        self.chains: dict[tuple[int, int, int, tuple[int, ...]], list[dict[int, Piece]]] = defaultdict(
            list
        )  # (level, wave, root, ring)
        self.bcasts: dict[tuple[int, int, tuple[int, ...]], list[dict[int, Piece]]] = defaultdict(
            list
        )  # receiver -> piece
        self.releases: dict[int, list[StateKey]] = defaultdict(list)
        self.offloads: dict[int, list[StateKey]] = defaultdict(list)
        self.written: dict[tuple[int, StateKey], int] = defaultdict(int)
        # a shard that takes staged slices is allocated at its first write, not up front: the GPU
        # has no room for it beside plan A's state
        self.late: dict[int, set[StateKey]] = defaultdict(set)
        self._direct_loads()
        self._staged_targets()

    def key(self, ref: ShardRef, state: str, name: str) -> StateKey:
        t = (ref.model_stage, state, name)
        k = self._keys.get(t)
        if k is None:
            k = self._keys[t] = StateKey(*t)
        return k

    def _direct_loads(self) -> None:
        """For ``auto``: what each GPU would send, and the most any GPU would receive, if every
        broadcast went direct."""
        t, gpu_of = self.t, self.gpu_of
        self.direct_send: dict[int, int] = defaultdict(int)
        direct_recv: dict[int, int] = defaultdict(int)
        for op in t.ops:
            if op.spec.transfer and not op.spec.local:
                g = gpu_of[(t.source, op.src[0])]
                rcv = {r.gpu if isinstance(r, HostRef) else gpu_of[(t.target, r)] for r in op.dst} - {g}
                self.direct_send[g] += op.bytes * len(rcv)
                for h in rcv:
                    direct_recv[h] += op.bytes
        self.busiest_receiver = max(direct_recv.values(), default=0)

    def _staged_targets(self) -> None:
        """A slice staged in host[g] by operation d: the destination shards on g that its unstage fills."""
        by_id = {op.id: op for op in self.t.ops}
        self.staged_for: dict[tuple[str, int], list[ShardRef]] = {}
        self.fed_by: dict[str, list[Op]] = {}  # unstage -> the operations that staged its slices
        for op in self.t.ops:
            if op.spec.reads_host and op.spec.delivers:
                g = op.src[0].gpu
                fed = self.fed_by[op.id] = unstage_feeders(op, by_id)
                for f in fed:
                    self.staged_for[(f.id, g)] = list(op.dst)

    def wave(self, model_stage: str, name: str) -> int:
        """3. The wave a tensor's pieces travel in (``load_wave``)."""
        w = self._wave.get((model_stage, name))
        if w is None:
            w = self._wave[(model_stage, name)] = load_wave(self.m.models[model_stage.split(".")[0]], name, self.waves)
        return w

    def chained(self, root_gpu: int, remote: int) -> bool:
        """4. Whether a broadcast from ``root_gpu`` to ``remote`` receivers is chained (or a collective)."""
        if self.broadcast in ("chain", "collective"):
            return True
        return self.broadcast == "auto" and remote >= CHAIN_MIN and self.direct_send[root_gpu] > self.busiest_receiver

    # -- 3., 5., 6.: an operation becomes steps and pieces ---------------------------------------
    def cut(self, op: Op) -> None:
        kind = op.spec
        if kind.frees:
            self._release(op)
        elif kind.reads_host and kind.delivers:
            self._unstage(op)
        elif kind.pcie:
            self._host_move(op)
        elif kind.transfer:
            self._transfer(op)
        else:  # pragma: no cover - every kind is one of the above
            raise AssertionError(f"lowering has no rule for {op.kind}")

    def _release(self, op: Op) -> None:
        """6. A free becomes a ``release`` at commit: the source state survives until then."""
        for ref in op.src:
            g = self.gpu_of[(self.t.source, ref)]
            if g in self.rank_of:
                self.releases[self.rank_of[g]] += [self.key(ref, st, n) for st, n in _names(op)]

    def _unstage(self, op: Op) -> None:
        """5. An unstage copies the staging buffers of the slices it takes (each operation it
        depends on that staged one) into every destination shard on its GPU."""
        r, lv = self.rank_of[op.src[0].gpu], self.level[op.id]
        first = op.dst[0]
        boxes = [f.box for f in self.fed_by[op.id]]
        for state, name in _names(op):
            fk = self.key(first, state, name)
            itemsize = self.dst_spec[(r, fk)].itemsize
            for ref in op.dst:
                dk = self.key(ref, state, name)
                for box in boxes:
                    nb = _nbytes(box, itemsize)
                    self.before[(r, lv)].append(Step("unstage", piece=Piece(fk, dk, box, nb, staged=True), round=lv))
                    self.written[(r, dk)] += nb
                self.late[r].add(dk)

    def _host_move(self, op: Op) -> None:
        """A load runs at its level; an offload follows the releases at commit."""
        t, kind = self.t, op.spec
        loads = kind.reads_host
        refs = op.dst if loads else op.src
        plan = t.source if (kind.destination_plan if loads else kind.source_plan) == "source" else t.target
        for ref in refs:
            r = self.rank_of[self.gpu_of[(plan, ref)]]
            ks = tuple(self.key(ref, st, n) for st, n in _names(op))
            if loads:
                self.before[(r, self.level[op.id])].append(Step("load", keys=ks, round=self.level[op.id]))
            else:
                self.offloads[r] += ks

    def _transfer(self, op: Op) -> None:
        """3. A copy, send or broadcast: every (source, receiving GPU) pair becomes per-layer pieces."""
        t, rank_of, lv, names = self.t, self.rank_of, self.level[op.id], _names(op)
        by_gpu: dict[int, list[ShardRef]] = defaultdict(list)
        staged: set[int] = set()  # GPUs that receive into a host staging buffer
        for ref in op.dst:
            if isinstance(ref, HostRef):
                refs = self.staged_for.get((op.id, ref.gpu))
                if refs is None:
                    raise _error(
                        f"lower-collectives: {op.id} ({op.kind}) stages a slice in {ref} that no unstage takes"
                    )
                by_gpu[ref.gpu] += refs[:1]  # staged once; the unstage fills every shard
                staged.add(ref.gpu)
            else:
                by_gpu[self.gpu_of[(t.target, ref)]].append(ref)
        for sref in op.src:
            box = op.box
            s = rank_of[self.gpu_of[(t.source, sref)]]
            remote = sorted(rank_of[g] for g in by_gpu if rank_of[g] != s)
            grouped = op.spec.one_to_many and len(remote) > 1 and not staged and self.chained(self.gpus[s], len(remote))
            for state, name in names:
                sk = self.key(sref, state, name)
                nb = _nbytes(box, self.src_spec[(s, sk)].itemsize)
                wave = self.wave(sref.model_stage, name) if self.waves > 1 else 0
                group_pieces: dict[int, Piece] = {}
                for g, refs in by_gpu.items():
                    r = rank_of[g]
                    first = self.key(refs[0], state, name)
                    piece = Piece(sk, first, box, nb, staged=g in staged)
                    if r == s:
                        self.before[(r, lv)].append(Step("copy", piece=piece, round=lv))
                    elif grouped:
                        group_pieces[r] = piece
                    else:
                        self.pending[(lv, wave, 0, s, r)].append(piece)
                    if g in staged:
                        continue  # written into the shards by the unstage
                    self.written[(r, first)] += nb
                    for extra in refs[1:]:  # a second model-stage on the same GPU copies what arrived
                        ek = self.key(extra, state, name)
                        self.after[(r, lv)].append(
                            Step("copy", piece=Piece(first, ek, box, nb, arrived=True), round=lv)
                        )
                        self.written[(r, ek)] += nb
                if group_pieces and self.broadcast == "collective":
                    self.bcasts[(lv, s, tuple(remote))].append(group_pieces)
                elif group_pieces:  # a ring from the root through the receivers, in rank order after it
                    ring = tuple(sorted(remote, key=lambda x: (x - s) % len(self.gpus)))
                    self.chains[(lv, wave, s, ring)].append(group_pieces)

    # -- 4. chains -----------------------------------------------------------------------------
    def chain(self) -> None:
        """Pipelined chains: the payload of each (root, ring) in chunks; chunk c crosses hop h in
        sub-round c + h, so every link of the ring is busy at once and each rank sends to one
        neighbour (a chunked ring broadcast made of point-to-point messages)."""
        for (lv, wave, s, ring), entries in self.chains.items():
            done = 0
            for e in entries:
                c = done // self.chunk_bytes
                done += next(iter(e.values())).nbytes
                for h, r in enumerate(ring):
                    if h == 0:
                        self.pending[(lv, wave, c, s, r)].append(e[r])
                    else:
                        prev = e[ring[h - 1]]
                        self.pending[(lv, wave, c + h, ring[h - 1], r)].append(
                            Piece(prev.dst, e[r].dst, prev.box, prev.nbytes, arrived=True)
                        )

    # -- 3. messages, rounds and the program -----------------------------------------------------
    def _messages(self, ids) -> dict[tuple[int, int, int, int], tuple[list[Message], list[Message]]]:
        """(rank, level, wave, sub-round) -> (sends, receives): a piece of at least ``direct_bytes``
        contiguous on one side travels alone, the rest is packed into buckets."""
        rounds: dict[tuple[int, int, int, int], tuple[list[Message], list[Message]]] = defaultdict(lambda: ([], []))
        for (lv, wave, sub, s, r), pieces in sorted(self.pending.items()):
            direct, packed = [], []
            for p in pieces:
                held = (self.dst_spec if p.arrived else self.src_spec)[(s, p.src)].box
                # one side contiguous is enough: the sender sends its slice as is, or the receiver
                # receives into its slice as is; only the strided side copies
                ok = p.nbytes >= self.direct_bytes and (
                    contiguous(held, p.box) or p.staged or contiguous(self.dst_spec[(r, p.dst)].box, p.box)
                )
                (direct if ok else packed).append(p)
            msgs = [Message(next(ids), s, r, (p,), True) for p in direct]
            bucket: list[Piece] = []
            for p in packed:
                if bucket and sum(x.nbytes for x in bucket) + p.nbytes > self.bucket_bytes:
                    msgs.append(Message(next(ids), s, r, tuple(bucket), False))
                    bucket = []
                bucket.append(p)
            if bucket:
                msgs.append(Message(next(ids), s, r, tuple(bucket), False))
            rounds[(s, lv, wave, sub)][0].extend(msgs)
            rounds[(r, lv, wave, sub)][1].extend(msgs)
        return rounds

    def _broadcast_steps(self, ids, groups: list[tuple[int, ...]]) -> dict[tuple[int, int], list[Step]]:
        """4. ``collective``: one ``dist.broadcast`` per (level, root, receivers), in a subgroup created once."""
        bsteps: dict[tuple[int, int], list[Step]] = defaultdict(list)
        for (lv, s, remote), entries in sorted(self.bcasts.items()):
            members = tuple(sorted((s, *remote)))
            if members not in groups:
                groups.append(members)
            mid = next(ids)
            for member in (s, *remote):  # the same boxes in the same order on every member; dst keys are its own
                if member == s:
                    mine = tuple(
                        Piece(p.src, p.src, p.box, p.nbytes) for p in (next(iter(e.values())) for e in entries)
                    )
                else:
                    mine = tuple(e[member] for e in entries)
                bsteps[(member, lv)].append(
                    Step("broadcast", group=(s, *remote), round=lv, message=Message(mid, s, -1, mine, False))
                )
        return bsteps

    def assemble(self) -> Program:
        ids = iter(range(1 << 62))
        rounds = self._messages(ids)
        round_no = {k: i for i, k in enumerate(sorted({(lv, wave, sub) for (_, lv, wave, sub) in rounds}))}
        groups: list[tuple[int, ...]] = []
        bsteps = self._broadcast_steps(ids, groups)
        t = self.t
        prog = Program(
            transition=self.name,
            source=t.source,
            target=t.target,
            gpus=self.gpus,
            src=self.src,
            dst=self.dst,
            groups=groups,
            bucket_bytes=self.bucket_bytes,
            round_levels=[lv for lv, _, _ in sorted(round_no)],
        )
        for r in range(len(self.gpus)):
            steps: list[Step] = []
            alloc = tuple(s.key for s in self.dst[r] if (r, s.key) not in self.kept and s.key not in self.late[r])
            keep = tuple(s.key for s in self.dst[r] if (r, s.key) in self.kept)
            if keep:
                steps.append(Step("keep", keys=keep))
            if alloc:
                steps.append(Step("alloc", keys=alloc))
            for lv in range(self.n_levels):
                steps += self.before.get((r, lv), [])
                for (level, wave, sub), no in round_no.items():
                    sends, recvs = rounds.get((r, level, wave, sub), ([], []))
                    if level == lv and (sends or recvs):
                        steps.append(
                            Step(
                                "round",
                                sends=tuple(sorted(sends, key=lambda x: x.id)),
                                recvs=tuple(sorted(recvs, key=lambda x: x.id)),
                                round=no,
                            )
                        )
                steps += bsteps.get((r, lv), [])
                steps += self.after.get((r, lv), [])
            if self.releases.get(r):
                steps.append(Step("release", keys=tuple(dict.fromkeys(self.releases[r]))))
            if self.offloads.get(r):
                steps.append(Step("offload", keys=tuple(dict.fromkeys(self.offloads[r]))))
            prog.steps[r] = steps
        return prog


def pick_transition(module: Module, name: str = "") -> str:
    name = bare_name(name)
    if not name:
        if len(module.transitions) != 1:
            raise _error(
                f"lowering needs one transition: the module has {len(module.transitions)}",
                "name one (transition=@name), or plan one first: -p plan-transition{to=@b},schedule-transfers",
                module.filename,
            )
        return next(iter(module.transitions))
    if name not in module.transitions:
        raise _error(f"lowering: no transition @{name}", did_you_mean(name, module.transitions), module.filename)
    return name
