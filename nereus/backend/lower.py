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
7. checks that every destination shard that is not kept is written exactly once (by volume).
"""

from __future__ import annotations

from collections import defaultdict

from ..ir import Diagnostic, DiagnosticError, HostRef, Loc, Module, ShardRef
from ..ir.diagnostics import did_you_mean
from .program import Message, Piece, Program, Step
from .shards import StateKey, plan_layout

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
    return all(lo == 0 and hi == n for lo, hi, n in dims[k + 1:])


def _levels(ops) -> dict[str, int]:
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


def _names(op) -> list[str]:
    if op.layers is None:
        return [op.family]
    return [f"layers.{i}.{op.family}" for i in range(op.layers[0], op.layers[1] + 1)]


def _nbytes(box, itemsize: int) -> int:
    n = itemsize
    for lo, hi in box:
        n *= hi - lo
    return n


def _error(msg: str, hint: str | None = None, file: str | None = None) -> DiagnosticError:
    return DiagnosticError([Diagnostic(Loc(0, 0, file), msg, hint)])


def lower(m: Module, transition: str, bucket_bytes: int = DEFAULT_BUCKET, direct_bytes: int = DEFAULT_DIRECT,
          broadcast: str = "auto", gpus: list[int] | None = None, chunk_bytes: int = DEFAULT_CHUNK) -> Program:
    """The collective program of ``transition``; see the module docstring.

    ``gpus``: the GPUs of the process group, rank r on ``gpus[r]`` (default: every GPU that holds
    state under either plan, except those lost, in order). It must include all of those.
    """
    if broadcast not in BROADCASTS:
        raise ValueError(f"broadcast is one of {', '.join(BROADCASTS)}")
    t = m.transitions[transition]
    for p in (t.source, t.target):
        m.require_emus(p, "lower-collectives")
    gpu_of: dict[tuple[str, ShardRef], int] = {}
    for (plan, ms, dp), emu in m.emus.items():
        for s in emu.shards:
            gpu_of[(plan, ShardRef(ms, dp, s.pp, s.tp))] = s.gpu
    src_by_gpu, dst_by_gpu = plan_layout(m, t.source), plan_layout(m, t.target)
    cluster = m.clusters[m.plans[t.target].cluster]
    senders = {gpu_of[(t.source, op.src[0])] for op in t.ops if op.kind in ("send", "broadcast", "copy") and op.src}
    senders |= {gpu_of[(t.source, r)] for op in t.ops if op.kind == "allgather" for r in op.src}
    lost = set(cluster.unavailable) - senders
    needed = (set(src_by_gpu) | set(dst_by_gpu)) - lost
    if gpus is None:
        gpus = sorted(needed)
    elif not needed <= set(gpus) or len(set(gpus)) != len(gpus):
        raise _error(f"lower-collectives: the process group's GPUs {gpus} must include {sorted(needed)}, once each")
    gpus = list(gpus)
    rank_of = {g: r for r, g in enumerate(gpus)}
    src = {rank_of[g]: src_by_gpu.get(g, []) for g in gpus}
    dst = {rank_of[g]: dst_by_gpu.get(g, []) for g in gpus}
    src_box = {(r, s.key): s for r, specs in src.items() for s in specs}
    dst_box = {(r, s.key): s for r, specs in dst.items() for s in specs}
    kept = {(r, s.key) for r, specs in dst.items() for s in specs
            if (r, s.key) in src_box and src_box[(r, s.key)].box == s.box}

    level = _levels(t.ops)
    n_levels = 1 + max(level.values(), default=-1)
    before: dict[tuple[int, int], list[Step]] = defaultdict(list)  # (rank, level) -> loads, copies
    after: dict[tuple[int, int], list[Step]] = defaultdict(list)  # (rank, level) -> copies from what arrived
    pending: dict[tuple[int, int, int, int], list[Piece]] = defaultdict(list)  # (level, sub-round, sender, receiver)
    chains: dict[tuple[int, int, tuple[int, ...]], list[dict[int, Piece]]] = defaultdict(list)  # (level, root, ring order)
    bcasts: dict[tuple[int, int, tuple[int, ...]], list[dict[int, Piece]]] = defaultdict(list)  # receiver -> piece
    releases: dict[int, list[StateKey]] = defaultdict(list)
    offloads: dict[int, list[StateKey]] = defaultdict(list)
    written: dict[tuple[int, StateKey], int] = defaultdict(int)
    # a shard that takes staged slices is allocated at its first write, not up front: the GPU
    # has no room for it beside plan A's state
    late: dict[int, set[StateKey]] = defaultdict(set)

    def key(ref: ShardRef, state: str, name: str) -> StateKey:
        return StateKey(ref.model_stage, state, name)

    # auto: what each GPU would send and receive if every broadcast went direct
    direct_send: dict[int, int] = defaultdict(int)
    direct_recv: dict[int, int] = defaultdict(int)
    for op in t.ops:
        if op.kind in ("send", "broadcast"):
            g = gpu_of[(t.source, op.src[0])]
            rcv = {r.gpu if isinstance(r, HostRef) else gpu_of[(t.target, r)] for r in op.dst} - {g}
            direct_send[g] += op.bytes * len(rcv)
            for h in rcv:
                direct_recv[h] += op.bytes
    busiest_receiver = max(direct_recv.values(), default=0)

    def chained(root_gpu: int, remote: int) -> bool:
        if broadcast in ("chain", "collective"):
            return True
        return broadcast == "auto" and remote >= CHAIN_MIN and direct_send[root_gpu] > busiest_receiver

    # a slice staged in host[g]: the destination shards on g that its unstage fills
    by_id = {op.id: op for op in t.ops}
    staged_for: dict[tuple[str, int], list[ShardRef]] = {}
    for op in t.ops:
        if op.kind == "unstage":
            g = op.src[0].gpu
            for d in op.deps:
                if any(isinstance(r, HostRef) and r.gpu == g for r in by_id[d].dst):
                    staged_for[(d, g)] = list(op.dst)

    for op in t.ops:
        lv, names = level[op.id], _names(op)
        if op.kind == "free":
            for ref in op.src:
                g = gpu_of[(t.source, ref)]
                if g in rank_of:
                    releases[rank_of[g]] += [key(ref, op.state, n) for n in names]
            continue
        if op.kind == "unstage":
            r = rank_of[op.src[0].gpu]
            first = op.dst[0]
            for name in names:
                fk = key(first, op.state, name)
                itemsize = dst_box[(r, fk)].itemsize
                for ref in op.dst:
                    dk = key(ref, op.state, name)
                    before[(r, lv)].append(Step("unstage", piece=Piece(fk, dk, op.box, _nbytes(op.box, itemsize), staged=True)))
                    written[(r, dk)] += _nbytes(op.box, itemsize)
                    late[r].add(dk)
            continue
        if op.kind in ("load", "offload"):
            refs = op.dst if op.kind == "load" else op.src
            plan = t.source if op.kind == "load" else t.target
            for ref in refs:
                r = rank_of[gpu_of[(plan, ref)]]
                ks = tuple(key(ref, op.state, n) for n in names)
                if op.kind == "load":
                    before[(r, lv)].append(Step("load", keys=ks))
                else:
                    offloads[r] += ks
            continue
        # copy, send, broadcast, allgather: every (source part, receiving GPU) pair becomes pieces
        parts = [(ref, op.box) for ref in op.src] if op.kind != "allgather" else None
        if op.kind == "allgather":  # each source sends its part of the box
            parts = []
            for ref in op.src:
                g = gpu_of[(t.source, ref)]
                spec = src_box[(rank_of[g], key(ref, op.state, names[0]))]
                inter = tuple((max(a, lo), min(b, hi)) for (a, b), (lo, hi) in zip(spec.box, op.box))
                if all(lo < hi for lo, hi in inter):
                    parts.append((ref, inter))
        by_gpu: dict[int, list[ShardRef]] = defaultdict(list)
        staged: set[int] = set()  # GPUs that receive into a host staging buffer
        for ref in op.dst:
            if isinstance(ref, HostRef):
                refs = staged_for.get((op.id, ref.gpu))
                if refs is None:
                    raise _error(f"lower-collectives: {op.id} ({op.kind}) stages a slice in {ref} that no unstage takes")
                by_gpu[ref.gpu] += refs[:1]  # staged once; the unstage fills every shard
                staged.add(ref.gpu)
            else:
                by_gpu[gpu_of[(t.target, ref)]].append(ref)
        for sref, box in parts:
            s = rank_of[gpu_of[(t.source, sref)]]
            remote = sorted(rank_of[g] for g in by_gpu if rank_of[g] != s)
            for name in names:
                sk = key(sref, op.state, name)
                itemsize = src_box[(s, sk)].itemsize
                nb = _nbytes(box, itemsize)
                group_pieces: dict[int, Piece] = {}
                for g, refs in by_gpu.items():
                    r = rank_of[g]
                    first = key(refs[0], op.state, name)
                    piece = Piece(sk, first, box, nb, staged=g in staged)
                    if r == s:
                        before[(r, lv)].append(Step("copy", piece=piece))
                    elif op.kind == "broadcast" and len(remote) > 1 and not staged and chained(gpus[s], len(remote)):
                        group_pieces[r] = piece
                    else:
                        pending[(lv, 0, s, r)].append(piece)
                    if g in staged:
                        continue  # written into the shards by the unstage
                    written[(r, first)] += nb
                    for extra in refs[1:]:  # a second model-stage on the same GPU copies what arrived
                        ek = key(extra, op.state, name)
                        after[(r, lv)].append(Step("copy", piece=Piece(first, ek, box, nb, arrived=True)))
                        written[(r, ek)] += nb
                if group_pieces and broadcast == "collective":
                    bcasts[(lv, s, tuple(remote))].append(group_pieces)
                elif group_pieces:  # a ring from the root through the receivers, in rank order after it
                    ring = tuple(sorted(remote, key=lambda x: (x - s) % len(gpus)))
                    chains[(lv, s, ring)].append(group_pieces)

    # destination coverage: every shard not kept is written exactly once
    for r, specs in dst.items():
        for spec in specs:
            if (r, spec.key) in kept:
                continue
            if written[(r, spec.key)] != spec.nbytes:
                raise _error(f"lower-collectives: rank {r} receives {written[(r, spec.key)]:,} of the {spec.nbytes:,} "
                             f"bytes of {spec.key} {list(spec.box)}: the transition does not deliver it exactly once")

    # pipelined chains: the payload of each (root, ring) in chunks; chunk c crosses hop h in
    # sub-round c + h, so every link of the ring is busy at once and each rank sends to one
    # neighbour (a chunked ring broadcast made of point-to-point messages)
    for (lv, s, ring), entries in chains.items():
        done = 0
        for e in entries:
            c = done // chunk_bytes
            done += next(iter(e.values())).nbytes
            for h, r in enumerate(ring):
                if h == 0:
                    pending[(lv, c, s, r)].append(e[r])
                else:
                    prev = e[ring[h - 1]]
                    pending[(lv, c + h, ring[h - 1], r)].append(Piece(prev.dst, e[r].dst, prev.box, prev.nbytes, arrived=True))

    ids = iter(range(1 << 62))
    rounds: dict[tuple[int, int, int], tuple[list[Message], list[Message]]] = defaultdict(lambda: ([], []))
    for (lv, sub, s, r), pieces in sorted(pending.items()):
        direct, packed = [], []
        for p in pieces:
            held = (dst_box if p.arrived else src_box)[(s, p.src)].box
            # one side contiguous is enough: the sender sends its slice as is, or the receiver
            # receives into its slice as is; only the strided side copies
            ok = p.nbytes >= direct_bytes and (contiguous(held, p.box) or p.staged or contiguous(dst_box[(r, p.dst)].box, p.box))
            (direct if ok else packed).append(p)
        msgs = [Message(next(ids), s, r, (p,), True) for p in direct]
        bucket: list[Piece] = []
        for p in packed:
            if bucket and sum(x.nbytes for x in bucket) + p.nbytes > bucket_bytes:
                msgs.append(Message(next(ids), s, r, tuple(bucket), False))
                bucket = []
            bucket.append(p)
        if bucket:
            msgs.append(Message(next(ids), s, r, tuple(bucket), False))
        rounds[(s, lv, sub)][0].extend(msgs)
        rounds[(r, lv, sub)][1].extend(msgs)
    round_no = {k: i for i, k in enumerate(sorted({(lv, sub) for (_, lv, sub) in rounds}))}

    groups: list[tuple[int, ...]] = []
    bsteps: dict[tuple[int, int], list[Step]] = defaultdict(list)
    for (lv, s, remote), entries in sorted(bcasts.items()):
        members = tuple(sorted((s, *remote)))
        if members not in groups:
            groups.append(members)
        mid = next(ids)
        for member in (s, *remote):  # the same boxes in the same order on every member; dst keys are its own
            if member == s:
                mine = tuple(Piece(p.src, p.src, p.box, p.nbytes) for p in (next(iter(e.values())) for e in entries))
            else:
                mine = tuple(e[member] for e in entries)
            bsteps[(member, lv)].append(Step("broadcast", group=(s, *remote), round=lv,
                                             message=Message(mid, s, -1, mine, False)))

    prog = Program(transition=transition, source=t.source, target=t.target, gpus=gpus, src=src, dst=dst,
                   groups=groups, bucket_bytes=bucket_bytes)
    for r in range(len(gpus)):
        steps: list[Step] = []
        alloc = tuple(s.key for s in dst[r] if (r, s.key) not in kept and s.key not in late[r])
        keep = tuple(s.key for s in dst[r] if (r, s.key) in kept)
        if keep:
            steps.append(Step("keep", keys=keep))
        if alloc:
            steps.append(Step("alloc", keys=alloc))
        for lv in range(n_levels):
            steps += before.get((r, lv), [])
            for (level, sub), no in round_no.items():
                sends, recvs = rounds.get((r, level, sub), ([], []))
                if level == lv and (sends or recvs):
                    steps.append(Step("round", sends=tuple(sorted(sends, key=lambda x: x.id)),
                                      recvs=tuple(sorted(recvs, key=lambda x: x.id)), round=no))
            steps += bsteps.get((r, lv), [])
            steps += after.get((r, lv), [])
        if releases.get(r):
            steps.append(Step("release", keys=tuple(dict.fromkeys(releases[r]))))
        if offloads.get(r):
            steps.append(Step("offload", keys=tuple(dict.fromkeys(offloads[r]))))
        prog.steps[r] = steps
    _check_slices(prog)
    return prog


def _inside(box, outer) -> bool:
    return all(outer_lo <= lo and hi <= outer_hi for (lo, hi), (outer_lo, outer_hi) in zip(box, outer))


def _check_slices(prog: Program) -> None:
    """Every piece reads inside a shard the rank holds and writes inside one it will hold; an
    unstage reads a staging buffer that an earlier step of the rank wrote."""
    for r, steps in prog.steps.items():
        src = {s.key: s.box for s in prog.src.get(r, [])}
        dst = {s.key: s.box for s in prog.dst.get(r, [])}
        staged: set[tuple] = set()
        for step in steps:
            if step.kind == "unstage" and (step.piece.src, step.piece.box) not in staged:
                raise _error(f"lower-collectives: rank {r} unstages {step.piece.src} {list(step.piece.box)} before it is staged")
            reads = [step.piece] if step.kind == "copy" else [p for m in step.sends for p in m.pieces]
            writes = [step.piece] if step.kind in ("copy", "unstage") else [p for m in step.recvs for p in m.pieces]
            if step.kind == "broadcast":
                (reads if step.group[0] == r else writes).extend(step.message.pieces)
            for p in reads:
                held = (dst if p.arrived else src).get(p.src)
                if held is None or not _inside(p.box, held):
                    raise _error(f"lower-collectives: rank {r} reads {p.src} {list(p.box)}, which it does not hold")
            for p in writes:
                if p.staged and step.kind != "unstage":
                    staged.add((p.dst, p.box))
                if p.dst not in dst or not _inside(p.box, dst[p.dst]):
                    raise _error(f"lower-collectives: rank {r} writes {p.dst} {list(p.box)} outside its shard")


def pick_transition(module: Module, name: str = "") -> str:
    name = name.lstrip("@")
    if not name:
        if len(module.transitions) != 1:
            raise _error(f"lowering needs one transition: the module has {len(module.transitions)}",
                         "name one (transition=@name), or plan one first: -p plan-transition{to=@b},schedule-transfers",
                         module.filename)
        return next(iter(module.transitions))
    if name not in module.transitions:
        raise _error(f"lowering: no transition @{name}", did_you_mean(name, module.transitions), module.filename)
    return name


