"""Run a collective program on this rank's live state: plan A's shards in, plan B's shards out.

``execute(program, state)`` runs inside an initialised default process group (``init_from_env``:
gloo on CPU, NCCL with tensors on the GPU) on every rank of ``program.world``. It never changes
``state``: destination shards are new tensors (or the very source tensor, where a shard stays in
place), and the source shards are dropped only at commit. Commit happens when every rank has
received every message and every message's checksum matched; the ranks agree on that with one
point-to-point hop to every peer (an all-gather on NCCL). Any failure (an exception, a timeout, a peer that died, a
corrupted message) makes
every surviving rank raise ``TransitionError`` with its plan-A ``state`` untouched. A process
group that saw a failure should be re-created before the next collective, as torchelastic does.

Messages are raw bytes: a slice that is contiguous on both sides is sent from and received into
the shard itself; the others are packed into buckets (8-byte aligned offsets). A slice the
program stages lands in a host-memory buffer (pinned on CUDA) and an ``unstage`` step copies it
into its shard, which is allocated at that first write. Plan A's shards stay on the device until
commit (they are the rollback state, and the caller's ``state`` holds them), so on this executor
staging bounds the destination's allocations, not the source's. A checksum (the
wrapping sum of the payload's 32-bit words, or bytes for odd sizes) travels with every round.
"""

from __future__ import annotations

import datetime
import os
import signal
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..backend.program import Message, Piece, Program, Step
from ..ir.diagnostics import plural
from .private_group import is_private
from .state import LocalState, ShardSpec, StateKey, torch_dtype

# torch 2.13 names the equal-chunk all-gather all_gather_single (all_gather_into_tensor is deprecated)
_all_gather_equal = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TransitionError(RuntimeError):
    """A transition failed on some rank; this rank's plan-A state is intact.

    Fields: ``rank`` (this rank), ``failed_ranks`` (the ranks that reported a failure in the
    commit agreement; empty when the agreement itself failed, e.g. a peer died or hung, and then
    ``unresponsive`` is true), ``reason`` (this rank's own error, or why it gave up) and
    ``state_intact`` (plan A's state on this rank is untouched: always true when ``execute``
    raises; false only if a caller constructs it so).
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        failed_ranks: tuple[int, ...] = (),
        unresponsive: bool = False,
        reason: str = "",
        state_intact: bool = True,
    ):
        super().__init__(message)
        self.rank, self.failed_ranks, self.unresponsive = rank, tuple(failed_ranks), unresponsive
        self.reason, self.state_intact = reason or message, state_intact


@dataclass(frozen=True)
class Fault:
    """An injected fault (for tests): at the start of ``round`` on ``rank``, ``raise`` an
    exception, ``exit`` the process, ``kill`` it (SIGKILL: a node lost without a word) or
    ``corrupt`` one byte of the first message it sends."""

    kind: str
    rank: int
    round: int = 0


@dataclass
class Stats:
    sent: int = 0  # payload bytes this rank sent
    received: int = 0
    messages: int = 0
    packed: int = 0  # bytes copied into send buffers and out of receive buffers (pack, unpack)
    hashed: int = 0  # bytes checksummed (each payload sent once, each message received)
    lazy: bool = False  # destination shards allocated at their first write, not up front
    seconds: dict[str, float] = field(default_factory=dict)


def _region(spec: ShardSpec, box) -> tuple[slice, ...]:
    return tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(box, spec.box))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as a flat uint8 view (exact for every dtype)."""
    return t.reshape(-1).view(torch.uint8)


def checksum(buf: torch.Tensor) -> torch.Tensor:
    """Wrapping int64 sum of a uint8 buffer's 8-byte words, plus its trailing bytes: a function
    of the bytes alone (sender and receiver agree whatever their buffers' alignment), and it
    runs at memory speed (an int32 -> int64 widening sum is 20x slower here)."""
    n8 = buf.numel() // 8 * 8
    head = buf[:n8]
    if head.data_ptr() % 8:
        head = head.clone()  # a view at an odd offset: aligned copy
    total = head.view(torch.int64).sum()
    if n8 < buf.numel():
        total = total + buf[n8:].to(torch.int64).sum()
    return total.reshape(1)


