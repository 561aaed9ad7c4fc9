"""What a collective program moves, in a few tables: ``nereus lower``'s default output.

A program lists every per-layer slice on every rank (hundreds of thousands of lines for a
48-layer model on 32 GPUs); its summary counts, from the program's steps alone:

- per round of point-to-point messages, and per phase of a level (the operations that run
  together: loads, local copies and unstages, then one round of messages, or several where a
  chained broadcast pipelines its chunks, then the broadcasts, then the copies from what
  arrived; offloads run at commit), the messages and bytes per link kind: ``nvlink`` (another
  GPU of the same node), ``network`` (another node), ``host`` (loads, offloads, copies staged
  into a host buffer and their unstage) and ``local`` (copies between shards of one GPU);
  consecutive rounds that move the same share one row (``rounds 14..23``);
- per rank, the messages and bytes it sends and receives (a broadcast counts once per receiver,
  as ``Program.sent_bytes`` does), and its local and host copies; consecutive ranks with the
  same figures share one row (``0..7``);
- the totals, and the transition's scheduled makespan where it has one.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field

from ..ir.attributes import compress_ints
from ..ir.cluster import Cluster
from ..ir.diagnostics import plural
from ..ir.units import Dim, format_bytes, format_quantity
from .program import Program

LINK_KINDS = ("nvlink", "network", "host", "local")
COMMIT = -1  # the level of what runs at commit (offloads)


@dataclass
class Traffic:
    """Messages (or copies) and bytes per link kind."""

    msgs: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LINK_KINDS, 0))
    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LINK_KINDS, 0))

    def add(self, kind: str, nbytes: int, n: int = 1) -> None:
        self.msgs[kind] += n
        self.bytes[kind] += nbytes

    def __iadd__(self, other: Traffic) -> Traffic:
        for k in LINK_KINDS:
            self.msgs[k] += other.msgs[k]
            self.bytes[k] += other.bytes[k]
        return self


PHASES = ("copies", "round", "broadcasts", "copies of what arrived", "at commit")
"""The phases of a level, in the order they run: loads, copies and unstages; rounds of messages;
broadcasts; copies from what arrived to a second model-stage; offloads (at commit, after every level)."""


@dataclass
class RoundRow:
    """One phase of one level: for ``round``, the consecutive rounds ``rounds`` of the level that
    move the same (one row per round, folded where consecutive rounds carry the same traffic)."""

    level: int  # COMMIT for what runs at commit
    phase: str  # one of PHASES
    rounds: list[int] = field(default_factory=list)  # round: the program's round numbers of the row
    broadcasts: int = 0  # dist.broadcast calls (collective broadcasts)
    traffic: Traffic = field(default_factory=Traffic)

    @property
    def label(self) -> str:
        if self.phase == "round":
            # consecutive rounds
            return (
                f"rounds {self.rounds[0]}..{self.rounds[-1]}, each"
                if len(self.rounds) > 1
                else f"round {self.rounds[0]}"
            )
        if self.phase == "broadcasts":
            return f"{self.broadcasts:,} broadcast{'s' if self.broadcasts != 1 else ''}"
        return self.phase


@dataclass(frozen=True)
class RankFigures:
    sent_msgs: int = 0
    sent_bytes: int = 0
    recv_msgs: int = 0
    recv_bytes: int = 0
    local_copies: int = 0
    local_bytes: int = 0
    host_moves: int = 0
    host_bytes: int = 0


@dataclass(frozen=True)
class RankRow:
    ranks: tuple[int, ...]  # consecutive ranks with the same figures
    gpus: tuple[int, ...]
    figures: RankFigures


@dataclass
class ProgramSummary:
    transition: str
    source: str
    target: str
    world: int
    bucket_bytes: int
    rounds: list[RoundRow]  # in the order they run
    ranks: list[RankRow]
    totals: Traffic
    steps: int  # program steps, every rank
    pieces: int  # per-layer slices copied, sent or broadcast (each once, on the side that sends or copies it)
    makespan: float | None = None


def _gpu_link(prog: Program, cluster: Cluster | None):
    if cluster is None:
        return lambda a, b: "nvlink"
    per = cluster.gpus_per_node
    return lambda a, b: "nvlink" if prog.gpus[a] // per == prog.gpus[b] // per else "network"


def summarize(prog: Program, cluster: Cluster | None = None, makespan: float | None = None) -> ProgramSummary:
    """The summary of ``prog`` (see the module docstring). ``cluster`` tells nodes apart (rank r
    on GPU ``prog.gpus[r]``, node ``gpu // gpus_per_node``); without it every GPU is on one node."""
    link = _gpu_link(prog, cluster)
    rows: dict[tuple[int, int, int], RoundRow] = {}  # (level, phase, round) -> row
    round_levels = prog.round_levels

    def row(level: int, phase: str, rnd: int = -1) -> RoundRow:
        key = (level, PHASES.index(phase), rnd)
        r = rows.get(key)
        if r is None:
            r = rows[key] = RoundRow(level, phase, [rnd] if rnd >= 0 else [])
        return r

    figures: list[RankFigures] = []
    n_steps = n_pieces = 0
    for r in range(prog.world):
        steps = prog.steps.get(r, [])
        n_steps += len(steps)
        src_bytes = {s.key: s.nbytes for s in prog.src.get(r, [])}
        dst_bytes = {s.key: s.nbytes for s in prog.dst.get(r, [])}
        sm = sb = rm = rb = lc = lb = hm = hb = 0
        for s in steps:
            k = s.kind
            if k == "round":
                t = row(round_levels[s.round] if s.round < len(round_levels) else s.round, "round", s.round).traffic
                for m in s.sends:
                    nb = m.nbytes
                    n_pieces += len(m.pieces)
                    t.add(link(r, m.receiver), nb)
                    sm += 1
                    sb += nb
                for m in s.recvs:
                    rm += 1
                    rb += m.nbytes
            elif k == "broadcast":
                msg = s.message
                nb = msg.nbytes
                root = s.group[0]
                if r == root:
                    n_pieces += len(msg.pieces)
                    lvrow = row(s.round, "broadcasts")
                    lvrow.broadcasts += 1
                    for member in s.group[1:]:
                        lvrow.traffic.add(link(root, member), nb)
                    sm += len(s.group) - 1
                    sb += nb * (len(s.group) - 1)
                else:
                    rm += 1
                    rb += nb
            elif k in ("copy", "unstage"):
                p = s.piece
                n_pieces += 1
                phase = "copies of what arrived" if p.arrived and k == "copy" else "copies"
                if k == "unstage" or p.staged:
                    row(s.round, phase).traffic.add("host", p.nbytes)
                    hm += 1
                    hb += p.nbytes
                else:
                    row(s.round, phase).traffic.add("local", p.nbytes)
                    lc += 1
                    lb += p.nbytes
            elif k in ("load", "offload"):
                held = src_bytes if k == "load" else dst_bytes
                nb = sum(held.get(key, 0) for key in s.keys)
                (row(s.round, "copies") if k == "load" else row(COMMIT, "at commit")).traffic.add(
                    "host", nb, len(s.keys)
                )
                hm += len(s.keys)
                hb += nb
        figures.append(RankFigures(sm, sb, rm, rb, lc, lb, hm, hb))
    ranks: list[RankRow] = []
    for r, f in enumerate(figures):
        if ranks and ranks[-1].figures == f and ranks[-1].ranks[-1] == r - 1:
            last = ranks[-1]
            ranks[-1] = RankRow(last.ranks + (r,), last.gpus + (prog.gpus[r],), f)
        else:
            ranks.append(RankRow((r,), (prog.gpus[r],), f))
    totals = Traffic()
    ordered: list[RoundRow] = []
    for (level, _, _), x in sorted(rows.items(), key=lambda kv: (kv[0][0] == COMMIT, kv[0])):
        totals += x.traffic
        last = ordered[-1] if ordered else None
        if (
            last is not None
            and x.phase == "round"
            and last.phase == "round"
            and last.level == level
            and last.rounds[-1] == x.rounds[0] - 1
            and last.traffic == x.traffic
        ):
            last.rounds.append(x.rounds[0])  # consecutive rounds that move the same: one row
        else:
            ordered.append(x)
    return ProgramSummary(
        prog.transition,
        prog.source,
        prog.target,
        prog.world,
        prog.bucket_bytes,
        ordered,
        ranks,
        totals,
        n_steps,
        n_pieces,
        makespan,
    )


def _bytes(n: int) -> str:
    return format_bytes(n) if n else "-"


def _count(n: int) -> str:
    return f"{n:,}" if n else "-"


def format_summary(s: ProgramSummary, width: int = 160) -> str:
    """The summary as rich tables (plain text, no colour), with a closing line of totals."""
    from rich.console import Console
    from rich.table import Table

    buf = io.StringIO()
    console = Console(file=buf, width=width, color_system=None, force_terminal=False, highlight=False)
    head = (
        f"program @{s.transition} (@{s.source} -> @{s.target}): {plural(s.world, 'rank')}, "
        f"{plural(s.steps, 'step', fmt=',')}, "
        f"{s.pieces:,} per-layer slices copied or sent, bucket {_bytes(s.bucket_bytes)}"
    )
    console.print(head, soft_wrap=True)

    t = Table(
        title="per round: messages and bytes per link (consecutive rounds that move the same share a row)",
        title_justify="left",
    )
    t.add_column("level", justify="right")
    t.add_column("step", justify="left")
    for k in LINK_KINDS:
        t.add_column(f"{k} msgs" if k not in ("host", "local") else f"{k} copies", justify="right")
        t.add_column(f"{k} bytes", justify="right")
    for x in s.rounds:
        cells = [c for k in LINK_KINDS for c in (_count(x.traffic.msgs[k]), _bytes(x.traffic.bytes[k]))]
        t.add_row("" if x.level == COMMIT else str(x.level), x.label, *cells)
    cells = [c for k in LINK_KINDS for c in (_count(s.totals.msgs[k]), _bytes(s.totals.bytes[k]))]
    t.add_row("total", "", *cells, end_section=True)
    console.print(t)

    t = Table(title="per rank (consecutive ranks with the same figures share a row)", title_justify="left")
    gpus = any(row.gpus != row.ranks for row in s.ranks)  # a GPU column where rank r is not GPU r
    for col in (
        "ranks",
        "GPUs",
        "sent msgs",
        "sent bytes",
        "received msgs",
        "received bytes",
        "local copies",
        "local bytes",
        "host copies",
        "host bytes",
    ):
        if col != "GPUs" or gpus:
            t.add_column(col, justify="left" if col in ("ranks", "GPUs") else "right")
    tot = [0] * 8
    for row in s.ranks:
        f = row.figures
        vals = (
            f.sent_msgs,
            f.sent_bytes,
            f.recv_msgs,
            f.recv_bytes,
            f.local_copies,
            f.local_bytes,
            f.host_moves,
            f.host_bytes,
        )
        for i, v in enumerate(vals):
            tot[i] += v * len(row.ranks)
        label = [compress_ints(list(row.ranks))] + ([compress_ints(list(row.gpus))] if gpus else [])
        t.add_row(*label, *[(_count if i % 2 == 0 else _bytes)(v) for i, v in enumerate(vals)])
    t.add_row("total", *([""] if gpus else []), *[(_count if i % 2 == 0 else _bytes)(v) for i, v in enumerate(tot)])
    console.print(t)

    sent = s.totals.bytes["nvlink"] + s.totals.bytes["network"]
    msgs = s.totals.msgs["nvlink"] + s.totals.msgs["network"]
    console.print(
        f"moves {plural(sent, 'byte', fmt=',')} in {plural(msgs, 'message', fmt=',')} "
        f"({_bytes(s.totals.bytes['nvlink'])} over NVLink, "
        f"{_bytes(s.totals.bytes['network'])} over the network)",
        soft_wrap=True,
    )
    tail = (
        f"copies {s.totals.bytes['local']:,} bytes locally and {s.totals.bytes['host']:,} bytes to or from host memory"
    )
    if s.makespan is not None:
        tail += f"; estimated makespan {format_quantity(Dim.TIME, s.makespan)}"
    console.print(tail, soft_wrap=True)
    console.print(
        "nereus lower --full prints the whole program, per-layer repetition folded into layers.A..B ranges.",
        soft_wrap=True,
    )
    return "".join(line.rstrip() + "\n" for line in buf.getvalue().splitlines())
