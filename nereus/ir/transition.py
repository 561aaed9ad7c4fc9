"""A transition from plan A to plan B: a DAG of operations on EMUs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

from .attributes import AttrSpec, RecordSpec, record
from .diagnostics import NOWHERE, Loc
from .emu import Box, member_states, tensor_name


@dataclass(frozen=True)
class OpKind:
    """What one kind of transition operation is: every layer asks this table instead of
    comparing kind names (the verifier, plan-transition, schedule-transfers, the lowering and
    the reference executor).

    ``sources`` and ``destinations`` are (min, max) counts of endpoints (max ``None``: any);
    ``reads`` and ``writes`` say whose state the endpoints are: ``"a"`` (plan A's shards),
    ``"b"`` (plan B's), ``"host"`` (``host[g]``) or ``"none"``; a kind that ``stages`` may write
    ``host[g]`` instead of plan B's shard on GPU g (the GPU has no room yet).
    """

    name: str
    doc: str
    sources: tuple[int, int | None]
    destinations: tuple[int, int | None]
    reads: str
    writes: str
    stages: bool = False  # may write host[g] in place of a plan-B shard on GPU g
    transfer: bool = False  # carries a slice from plan A's state to plan B's shards (a link or a local copy)
    delivers: bool = False  # what it writes counts toward plan B's shards being complete
    frees: bool = False  # the slice leaves its GPU
    pcie: bool = False  # always between a GPU and its host memory
    local: bool = False  # source and destinations on one GPU (staged: the GPU and its host memory)

    @property
    def reads_host(self) -> bool:
        return self.reads == "host"

    @property
    def writes_host(self) -> bool:
        return self.writes == "host"

    @property
    def one_to_many(self) -> bool:
        """A transfer that may write many destinations (a broadcast)."""
        return self.transfer and self.destinations[1] is None

    @property
    def source_plan(self) -> str:
        """``"source"`` or ``"target"``: the plan whose EMUs the source endpoints name."""
        return "target" if self.reads == "b" else "source"

    @property
    def destination_plan(self) -> str:
        return "source" if self.writes == "a" else "target"


OP_KINDS: dict[str, OpKind] = {
    k.name: k
    for k in (
        OpKind(
            "copy",
            "a slice of plan A's state into plan B's shard on the same GPU (or staged into host[g])",
            (1, 1),
            (1, 1),
            reads="a",
            writes="b",
            stages=True,
            transfer=True,
            delivers=True,
            local=True,
        ),
        OpKind(
            "send",
            "a slice of plan A's state to plan B's shard on another GPU (or staged into host[g])",
            (1, 1),
            (1, 1),
            reads="a",
            writes="b",
            stages=True,
            transfer=True,
            delivers=True,
        ),
        OpKind(
            "broadcast",
            "a slice of plan A's state from one GPU to plan B's shards on many",
            (1, 1),
            (1, None),
            reads="a",
            writes="b",
            stages=True,
            transfer=True,
            delivers=True,
        ),
        OpKind(
            "free",
            "plan A's slice leaves its GPU (nobody reads it any more)",
            (1, None),
            (0, 0),
            reads="a",
            writes="none",
            frees=True,
        ),
        OpKind(
            "offload",
            "plan B's slice goes to host[g] once it has arrived",
            (1, 1),
            (1, 1),
            reads="b",
            writes="host",
            pcie=True,
        ),
        OpKind(
            "load",
            "plan A's slice, offloaded between steps, comes back from host[g] before it is read",
            (1, 1),
            (1, 1),
            reads="host",
            writes="a",
            pcie=True,
        ),
        OpKind(
            "unstage",
            "a staged slice from host[g] into plan B's shards on GPU g (the slices the operations it depends on "
            "staged there, which fill its box)",
            (1, 1),
            (1, None),
            reads="host",
            writes="b",
            delivers=True,
            pcie=True,
        ),
    )
}
"""Every operation kind, by name, in printing order."""

HOST_READING_KINDS = tuple(k.name for k in OP_KINDS.values() if k.reads_host)
HOST_WRITING_KINDS = tuple(k.name for k in OP_KINDS.values() if k.writes_host) + tuple(
    k.name for k in OP_KINDS.values() if k.stages
)
LINKS = ("local", "nvlink", "nic", "pcie")


@dataclass(frozen=True)
class Admission:
    """What admit decided and why: a transition pays when benefit > cost x (1 + margin); it is
    ``forced`` when plan A cannot go on (``forced_by``: ``memory``, it no longer fits the job as
    it is now; ``gpus``, it uses GPUs that plan B's cluster does not have), whatever it saves.
    Every time is in seconds."""

    decision: str  # accept | reject | forced
    cost: float  # makespan + pg_init + engine_restart
    benefit: float | None = None  # saved over the remaining steps: saving x horizon (None: forced)
    saving: float | None = None  # saved per step (negative: plan B is slower; None: forced, plan A cannot run)
    break_even: float | None = None  # steps until the saving repays the cost (None: it never does)
    makespan: float | None = None  # the scheduled transfers
    pg_init: float | None = None  # process groups re-initialised (0: no layout changes)
    engine_restart: float | None = None  # the generation engine restarted (0: the generation layout stays)
    horizon: int | None = None  # remaining steps the benefit counts
    forced_by: str | None = None  # memory | gpus: why plan A cannot go on


FORCED_BY = ("memory", "gpus")

ADMISSION = RecordSpec(
    "admit",
    (
        AttrSpec("decision", "choice", choices=("accept", "reject", "forced")),
        AttrSpec("forced_by", "choice", default=None, choices=FORCED_BY),
        AttrSpec("cost", "time"),
        AttrSpec("makespan", "time", default=None),
        AttrSpec("pg_init", "time", default=None),
        AttrSpec("engine_restart", "time", default=None),
        AttrSpec("benefit", "time", default=None, signed=True),
        AttrSpec("saving", "time", default=None, signed=True),
        AttrSpec("horizon", "natural", default=None),
        AttrSpec("break_even", "float", default=None),
    ),
    Admission,
)

TRANSITION_ATTRS = [
    AttrSpec("source", "symbol", doc="plan A"),
    AttrSpec("target", "symbol", doc="plan B"),
    AttrSpec(
        "bytes_moved", "size", default=None, doc="bytes received over links, once per receiving GPU (plan-transition)"
    ),
    AttrSpec(
        "lower_bound", "size", default=None, doc="sum over GPUs of the destination bytes the GPU does not hold already"
    ),
    AttrSpec(
        "restored",
        "size",
        default=None,
        doc="bytes of plan B that no surviving GPU holds, read from the last checkpoint (plan-transition restore)",
    ),
    AttrSpec("makespan", "time", default=None, doc="scheduled duration (schedule-transfers)"),
    AttrSpec(
        "port_bound",
        "time",
        default=None,
        doc="max over GPU send/receive ports of their busy time: no schedule is shorter",
    ),
    AttrSpec(
        "schedule_status",
        "choice",
        default=None,
        choices=("optimal", "feasible"),
        doc="CP-SAT's status for the schedule",
    ),
    record(
        "admit",
        ADMISSION,
        default=None,
        doc="admit's decision; its cost (seconds) as makespan + pg_init + engine_restart; the benefit over horizon "
        "steps, the saving per step (seconds) and the break-even step count",
    ),
]

OP_ATTRS = [
    AttrSpec("bytes", "size"),
    AttrSpec("link", "choice", choices=LINKS),
    AttrSpec("deps", "opids", default=[]),
    AttrSpec("start", "time", default=None, doc="scheduled start, from schedule-transfers"),
    AttrSpec("duration", "time", default=None),
]


@dataclass(frozen=True, order=True)
class ShardRef:
    """Coordinate (dp, pp, tp) of a model-stage: EMU ``replica = dp``, shard (pp, tp)."""

    model_stage: str
    dp: int
    pp: int
    tp: int

    def __str__(self) -> str:
        return f"{self.model_stage}[{self.dp}, {self.pp}, {self.tp}]"


@dataclass(frozen=True, order=True)
class HostRef:
    """Host memory beside one GPU (pinned buffers used to offload that GPU's state)."""

    gpu: int

    def __str__(self) -> str:
        return f"host[{self.gpu}]"


Endpoint = ShardRef | HostRef


@dataclass(kw_only=True, slots=True)
class Op:
    """One operation of a transition (``%3 = send layers.0..15.mlp.up_proj.weight [0:7168, 0:4096]
    from [...] to [...] { bytes = 896MiB, link = nvlink }``): a slice of one state tensor (of
    every layer in ``layers``) moved, copied, broadcast, freed, offloaded or loaded."""

    id: str  # "%3"
    kind: str  # send | copy | broadcast | free | offload | load | ...
    family: str  # tensor name without the layer index ("mlp.up_proj.weight")
    layers: tuple[int, int] | None  # inclusive layer range, None for embed/head tensors
    box: Box  # half-open span per dimension, in elements of the full tensor
    bytes: int  # bytes moved (all layers of the range)
    link: str  # local | nvlink | nic | pcie
    state: str = "weight"  # weight | grad | master | exp_avg | exp_avg_sq | optimizer (the last three at once)
    src: list[Endpoint] = field(default_factory=list)  # model-stage shard (or host) coordinates
    dst: list[Endpoint] = field(default_factory=list)
    deps: list[str] = field(default_factory=list)  # ids of ops that must finish first
    start: float | None = None  # seconds from the transition's start (schedule-transfers)
    duration: float | None = None  # seconds
    loc: Loc = field(default=NOWHERE, compare=False, repr=False)
    locs: dict[str, Loc] = field(default_factory=dict, compare=False, repr=False)
    # the parser's, one per endpoint; one shared empty tuple otherwise (a 1,024-GPU transition
    # has a million operations, and an empty list each is a million more objects for the collector)
    endpoint_locs: list[Loc] | tuple = field(default=(), compare=False, repr=False)
    comments: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def tensor(self) -> str:
        return tensor_name(self.family, self.layers)

    @property
    def states(self) -> tuple[str, ...]:
        """The single states this operation moves the slice of (``optimizer``: master, exp_avg, exp_avg_sq)."""
        return member_states(self.state)

    @property
    def spec(self) -> OpKind:
        """The definition of this operation's kind."""
        return OP_KINDS[self.kind]


def unstage_feeders(op: Op, by_id: dict[str, Op]) -> list[Op]:
    """The operations whose staged slices unstage ``op`` moves onto its GPU g: those of its
    dependencies that stage the same state, tensor and layers in host[g], inside its box (the
    verifier checks that they fill it once; lowering copies each one's staging buffer)."""
    g = cast(HostRef, op.src[0]).gpu
    out = []
    for d in op.deps:
        f = by_id.get(d)
        if f is None or not f.spec.stages or (f.state, f.family, f.layers) != (op.state, op.family, op.layers):
            continue
        if (
            any(isinstance(r, HostRef) and r.gpu == g for r in f.dst)
            and len(f.box) == len(op.box)
            and all(a <= lo and hi <= b for (lo, hi), (a, b) in zip(f.box, op.box))
        ):
            out.append(f)
    return out


@dataclass(kw_only=True)
class Transition:
    """The move from plan ``source`` to plan ``target``: a graph of operations on the state of
    every model (written ``transition @t { ... }``; built by ``plan-transition``).

    ``bytes_moved`` and ``lower_bound`` are bytes; ``makespan`` and ``port_bound`` seconds."""

    name: str  # without the @
    source: str  # plan A
    target: str  # plan B
    ops: list[Op] = field(default_factory=list)  # in dependency order; ``Op.deps`` holds the edges
    bytes_moved: int | None = None  # bytes received over links, once per receiving GPU (plan-transition)
    lower_bound: int | None = None  # bytes: sum over GPUs of the destination bytes not already there
    restored: int | None = None  # bytes no surviving GPU holds, read from a checkpoint instead (``restore``)
    makespan: float | None = None  # seconds, the scheduled duration (schedule-transfers)
    port_bound: float | None = None  # seconds: the busiest GPU port's work; no schedule is shorter
    schedule_status: str | None = None  # optimal | feasible (CP-SAT)
    admit: Admission | None = None  # admit's decision and its numbers
    loc: Loc = field(default=NOWHERE, compare=False, repr=False)
    locs: dict[str, Loc] = field(default_factory=dict, compare=False, repr=False)
    comments: dict = field(default_factory=dict, compare=False, repr=False)