def _bucket_layout(pieces: tuple[Piece, ...]) -> tuple[list[int], int]:
    """8-byte aligned offsets of the pieces in a bucket, and its size."""
    offs, n = [], 0
    for p in pieces:
        offs.append(n)
        n += (p.nbytes + 7) // 8 * 8
    return offs, n


class _Rank:
    def __init__(
        self,
        prog: Program,
        rank: int,
        state: LocalState,
        device,
        timeout: float,
        faults,
        stats: Stats,
        memory_limit: int | None = None,
        out: LocalState | None = None,
        ready=None,
    ):
        self.prog, self.rank, self.device, self.stats = prog, rank, device, stats
        self.ready = ready  # called with each destination shard as its last write lands (``execute``)
        self.memory_limit = memory_limit
        self.timeout = datetime.timedelta(seconds=timeout)
        self.faults = [f for f in faults if f.rank == rank]
        self.src_spec = {s.key: s for s in prog.src.get(rank, [])}
        self.dst_spec = {s.key: s for s in prog.dst.get(rank, [])}
        self.src: dict[StateKey, torch.Tensor] = {}
        for k, spec in self.src_spec.items():
            t = state.get(k)
            if t is None:
                raise TransitionError(f"rank {rank}: the state has no {k}, which plan @{prog.source} puts here")
            if tuple(t.shape) != spec.local_shape or t.dtype != torch_dtype(spec.dtype):
                raise TransitionError(
                    f"rank {rank}: {k} is {tuple(t.shape)} {t.dtype}, the program expects "
                    f"{spec.local_shape} {spec.dtype}"
                )
            self.src[k] = t
        self.out = _check_out(out or {}, self.dst_spec, self.src, rank, device)
        self.new: dict[StateKey, torch.Tensor] = {}
        self.staging: dict[tuple, torch.Tensor] = {}  # (key, box) -> host buffer of a staged slice
        # id(piece) -> (source index, destination index): kept with the program (pieces live as long as it)
        self.regions: dict[int, tuple] = prog.__dict__.setdefault("_regions", {}).setdefault(rank, {})
        self.groups: dict[tuple[int, ...], object] = {}
        self.group = None  # the process group the program's ranks are ranks of (None: the default group)
        self.digest: tuple | None = None  # the digest all-gather in flight (``_post_digest``)
        if ready is not None:  # writes still to come into each destination shard
            # id(step) -> the shards it writes, kept with the program as ``regions`` is (a push
            # runs one program every RL step)
            cache = prog.__dict__.setdefault("_writes", {})
            if rank not in cache:
                cache[rank] = {id(s): _writes(s, rank) for s in prog.steps.get(rank, [])}
            self.writes: dict[int, list[StateKey]] = cache[rank]
            self.left = Counter(k for ks in self.writes.values() for k in ks)

    # -- slices --------------------------------------------------------------------------------
    def slices(self, p: Piece) -> tuple:
        """(where ``p`` is read in its source tensor, where it is written in its destination
        shard): index tuples, worked out once per program and rank."""
        sl = self.regions.get(id(p))
        if sl is None:
            src = self.dst_spec if p.arrived else self.src_spec
            sl = self.regions[id(p)] = (
                _region(src[p.src], p.box) if p.src in src else None,
                _region(self.dst_spec[p.dst], p.box) if p.dst in self.dst_spec else None,
            )
        return sl

    def layout(self, msg: Message) -> tuple[list[int], int]:
        """``_bucket_layout`` of a message, worked out once per program and rank."""
        lay = self.regions.get(id(msg))
        if lay is None:
            lay = self.regions[id(msg)] = _bucket_layout(msg.pieces)
        return lay

    def read(self, p: Piece) -> torch.Tensor:
        return (self.new if p.arrived else self.src)[p.src][self.slices(p)[0]]

    def fresh(self, key: StateKey) -> torch.Tensor:
        """A destination shard to fill: the caller's buffer from ``out``, or a new tensor."""
        if key in self.out:
            return self.out[key]
        spec = self.dst_spec[key]
        return torch.empty(spec.local_shape, dtype=torch_dtype(spec.dtype), device=self.device)

    def land(self, p: Piece) -> torch.Tensor:
        """Where piece ``p`` is written: its destination shard's box, or a host staging buffer."""
        if not p.staged:
            if p.dst not in self.new:  # lazy allocation: the first write
                self.new[p.dst] = self.fresh(p.dst)
            return self.new[p.dst][self.slices(p)[1]]
        spec = self.dst_spec[p.dst]
        buf = torch.empty(
            [hi - lo for lo, hi in p.box],
            dtype=torch_dtype(spec.dtype),
            device="cpu",
            pin_memory=self.device.type == "cuda",
        )
        self.staging[(p.dst, p.box)] = buf
        return buf

    def write(self, key: StateKey, box) -> torch.Tensor:
        if key not in self.new:  # lazy allocation: the first write
            self.new[key] = self.fresh(key)
        return self.new[key][_region(self.dst_spec[key], box)]

    def _fault(self, rnd: int) -> Fault | None:
        f = next((f for f in self.faults if f.round == rnd), None)
        if f is not None and f.kind == "raise":
            raise RuntimeError(f"injected fault on rank {self.rank} in round {rnd}")
        if f is not None and f.kind == "exit":
            os._exit(17)
        if f is not None and f.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        return f

    # -- steps ---------------------------------------------------------------------------------
    def run(self, step: Step) -> None:
        if step.kind == "keep":
            for k in step.keys:
                self.new[k] = self.out[k].copy_(self.src[k]) if k in self.out else self.src[k]
        elif step.kind == "alloc":
            held = sum(t.numel() * t.element_size() for t in self.src.values())
            new = sum(self.dst_spec[k].nbytes for k in step.keys if k not in self.out)
            if self.memory_limit is not None and held + new > self.memory_limit:
                self.stats.lazy = True  # no room for all of plan B beside plan A: allocate in the graph's order
                return
            for k in step.keys:
                self.new[k] = self.fresh(k)
        elif step.kind == "load":  # a source shard offloaded to host memory comes back to the device
            for k in step.keys:
                self.src[k] = self.src[k].to(self.device, non_blocking=False)
        elif step.kind == "copy":
            self.land(step.piece).copy_(self.read(step.piece))
        elif step.kind == "unstage":  # a staged slice, from its host buffer into the destination shard
            p = step.piece
            self.write(p.dst, p.box).copy_(self.staging[(p.src, p.box)], non_blocking=False)
        elif step.kind == "round":
            self.exchange(step)
        elif step.kind == "broadcast":
            self.broadcast(step)
        # release and offload happen at commit

    def payload(self, msg: Message) -> torch.Tensor:
        """The bytes to send: a direct piece's slice as is (copied only if strided), or a bucket."""
        if msg.direct:
            src = self.read(msg.pieces[0])
            if src.is_contiguous():
                return _bytes(src)
            self.stats.packed += msg.pieces[0].nbytes
            return _bytes(src.contiguous())
        offs, n = self.layout(msg)
        buf = torch.empty(n, dtype=torch.uint8, device=self.device)
        for p, o in zip(msg.pieces, offs):
            src = self.read(p)
            buf[o : o + p.nbytes].view(src.dtype).view(src.shape).copy_(src)
        self.stats.packed += sum(p.nbytes for p in msg.pieces)
        return buf

    def landing(self, msg: Message) -> torch.Tensor:
        """Where a message is received: a direct piece's destination slice if it is contiguous,
        else a flat buffer that ``unpack`` copies out."""
        if msg.direct:
            dst = self.land(msg.pieces[0])
            if dst.is_contiguous() and dst.device == self.device:  # NCCL receives into device memory only
                return _bytes(dst)
            return torch.empty(msg.pieces[0].nbytes, dtype=torch.uint8, device=self.device)
        return torch.empty(self.layout(msg)[1], dtype=torch.uint8, device=self.device)

    def unpack(self, msg: Message, buf: torch.Tensor) -> None:
        if msg.direct:
            dst = (
                self.land(msg.pieces[0])
                if not msg.pieces[0].staged
                else self.staging[(msg.pieces[0].dst, msg.pieces[0].box)]
            )
            if buf.data_ptr() != dst.data_ptr():  # received beside a strided slice: copy it in
                dst.copy_(buf.view(dst.dtype).view(dst.shape))
                self.stats.packed += msg.pieces[0].nbytes
            return
        for p, o in zip(msg.pieces, self.layout(msg)[0]):
            dst = self.land(p)
            dst.copy_(buf[o : o + p.nbytes].view(dst.dtype).view(dst.shape))
            self.stats.packed += p.nbytes

    def _tick(self, what: str, since: float) -> float:
        now = time.perf_counter()
        self.stats.seconds[what] = self.stats.seconds.get(what, 0.0) + now - since
        return now

    def run_all(self, steps: list[Step]) -> None:
        """The steps in order, except that local copies just before a round run after the
        round's messages are posted (while they are on the wire), unless the round sends a
        slice this transition filled (which a copy might be writing)."""
        pending: list[Step] = []
        for step in steps:
            if step.kind == "copy":
                pending.append(step)
                continue
            if step.kind == "round" and not any(p.arrived for m in step.sends for p in m.pieces):
                self.exchange(step, pending)
            else:
                for c in pending:
                    self.run(c)
                self.run(step)
            self.landed([*pending, step])
            pending = []
        for c in pending:
            self.run(c)
        self.landed(pending)

    def landed(self, steps: list[Step]) -> None:
        """Hand ``ready`` the destination shards whose last write was among ``steps`` (run):
        every byte of them in place, each message checksummed."""
        if self.ready is None:
            return
        done = []
        for s in steps:
            for k in self.writes[id(s)]:
                self.left[k] -= 1
                if not self.left[k]:
                    done.append(k)
        if done:
            self.ready({k: self.new[k] for k in done})

    def exchange(self, step: Step, copies: list[Step] = ()) -> None:
        """One round. Receives are posted first; on gloo each send is posted as soon as its
        payload is packed, so packing overlaps the wire (NCCL gets one batch: a group of p2p
        calls must be issued together); ``copies`` (local copy steps) and the checksums of the
        payloads run while the data is in flight, and every message's checksum is computed as it
        lands. Per peer, messages go in id order on both sides, its checksum vector last."""
        self.check_program()
        fault = self._fault(step.round)
        t = time.perf_counter()
        gloo = _backend(self.group) == "gloo"
        batch: list[dist.P2POp] = []  # NCCL: every op of the round in one batch
        works: list = []

        def post(op, tensor, peer):
            if gloo:
                works.append(_p2p(op, tensor, peer, self.group))
            else:
                batch.append(
                    dist.P2POp(dist.isend if op == "send" else dist.irecv, tensor, group=self.group, group_peer=peer)
                )

        recv_bufs = []
        for msg in step.recvs:
            buf = self.landing(msg)
            recv_bufs.append((msg, buf))
            post("recv", buf, msg.sender)
            self.stats.received += msg.nbytes
        n_recv = len(works)
        expect: dict[int, torch.Tensor] = {}
        for peer, n in sorted(
            Counter(m.sender for m in step.recvs).items()
        ):  # one checksum vector per peer, after its data
            expect[peer] = torch.empty(n, dtype=torch.int64, device=self.device)
            post("recv", expect[peer], peer)
        made: dict[tuple, torch.Tensor] = {}  # one slice list sent to several receivers: pack it once
        sent: list[tuple[int, tuple]] = []
        for msg in step.sends:
            what = tuple((p.src, p.box, p.arrived) for p in msg.pieces)
            if what not in made:
                made[what] = self.payload(msg)
            wire = made[what]
            if fault is not None and fault.kind == "corrupt":
                wire = wire.clone()  # corrupted on the wire (never the source shard itself), checksummed as packed
                wire[0] ^= 0x5A
                fault = None
            sent.append((msg.receiver, what))
            post("send", wire, msg.receiver)
            self.stats.sent += msg.nbytes
        for c in copies:  # local copies, while the messages travel
            self.run(c)
        sums: dict[tuple, torch.Tensor] = {}
        sums_out: dict[int, list[torch.Tensor]] = {}
        for receiver, what in sent:
            if what not in sums:
                sums[what] = checksum(made[what])
                self.stats.hashed += made[what].numel()
            sums_out.setdefault(receiver, []).append(sums[what])
        for peer, vec in sorted(sums_out.items()):
            post("send", torch.cat(vec).to(self.device), peer)
        self.stats.messages += len(step.sends) + len(step.recvs)
        t = self._tick("pack", t)
        if batch:
            works += dist.batch_isend_irecv(batch)
        got: dict[int, list[torch.Tensor]] = {}
        for i, (msg, buf) in enumerate(recv_bufs):  # each message checksummed and unpacked as it lands
            if gloo:
                works[i].wait(self.timeout)
            elif i == 0:
                for w in works:
                    w.wait(self.timeout)
            got.setdefault(msg.sender, []).append(checksum(buf))
            self.stats.hashed += buf.numel()
        for w in works[n_recv:] if gloo else ():
            w.wait(self.timeout)
        t = self._tick("wire", t)
        for peer, vec in expect.items():
            bad = torch.nonzero(torch.cat(got[peer]) != vec).flatten()
            if len(bad):
                msg = [m for m in step.recvs if m.sender == peer][int(bad[0])]
                raise TransitionError(
                    f"rank {self.rank}: message #{msg.id} from rank {peer} arrived corrupted (checksum mismatch)"
                )
        for msg, buf in recv_bufs:
            self.unpack(msg, buf)
        self._tick("unpack", t)

    def check_program(self) -> None:
        """Every rank runs the same program: the digests all-gathered, compared before this rank's
        first message."""
        if self.digest is None:
            return
        works, every = self.digest
        self.digest = None
        for w in works:
            w.wait(self.timeout)
        digests = every.tolist()
        others = [r for r, d in enumerate(digests) if d != digests[self.rank]]
        if others:
            raise TransitionError(
                f"rank {self.rank}: ranks {others} run a different program than this rank's "
                f"(@{self.prog.transition}, digest {digests[self.rank] & 0xFFFFFFFF:08x}); every rank "
                f"must run the same lowered program",
                rank=self.rank,
            )

    def broadcast(self, step: Step) -> None:
        self.check_program()
        self._fault(step.round)
        root, msg = step.group[0], step.message
        members = tuple(sorted(step.group))
        group = self.groups[members]
        if self.rank == root:
            buf = self.payload(msg)
            self.stats.sent += msg.nbytes * (len(members) - 1)
        else:
            buf = torch.empty(_bucket_layout(msg.pieces)[1], dtype=torch.uint8, device=self.device)
            self.stats.received += msg.nbytes
        total = checksum(buf) if self.rank == root else torch.empty(1, dtype=torch.int64, device=self.device)
        self.stats.hashed += buf.numel()  # the root's sum, or the receiver's below
        src = root if self.group is None else dist.get_global_rank(self.group, root)
        for t in (buf, total):
            dist.broadcast(t, src=src, group=group, async_op=True).wait(self.timeout)
        if self.rank != root:
            if not torch.equal(checksum(buf), total):
                raise TransitionError(f"rank {self.rank}: broadcast #{msg.id} from rank {root} arrived corrupted")
            self.unpack(msg, buf)

    def commit(self, restore: bool = False) -> LocalState:
        out: LocalState = {}
        offload = {k for s in self.prog.steps.get(self.rank, []) if s.kind == "offload" for k in s.keys}
        for spec in self.prog.dst.get(self.rank, []):
            if restore and spec.key not in self.new:  # wholly read from the checkpoint by the caller
                self.new[spec.key] = self.fresh(spec.key)
            t = self.new[spec.key]
            out[spec.key] = t.to("cpu") if spec.key in offload else t
        return out


