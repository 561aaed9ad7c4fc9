"""The peers of ``nereus bench reshard``: how RL frameworks move training state to a new layout today.

Both peers run on every rank of an initialised default process group, take this rank's source
shards (``src``, keyed as in ``plan_layout(module, "a")``) and both layouts, and return this
rank's destination shards (every spec of ``dst_layout[rank]``, contiguous, bit-identical to
``cut(full, box)``) with the number of bytes this rank sent over the process group.

- ``allgather_slice`` is verl's resharding of training weights: every rank all-gathers the source
  shards of every tensor, assembles the full tensors it needs and slices its plan-B box out.
- ``gather_broadcast`` is OpenRLHF's weight sync: rank 0 collects the full tensors, broadcasts
  them to every rank, and every rank slices its box out.
- ``holder_broadcast`` is the broadcast of whole experts (slime's and NeMo-RL's expert sync):
  each distinct source box broadcast to every rank by one of its holders.

Both batch tensors into flat ``uint8`` buckets of at most ``bucket_bytes`` of full tensors (as
verl and NeMo-RL bucket their weight sync) instead of one collective per tensor, and reuse the
bucket buffers; uint8 moves bf16 and fp32 alike, exactly. Every distinct source box is sent by
one of its holders only, so DP replicas do not send twice. Both use gloo on CPU tensors.

Bytes sent are counted as gloo's algorithms send them (``gloo/allgather.cc``: a ring, each rank
sends ``world - 1`` chunks; ``gloo/broadcast.cc``: a binomial tree from the root; send/recv:
the payload), padding included; the tests check the counts against the bytes each process
writes to its sockets (``/proc/self/io``). Message headers are not counted. Collectives are
bounded by the process group's timeout, point-to-point waits by ``timeout``.

``p2p_floor`` is not a peer but the floor the executor is held to: an unchecked, minimal
point-to-point exchange of the same bytes, written independently of Nereus's planner and
lowering (no checksums, no program digest, no commit agreement, no rollback).

``ring_bandwidth`` measures what a rank can receive per second while every rank sends to its
neighbour: the denominator of the lower bound ``bytes a rank must receive / bandwidth``.
"""

from __future__ import annotations

import datetime
import math
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...runtime.state import LocalState, ShardSpec, StateKey, cut, torch_dtype

# Measured with 4 gloo ranks on 2 cores (default-size cases): 16-32 MB buckets are fastest for both
# peers; one collective per tensor is 1.2-3x slower, 256 MB buckets up to 2x slower.
BUCKET_BYTES = 32 << 20
DIRECT_BYTES = 64 << 10  # the floor sends a contiguous slice as its own message from this size; smaller ones are packed
_ALIGN = 16  # every piece starts 16-byte aligned, so a uint8 slice views as any dtype

# torch 2.13 names the equal-chunk all-gather all_gather_single (all_gather_into_tensor is deprecated)
_all_gather_equal = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

Layout = dict[int, list[ShardSpec]]
Sources = dict[StateKey, dict[tuple, tuple[ShardSpec, list[int]]]]  # key -> box -> (spec, holders)


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _span(specs: list[ShardSpec]) -> int:
    return sum(_padded(s.nbytes) for s in specs)


def _whole(spec: ShardSpec) -> ShardSpec:
    """The spec of the full tensor."""
    return ShardSpec(spec.key, spec.shape, tuple((0, n) for n in spec.shape), spec.dtype)


