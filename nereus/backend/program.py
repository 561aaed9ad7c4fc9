"""The collective program: what each rank does, step by step, to carry out one transition.

A program is per rank an ordered list of steps over tensor slices, named by ``StateKey`` and
a box in the full tensor's coordinates (the executor turns a box into a slice of its local
shard, whose box it knows from ``src`` and ``dst``):

- ``alloc``: the destination shards that do not stay in place, allocated before any transfer;
- ``keep``: a destination shard that is a source shard of this rank (same key, same box);
- ``copy``: a local slice copy from a source shard into a destination shard;
- ``round``: one batch of point-to-point messages (``batch_isend_irecv``): each message goes to
  or comes from one peer and carries one slice sent as is (``direct``: contiguous on both
  sides, no packing) or a bucket that packs many slices into one flat byte buffer;
- ``broadcast``: one bucket from a root to the ranks of a subgroup (``dist.broadcast``);
- ``load`` / ``offload``: a source shard comes from host memory, a destination shard goes to it;
- ``unstage``: a slice that a copy or a message *staged* (wrote into a host-memory buffer of
  its own instead of the destination shard, where the GPU had no room for it yet) is copied
  into its destination shard;
- ``release``: a source shard that plan B does not keep, dropped at commit (never earlier: the
  source state is what a failed transition rolls back to).

Every message carries a checksum that the receiver checks before the transition commits.
"""

from __future__ import annotations

import hashlib
import io
import pickle
from dataclasses import dataclass, field

from ..ir.emu import Box
from ..ir.units import format_bytes
from .fold import fold_listing
from .shards import ShardSpec, StateKey


@dataclass(frozen=True)
class Piece:
    """A slice ``box`` (full-tensor coordinates) read from ``src`` on the sender, written to ``dst`` on the receiver."""

    src: StateKey
    dst: StateKey
    box: Box
    nbytes: int
    arrived: bool = False  # read from a destination shard this transition filled, not from plan A's state
    staged: bool = False  # written to (copy, message) or read from (unstage) a host staging buffer for dst's box


@dataclass(frozen=True)
class Message:
    """One message between a sender and a receiver: a single slice (``direct``) or a packed bucket."""

    id: int  # unique in the program; both sides post a pair's messages in id order
    sender: int
    receiver: int
    pieces: tuple[Piece, ...]
    direct: bool

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)


@dataclass(frozen=True)
class StepKind:
    """What one kind of program step is, as ``OpKind`` is for transition operations: the
    printer, the checker and the executor ask this table instead of comparing kind names.

    ``holds`` is the ``Step`` field it acts on: ``keys`` (whole shards), ``piece`` (one slice on
    this rank), ``messages`` (a round's sends and receives) or ``message`` (a broadcast's bucket);
    a ``keys`` step's shards are plan B's (``shards = "dst"``) or plan A's (``"src"``)."""

    name: str
    holds: str
    shards: str = ""  # keys steps: whose shards the keys name
    stages: bool = False  # reads a staging buffer an earlier copy or message wrote (unstage)


STEP_KINDS: dict[str, StepKind] = {
    k.name: k
    for k in (
        StepKind("alloc", "keys", "dst"),
        StepKind("keep", "keys", "dst"),
        StepKind("copy", "piece"),
        StepKind("round", "messages"),
        StepKind("broadcast", "message"),
        StepKind("load", "keys", "src"),
        StepKind("unstage", "piece", stages=True),
        StepKind("offload", "keys", "dst"),
        StepKind("release", "keys", "src"),
    )
}
"""Every kind of program step, as the module docstring defines them."""


@dataclass(frozen=True)
class Step:
    kind: str  # one of STEP_KINDS
    keys: tuple[StateKey, ...] = ()  # alloc, keep, load, offload, release
    piece: Piece | None = None  # copy, unstage
    sends: tuple[Message, ...] = ()  # round
    recvs: tuple[Message, ...] = ()  # round
    group: tuple[int, ...] = ()  # broadcast: the subgroup's ranks (the root first)
    message: Message | None = None  # broadcast: the bucket (receiver = -1)
    round: int = 0  # round: its number (``Program.round_levels``); broadcast, copy, unstage, load: the level it runs in

    def __post_init__(self):
        if self.kind not in STEP_KINDS:
            raise ValueError(f"unknown program step kind {self.kind!r}; kinds: {', '.join(STEP_KINDS)}")