def _writes(step: Step, rank: int) -> list[StateKey]:
    """The destination shards ``step`` writes on ``rank``, once per write (a staged piece is
    written by its ``unstage``)."""
    if step.kind == "keep":
        return list(step.keys)
    if step.kind in ("copy", "unstage"):
        return [] if step.piece.staged and step.kind == "copy" else [step.piece.dst]
    if step.kind == "round":
        return [p.dst for m in step.recvs for p in m.pieces if not p.staged]
    if step.kind == "broadcast" and step.group[0] != rank:
        return [p.dst for p in step.message.pieces if not p.staged]
    return []


def _check_out(
    out: LocalState, dst_spec: dict[StateKey, ShardSpec], src: dict[StateKey, torch.Tensor], rank: int, device
) -> LocalState:
    """The caller's destination buffers, checked: plan-B keys of this rank, right shape, dtype
    and device, contiguous, none sharing storage with another or with a plan-A tensor (that one
    must survive a failure)."""
    storages = [t.untyped_storage().data_ptr() for t in out.values()]
    if len(set(storages)) != len(storages):
        raise TransitionError(f"rank {rank}: two buffers in out share storage")
    for k, t in out.items():
        if t.device != torch.device(device):
            raise TransitionError(f"rank {rank}: out[{k}] is on {t.device}, the transition runs on {device}")
        spec = dst_spec.get(k)
        if spec is None:
            raise TransitionError(f"rank {rank}: out has {k}, which plan B does not put on this rank")
        if tuple(t.shape) != spec.local_shape or t.dtype != torch_dtype(spec.dtype) or not t.is_contiguous():
            raise TransitionError(
                f"rank {rank}: out[{k}] is {tuple(t.shape)} {t.dtype}, the program needs a contiguous "
                f"{spec.local_shape} {spec.dtype}"
            )
        if any(t.untyped_storage().data_ptr() == s.untyped_storage().data_ptr() for s in src.values()):
            raise TransitionError(
                f"rank {rank}: out[{k}] shares storage with plan A's state, which a failure must leave intact"
            )
    return dict(out)