def _plan(src_layout: Layout, dst_layout: Layout, bucket_bytes: int) -> tuple[Sources, list[list[StateKey]]]:
    """The distinct source boxes of every tensor and their holders; the tensors some rank needs in
    plan B, in buckets of at most ``bucket_bytes`` of full tensors (a larger tensor goes alone).
    Every rank computes the same plan from the same layouts."""
    sources: Sources = defaultdict(dict)
    for gpu in sorted(src_layout):
        for s in src_layout[gpu]:
            sources[s.key].setdefault(s.box, (s, []))[1].append(gpu)
    needed = sorted({s.key for specs in dst_layout.values() for s in specs})
    groups: dict[tuple[int, ...], list[StateKey]] = defaultdict(list)  # tensors by the ranks that hold them
    full: dict[StateKey, int] = {}  # bytes of the full tensor
    for key in needed:
        if key not in sources:
            raise ValueError(f"{key} is in plan B but no rank holds it in plan A")
        specs = [s for s, _ in sources[key].values()]
        if sum(s.numel for s in specs) != math.prod(specs[0].shape):
            raise ValueError(f"the distinct source boxes of {key} do not tile the tensor")
        full[key] = _whole(specs[0]).nbytes
        groups[tuple(sorted({h for _, hs in sources[key].values() for h in hs}))].append(key)
    # Interleave the groups in proportion to their bytes (PP stages, say), so that every bucket has
    # senders on every group's ranks: an equal-chunk all-gather pads the ranks with nothing to send.
    place: dict[StateKey, tuple] = {}
    for holders, keys in groups.items():
        total, done = sum(full[k] for k in keys), 0
        for k in keys:
            place[k] = (done / max(total, 1), holders, k)
            done += full[k]
    buckets: list[list[StateKey]] = []
    size = 0
    for key in sorted(needed, key=place.__getitem__):
        if not buckets or size + full[key] > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(key)
        size += full[key]
    return sources, buckets


def _senders(sources: Sources, bucket: list[StateKey], world: int, prefer: int | None = None) -> list[list[ShardSpec]]:
    """Rank -> the distinct boxes of ``bucket`` it sends: one holder per box, ``prefer`` when it holds
    the box, else the holder with the fewest bytes so far (largest boxes first)."""
    load = [0] * world
    out: list[list[ShardSpec]] = [[] for _ in range(world)]
    boxes = sorted((v for k in bucket for v in sources[k].values()), key=lambda v: (-v[0].nbytes, v[0].key, v[0].box))
    for spec, holders in boxes:
        r = prefer if prefer in holders else min(holders, key=lambda h: (load[h], h))
        load[r] += spec.nbytes
        out[r].append(spec)
    return out


def _pack(src: LocalState, specs: list[ShardSpec], buf: torch.Tensor) -> torch.Tensor:
    """This rank's shards ``specs`` packed into the uint8 ``buf`` (the padding is never read)."""
    off = 0
    for s in specs:
        buf[off : off + s.nbytes].copy_(src[s.key].reshape(-1).view(torch.uint8))
        off += _padded(s.nbytes)
    return buf


def _unpack(buf: torch.Tensor, specs: list[ShardSpec]) -> Iterator[tuple[ShardSpec, torch.Tensor]]:
    """The shards packed by ``_pack``, as views of ``buf`` in their dtype and local shape."""
    off = 0
    for s in specs:
        yield s, buf[off : off + s.nbytes].view(torch_dtype(s.dtype)).view(s.local_shape)
        off += _padded(s.nbytes)


def _exchange(ops: list[dist.P2POp], timeout: float) -> None:
    if ops:  # batch_isend_irecv([]) raises
        for work in dist.batch_isend_irecv(ops):
            work.wait(timeout=datetime.timedelta(seconds=timeout))


def _tree_sends(rank: int, world: int, root: int = 0) -> int:
    """How many times ``rank`` sends the buffer in gloo's binomial-tree broadcast (gloo/broadcast.cc)."""
    vrank, dim, sends = (rank - root) % world, (world - 1).bit_length(), 0
    mask = (1 << dim) - 1
    for i in range(dim):
        mask ^= 1 << i
        if vrank & mask == 0 and vrank & (1 << i) == 0 and vrank ^ (1 << i) < world:
            sends += 1
    return sends