@dataclass
class Program:
    transition: str
    source: str  # plan A
    target: str  # plan B
    gpus: list[int]  # rank r runs on GPU gpus[r]
    src: dict[int, list[ShardSpec]]  # rank -> plan A's shards (the state it starts with)
    dst: dict[int, list[ShardSpec]]  # rank -> plan B's shards (the state it ends with)
    steps: dict[int, list[Step]] = field(default_factory=dict)
    groups: list[tuple[int, ...]] = field(default_factory=list)  # broadcast subgroups, created once, in this order
    bucket_bytes: int = 0
    # round number -> the level (operations that run together) it belongs to; several rounds
    # share a level where a chained broadcast pipelines its chunks (empty: each round its own level)
    round_levels: list[int] = field(default_factory=list)

    @property
    def world(self) -> int:
        return len(self.gpus)

    def __getstate__(self) -> dict:
        """What travels: the program, not the executor's per-process caches keyed by object ids
        (``_regions``, ``_writes``)."""
        return {k: v for k, v in self.__dict__.items() if k not in ("_regions", "_writes")}

    def digest(self) -> int:
        """A 63-bit digest of the whole program (every rank's steps and shards): ranks that run
        different programs disagree on it. Computed once; a program is not changed after lowering."""
        cached = self.__dict__.get("_digest")
        if cached is None:
            content = (
                self.transition,
                self.source,
                self.target,
                self.gpus,
                self.src,
                self.dst,
                self.steps,
                self.groups,
                self.bucket_bytes,
            )
            # the pickler's memo would make the bytes depend on which objects are shared (a program
            # lowered here and one unpickled from another rank differ there); without it they
            # depend on the values alone
            buf = io.BytesIO()
            pickler = pickle.Pickler(buf, protocol=4)
            pickler.fast = True
            pickler.dump(content)
            h = hashlib.blake2b(buf.getvalue(), digest_size=8).digest()
            cached = self.__dict__["_digest"] = int.from_bytes(h, "little") >> 1
        return cached

    def sent_bytes(self, rank: int) -> int:
        """Payload bytes ``rank`` sends (a broadcast counts once per receiver, as its root sends it to each)."""
        n = 0
        for s in self.steps.get(rank, []):
            n += sum(m.nbytes for m in s.sends)
            if s.kind == "broadcast" and s.group[0] == rank:
                n += s.message.nbytes * (len(s.group) - 1)
        return n

    def received_bytes(self, rank: int) -> int:
        n = 0
        for s in self.steps.get(rank, []):
            n += sum(m.nbytes for m in s.recvs)
            if s.kind == "broadcast" and s.group[0] != rank:
                n += s.message.nbytes
        return n


def _box(box: Box) -> str:
    return "[" + ", ".join(f"{lo}:{hi}" for lo, hi in box) + "]"


def _compact(n: int) -> str:
    return format_bytes(n, sep="")


def _piece(p: Piece) -> str:
    same = "" if p.dst == p.src else f" -> {p.dst}"
    return f"{'arrived ' if p.arrived else ''}{p.src} {_box(p.box)}{same}{' (staged)' if p.staged else ''}"


def print_program(prog: Program, ranks: list[int] | None = None, fold: bool = False) -> str:
    """The program as text, rank by rank (for goldens and for reading); deterministic.

    ``fold``: consecutive lines (a message with its pieces) that differ only in the layer are
    written once with a ``layers.A..B`` range, and their message ids as ``#I..J``
    (``fold.fold_listing``; ``fold.unfold_listing`` gives the per-layer text back).
    """
    out = [
        (
            f"program @{prog.transition} (@{prog.source} -> @{prog.target}) world = {prog.world}, "
            f"bucket = {_compact(prog.bucket_bytes)} {{"
        )
    ]
    if prog.gpus != list(range(prog.world)):
        out.append(f"  gpus = [{', '.join(map(str, prog.gpus))}]")
    for g in prog.groups:
        out.append(f"  group [{', '.join(map(str, g))}]")
    for r in ranks if ranks is not None else range(prog.world):
        steps = prog.steps.get(r, [])
        src_box = {x.key: x.box for x in prog.src.get(r, [])}
        dst_box = {x.key: x.box for x in prog.dst.get(r, [])}
        out.append(
            f"  rank {r} {{  // sends {_compact(prog.sent_bytes(r))}, receives {_compact(prog.received_bytes(r))}"
        )
        for s in steps:
            kind = STEP_KINDS[s.kind]
            if kind.holds == "keys":
                boxes = dst_box if kind.shards == "dst" else src_box
                for k in s.keys:
                    box = boxes.get(k, ())
                    out.append(f"    {s.kind} {k} {_box(box)}")
            elif kind.holds == "piece":
                out.append(f"    {s.kind} {_piece(s.piece)}")
            elif kind.holds == "messages":
                out.append(f"    round {s.round} {{")
                for verb, msgs in (("send", s.sends), ("recv", s.recvs)):
                    for msg in msgs:
                        peer = msg.receiver if verb == "send" else msg.sender
                        arrow = "->" if verb == "send" else "<-"
                        how = "direct" if msg.direct else f"bucket of {len(msg.pieces)}"
                        out.append(f"      {verb} #{msg.id} {arrow} {peer}: {how}, {_compact(msg.nbytes)}")
                        for p in msg.pieces:
                            out.append(f"        {_piece(p)}")
                out.append("    }")
            elif kind.holds == "message":
                msg = s.message
                out.append(
                    f"    broadcast #{msg.id} round {s.round} root {s.group[0]} in [{', '.join(map(str, s.group))}]: "
                    f"bucket of {len(msg.pieces)}, {_compact(msg.nbytes)}"
                )
                for p in msg.pieces:
                    out.append(f"      {_piece(p)}")
        out.append("  }")
    out.append("}")
    if fold:
        out = fold_listing(out)
    return "\n".join(out) + "\n"