def _backend(group=None) -> str:
    """The backend of ``group`` (None: the default group's)."""
    return group.backend if is_private(group) else dist.get_backend(group)


AGREE_TAG, DIGEST_TAG = 1, 2  # point-to-point tags of the agreement and the digest exchange (data uses 0)


def _p2p(op: str, tensor: torch.Tensor, peer: int, group=None):
    """``isend`` / ``irecv`` to rank ``peer`` of ``group`` (None: the default group)."""
    if is_private(group):
        return (group.isend if op == "send" else group.irecv)(tensor, peer)
    if group is None:
        return (dist.isend if op == "send" else dist.irecv)(tensor, peer)
    if op == "send":
        return dist.isend(tensor, group=group, group_dst=peer)
    return dist.irecv(tensor, group=group, group_src=peer)


def _share(value: int, rank: int, world: int, device, tag: int, group=None) -> tuple[list, torch.Tensor]:
    """Start giving every rank this rank's ``value``: (works to wait for, the tensor of every
    rank's value once they complete). On gloo one point-to-point message to each peer (one hop;
    gloo's ring all-reduce and all-gather take ``2 (world - 1)`` and ``world - 1``); elsewhere
    an all-gather."""
    every = torch.empty(world, dtype=torch.int64, device=device)
    every[rank] = value
    if _backend(group) != "gloo":
        mine = torch.tensor([value], dtype=torch.int64, device=device)
        return [_all_gather_equal(every, mine, group=group, async_op=True)], every
    mine = every[rank : rank + 1].clone()
    if is_private(group):
        works = [group.irecv(every[r : r + 1], r, tag) for r in range(world) if r != rank]
        works += [group.isend(mine, r, tag) for r in range(world) if r != rank]
    elif group is None:
        works = [dist.irecv(every[r : r + 1], r, tag=tag) for r in range(world) if r != rank]
        works += [dist.isend(mine, r, tag=tag) for r in range(world) if r != rank]
    else:
        works = [dist.irecv(every[r : r + 1], group=group, tag=tag, group_src=r) for r in range(world) if r != rank]
        works += [dist.isend(mine, group=group, tag=tag, group_dst=r) for r in range(world) if r != rank]
    return works, every