def allgather_slice(
    src: LocalState, src_layout: Layout, dst_layout: Layout, rank: int, world: int, *, bucket_bytes: int = BUCKET_BYTES
) -> tuple[LocalState, int]:
    """verl: all-gather every tensor's source shards, assemble the full tensors, slice plan B's box.

    Per bucket, each rank packs the distinct boxes it is chosen to send (holders balanced by bytes)
    and all ranks run one ``all_gather_single`` into one buffer (gloo's all-gather needs equal
    chunks, so every chunk is padded to the largest). A rank assembles only the tensors it needs.
    Bytes sent: ``(world - 1) x chunk`` per bucket (gloo's ring), padding included.
    """
    sources, buckets = _plan(src_layout, dst_layout, bucket_bytes)
    mine = {s.key: s for s in dst_layout.get(rank, [])}
    steps = []  # (bucket, senders, chunk)
    for bucket in buckets:
        senders = _senders(sources, bucket, world)
        steps.append((bucket, senders, max(map(_span, senders))))
    most = max((chunk for *_, chunk in steps), default=0)  # buffers are reused: no page faults per bucket
    packed, gathered = torch.empty(most, dtype=torch.uint8), torch.empty(world * most, dtype=torch.uint8)
    out: LocalState = {}
    sent = 0
    for bucket, senders, chunk in steps:
        _all_gather_equal(gathered[: world * chunk], _pack(src, senders[rank], packed[:chunk]))
        sent += (world - 1) * chunk
        fulls = {k: torch.empty(mine[k].shape, dtype=torch_dtype(mine[k].dtype)) for k in bucket if k in mine}
        for r, specs in enumerate(senders):
            for s, t in _unpack(gathered[r * chunk : (r + 1) * chunk], specs):
                if s.key in fulls:
                    cut(fulls[s.key], s.box).copy_(t)
        for key, full in fulls.items():
            out[key] = cut(full, mine[key].box).contiguous()
    return out, sent


def gather_broadcast(
    src: LocalState,
    src_layout: Layout,
    dst_layout: Layout,
    rank: int,
    world: int,
    *,
    bucket_bytes: int = BUCKET_BYTES,
    timeout: float = 300.0,
) -> tuple[LocalState, int]:
    """OpenRLHF: rank 0 collects the full tensors, broadcasts them to every rank, which slice their box.

    Per bucket, every holder chosen for a distinct box rank 0 lacks sends its packed boxes to rank 0
    (point to point, exact sizes); rank 0 assembles the bucket's full tensors into one flat buffer
    and broadcasts it to the whole group (ranks that need nothing of it receive it too, as every
    inference engine does); every rank copies its boxes out. Bytes sent: a holder's packed payload,
    plus the bucket times the sends of this rank in gloo's binomial-tree broadcast (rank 0 sends
    it ``ceil(log2 world)`` times; all ranks together ``world - 1`` times).
    """
    sources, buckets = _plan(src_layout, dst_layout, bucket_bytes)
    mine = {s.key: s for s in dst_layout.get(rank, [])}
    steps = [
        (
            bucket,
            _senders(sources, bucket, world, prefer=0),
            [_whole(next(iter(sources[k].values()))[0]) for k in bucket],
        )
        for bucket in buckets
    ]
    # buffers are reused from bucket to bucket: no page faults per bucket
    flat = torch.empty(max((_span(wholes) for *_, wholes in steps), default=0), dtype=torch.uint8)
    # rank 0 receives the holders' boxes into the staging buffer; a holder packs its boxes into it
    staged = [sum(map(_span, senders[1:])) if rank == 0 else _span(senders[rank]) for _, senders, _ in steps]
    staging = torch.empty(max(staged, default=0), dtype=torch.uint8)
    out: LocalState = {}
    sent = 0
    for bucket, senders, wholes in steps:
        ops, boxes, off = [], [], 0
        if rank == 0:  # one receive per holder, into consecutive slices of the staging buffer
            for r in range(1, world):
                if senders[r]:
                    ops.append(dist.P2POp(dist.irecv, staging[off : off + _span(senders[r])], r))
                    boxes += _unpack(staging[off : off + _span(senders[r])], senders[r])
                    off += _span(senders[r])
        elif senders[rank]:
            ops.append(dist.P2POp(dist.isend, _pack(src, senders[rank], staging[: _span(senders[rank])]), 0))
            sent += _span(senders[rank])
        _exchange(ops, timeout)

        bucket_flat = flat[: _span(wholes)]
        fulls = {s.key: t for s, t in _unpack(bucket_flat, wholes)}
        if rank == 0:
            for s, t in [(s, src[s.key]) for s in senders[0]] + boxes:
                cut(fulls[s.key], s.box).copy_(t)
        dist.broadcast(bucket_flat, src=0)
        sent += _tree_sends(rank, world) * bucket_flat.numel()
        for k in bucket:
            if k in mine:
                out[k] = cut(fulls[k], mine[k].box).clone(memory_format=torch.contiguous_format)
    return out, sent