def _agree(ok: bool, rank: int, world: int, device, timeout: datetime.timedelta, group=None) -> tuple[int, ...] | None:
    """The commit agreement: every rank's flag to every rank. Returns the ranks that failed
    (empty: commit), or None when the agreement itself failed (a dead or hung peer)."""
    try:
        works, flags = _share(1 if ok else 0, rank, world, device, AGREE_TAG, group)
        for w in works:
            w.wait(timeout)
    except Exception:  # noqa: BLE001 - a broken group or a dead peer: no agreement
        return None
    return tuple(int(r) for r in torch.nonzero(flags.cpu() == 0).flatten())


def _post_digest(program: Program, rank: int, world: int, device, group=None) -> tuple:
    """Start sharing every rank's program digest (checked by ``_Rank.check_program`` before the
    first message, while local copies and packing run)."""
    return _share(program.digest(), rank, world, device, DIGEST_TAG, group)


def execute(
    program: Program,
    state: LocalState,
    *,
    device: torch.device | str | None = None,
    timeout: float = 60.0,
    faults: tuple[Fault, ...] = (),
    stats: Stats | None = None,
    memory_limit: int | None = None,
    out: LocalState | None = None,
    group=None,
    restore: bool = False,
    ready=None,
) -> LocalState:
    """This rank's plan-B state, from its plan-A ``state`` (left untouched); see the module docstring.

    ``restore``: the transition was planned with ``restore`` (what only failed GPUs held is read
    from a checkpoint afterwards): a destination shard that no operation writes is returned
    allocated, not filled, for the caller to fill (``checkpoint_fill``).

    ``group``: the process group whose ranks the program's ranks are (default: the default
    group), so that a job that shrank runs transitions on the ranks that remain; only its
    members call this. A ``PrivateGroup`` spans processes of different worlds (a trainer's and
    its rollout workers', each a job of its own). Its programs broadcast point to point or in chains (``lower``'s
    ``broadcast="p2p"`` or ``"chain"``; ``"auto"`` never makes subgroups).

    ``memory_limit`` (bytes on this rank's device): when plan A's shards and all of plan B's do
    not fit together, destination shards are allocated at their first write, in the program's
    order, instead of up front.

    ``out``: buffers that already exist for some of plan B's shards (a generation engine's
    weights, say), filled in place and returned as those shards instead of new tensors. After a
    failure they hold partial data; plan A's ``state`` is intact as always.

    ``ready``: called on this rank with ``{key: shard}`` as destination shards become whole
    (their last piece landed and checked), round by round, before the commit: a consumer (an
    engine's loader) may read them while later rounds are on the wire (``lower``'s ``waves``).
    It reads them, never writes them. They are not committed: if the transition then fails,
    ``execute`` still raises ``TransitionError``, and what the consumer took must be dropped.
    Not with ``restore``: a shard whose last write lands may still lack what the checkpoint fills.
    """
    if ready is not None and restore:
        raise ValueError("ready hands shards as their writes land; restore leaves some to a checkpoint read after")
    rank, world = (group.rank, group.size) if is_private(group) else (dist.get_rank(group), dist.get_world_size(group))
    if world != program.world:
        raise TransitionError(f"the program needs {plural(program.world, 'rank')}, the process group has {world}")
    device = (
        torch.device(device)
        if device is not None
        else (torch.device("cuda", torch.cuda.current_device()) if _backend(group) == "nccl" else torch.device("cpu"))
    )
    bound = datetime.timedelta(seconds=timeout)
    error: BaseException | None = None
    try:  # every collective below, group creation included, is bounded by ``timeout``
        digest = _post_digest(program, rank, world, device, group)
        # a rank whose state or buffers do not match the program fails here, and every rank learns it below
        me = _Rank(
            program,
            rank,
            state,
            device,
            timeout,
            faults,
            stats if stats is not None else Stats(),
            memory_limit,
            out,
            ready,
        )
        me.digest, me.group = digest, group
        if program.groups:  # broadcast subgroups: created by every rank of the same program, in the same order
            me.check_program()
            if group is not None:
                raise TransitionError(
                    f"rank {rank}: broadcast subgroups inside a process group of some ranks are not built: "
                    "lower the transition with broadcast='p2p' or 'chain'"
                )
            me.groups = {members: dist.new_group(list(members), timeout=bound) for members in program.groups}
        me.run_all(program.steps.get(rank, []))
        me.check_program()
    except Exception as e:  # noqa: BLE001 - any failure rolls back
        error = e
    failed = _agree(error is None, rank, world, device, bound, group)
    if failed is None or failed:
        if error is not None:
            why = f"{type(error).__name__}: {error}"
        elif failed is None:
            why = f"a peer did not answer the commit agreement within {timeout:g} s (dead or hung)"
        else:
            why = f"rank{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))} failed"
        raise TransitionError(
            f"rank {rank}: transition @{program.transition} failed ({why}); "
            f"the state of plan @{program.source} is intact",
            rank=rank,
            failed_ranks=failed or (),
            unresponsive=failed is None,
            reason=why,
        ) from error
    return me.commit(restore)