def holder_broadcast(
    src: LocalState, src_layout: Layout, dst_layout: Layout, rank: int, world: int, *, bucket_bytes: int = BUCKET_BYTES
) -> tuple[LocalState, int]:
    """Broadcast of whole experts (slime's and NeMo-RL's expert sync, generalised): per bucket, every
    holder chosen for a distinct source box broadcasts its packed boxes to the whole group (gloo's
    binomial tree rooted at it), and every rank assembles the tensors it needs and slices its box.
    A tensor held whole under plan A (an expert under expert parallelism, a replicated norm) goes
    out whole from one holder; TP shards go out from each of their holders. No gather to one rank
    first, and no rank sends what another already sends. Bytes sent: each broadcast's buffer
    times this rank's sends in the tree rooted at its holder."""
    sources, buckets = _plan(src_layout, dst_layout, bucket_bytes)
    mine = {s.key: s for s in dst_layout.get(rank, [])}
    steps = [(bucket, _senders(sources, bucket, world)) for bucket in buckets]
    flat = torch.empty(max((_span(sp) for _, senders in steps for sp in senders), default=0), dtype=torch.uint8)
    out: LocalState = {}
    sent = 0
    for bucket, senders in steps:
        fulls = {k: torch.empty(mine[k].shape, dtype=torch_dtype(mine[k].dtype)) for k in bucket if k in mine}
        for root, specs in enumerate(senders):
            if not specs:
                continue
            buf = flat[: _span(specs)]
            if rank == root:
                _pack(src, specs, buf)
            dist.broadcast(buf, src=root)
            sent += _tree_sends(rank, world, root) * buf.numel()
            for s, t in _unpack(buf, specs):
                if s.key in fulls:
                    cut(fulls[s.key], s.box).copy_(t)
        for key, full in fulls.items():
            out[key] = cut(full, mine[key].box).contiguous()
    return out, sent


def _intersect(a: tuple, b: tuple) -> tuple | None:
    box = tuple((max(lo, lo2), min(hi, hi2)) for (lo, hi), (lo2, hi2) in zip(a, b))
    return box if all(lo < hi for lo, hi in box) else None


def _view(t: torch.Tensor, spec: ShardSpec, box: tuple) -> torch.Tensor:
    """The part ``box`` (global coordinates) of a shard ``t`` laid out as ``spec``."""
    return t[tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(box, spec.box))]


def _contiguous(spec: ShardSpec, box: tuple) -> bool:
    """Whether ``box`` is one contiguous run of a C-ordered shard ``spec``: after its leading
    size-1 dimensions, one partial dimension, then whole ones."""
    dims = [(hi - lo, shi - slo) for (lo, hi), (slo, shi) in zip(box, spec.box)]
    while dims and dims[0][0] == 1:
        dims.pop(0)
    return all(n == full for n, full in dims[1:])


@dataclass(frozen=True)
class FloorPlan:
    """What ``p2p_floor`` does on one rank, worked out once (as Nereus plans and lowers once)."""

    out: tuple  # (dst spec, ...) of this rank
    local: tuple  # (src spec, dst spec, box): copies of bytes this rank already holds
    messages: tuple  # (peer, send?, pieces ((src spec, dst spec, box, nbytes), ...), packed?) in posting order


def p2p_floor_plan(src_layout: Layout, dst_layout: Layout, rank: int, world: int) -> FloorPlan:
    """The minimal exchange: every byte a rank lacks under plan B is received once, from one holder
    (the holder with the fewest bytes assigned so far); bytes a rank holds are copied locally; per
    (sender, receiver), a contiguous slice of at least ``DIRECT_BYTES`` on both sides travels as
    is, the rest in one packed buffer. Every rank computes the same assignment."""
    holders: dict[StateKey, dict[tuple, dict[int, ShardSpec]]] = defaultdict(dict)
    for gpu in sorted(src_layout):
        for s in src_layout[gpu]:
            holders[s.key].setdefault(s.box, {})[gpu] = s
    load = [0] * world
    pairs: dict[tuple[int, int], list[tuple]] = defaultdict(list)
    for r in sorted(dst_layout):
        for d in dst_layout[r]:
            for box, held in holders[d.key].items():
                part = _intersect(box, d.box)
                if part is None:
                    continue
                nbytes = math.prod(hi - lo for lo, hi in part) * torch_dtype(d.dtype).itemsize
                sender = r if r in held else min(held, key=lambda g: (load[g], g))
                if sender != r:
                    load[sender] += nbytes
                pairs[(sender, r)].append((held[sender], d, part, nbytes))
    local, messages = [], []
    for (snd, rcv), pieces in sorted(pairs.items()):
        if snd == rcv == rank:
            local += [(s, d, part) for s, d, part, _ in pieces]
        elif rank in (snd, rcv) and snd != rcv:
            peer, send = (rcv, True) if rank == snd else (snd, False)
            direct = [p for p in pieces if p[3] >= DIRECT_BYTES and _contiguous(p[0], p[2]) and _contiguous(p[1], p[2])]
            messages += [(peer, send, (p,), False) for p in direct]
            rest = tuple(p for p in pieces if p not in direct)
            if rest:
                messages.append((peer, send, rest, True))
    return FloorPlan(out=tuple(dst_layout.get(rank, [])), local=tuple(local), messages=tuple(messages))


def p2p_floor(src: LocalState, plan: FloorPlan, *, timeout: float = 300.0) -> tuple[LocalState, int]:
    """Run ``plan`` on this rank: every message posted at once, no checksum, digest, agreement or
    rollback. Returns this rank's plan-B shards and the bytes it sent."""
    out = {d.key: torch.empty(d.local_shape, dtype=torch_dtype(d.dtype)) for d in plan.out}
    for s, d, part in plan.local:
        _view(out[d.key], d, part).copy_(_view(src[s.key], s, part))
    ops, unpack, sent = [], [], 0
    for peer, send, pieces, packed in plan.messages:
        if not packed:
            s, d, part, nbytes = pieces[0]
            t = _view(src[s.key], s, part) if send else _view(out[d.key], d, part)
            ops.append(dist.P2POp(dist.isend if send else dist.irecv, t.reshape(-1).view(torch.uint8), peer))
            sent += nbytes if send else 0
            continue
        buf = torch.empty(sum(_padded(p[3]) for p in pieces), dtype=torch.uint8)
        off = 0
        for s, d, part, nbytes in pieces:
            if send:
                v = _view(src[s.key], s, part)
                buf[off : off + nbytes].view(v.dtype).view(v.shape).copy_(v)
            else:
                unpack.append((buf[off : off + nbytes], _view(out[d.key], d, part)))
            off += _padded(nbytes)
        ops.append(dist.P2POp(dist.isend if send else dist.irecv, buf, peer))
        sent += buf.numel() if send else 0
    _exchange(ops, timeout)
    for flat, dst in unpack:
        dst.copy_(flat.view(dst.dtype).view(dst.shape))
    return out, sent


def ring_bandwidth(nbytes: int, rank: int, world: int, repeats: int = 3, *, timeout: float = 300.0) -> float:
    """Bytes per second a rank receives while every rank sends ``nbytes`` to rank + 1 and receives
    from rank - 1 at once (one ``batch_isend_irecv``); per repeat the slowest rank's time, best of
    ``repeats``, so every rank returns the same number. ``inf`` on one rank (nothing to move)."""
    if nbytes <= 0 or repeats <= 0:
        raise ValueError("ring_bandwidth needs nbytes > 0 and repeats > 0")
    if world == 1:
        return math.inf
    send, recv = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    best = math.inf
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        _exchange(
            [dist.P2POp(dist.isend, send, (rank + 1) % world), dist.P2POp(dist.irecv, recv, (rank - 1) % world)],
            timeout,
        )
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        best = min(best, elapsed.item())
    return nbytes / best
