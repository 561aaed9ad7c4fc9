"""A transition from plan A to plan B: a DAG of operations on EMUs."""

from __future__ import annotations

from dataclasses import dataclass, field

from .attributes import AttrSpec, RecordSpec, record
from .diagnostics import NOWHERE, Loc
from .emu import Box, tensor_name

OP_KINDS = ("copy", "send", "broadcast", "allgather", "free", "offload", "load", "unstage")
"""What each kind does:

- ``copy``, ``send``, ``broadcast``, ``allgather``: a slice of plan A's state to plan B's shards
  (on the same GPU, to one GPU, from one GPU to many, from many to many). A ``copy``, ``send``
  or ``broadcast`` may write ``host[g]`` instead of a shard on GPU g: the slice is *staged* in
  the host memory beside g, because g has no room for it until its own plan-A slices are freed;
- ``unstage``: a staged slice from ``host[g]`` into plan B's shards on GPU g;
- ``free``: plan A's slice leaves its GPU;
- ``load``: plan A's slice, offloaded to host memory between steps, comes back before it is read;
- ``offload``: plan B's slice goes to host memory once it has arrived.
"""
LINKS = ("local", "nvlink", "nic", "pcie")

@dataclass(frozen=True)
class Admission:
    """What admit decided and why: a transition pays when benefit > cost x (1 + margin)."""

    decision: str  # accept | reject
    cost: float  # seconds: scheduled makespan + fixed overheads
    benefit: float  # seconds saved over the remaining steps
    saving: float  # seconds saved per step (negative: plan B is slower)
    break_even: float | None = None  # steps until the saving repays the cost (None: it never does)


ADMISSION = RecordSpec("admit", (AttrSpec("decision", "choice", choices=("accept", "reject")), AttrSpec("cost", "time"),
                                 AttrSpec("benefit", "float"), AttrSpec("saving", "float"), AttrSpec("break_even", "float", default=None)),
                       Admission)

TRANSITION_ATTRS = [
    AttrSpec("source", "symbol", doc="plan A"),
    AttrSpec("target", "symbol", doc="plan B"),
    AttrSpec("bytes_moved", "size", default=None, doc="bytes received over links, once per receiving GPU (plan-transition)"),
    AttrSpec("lower_bound", "size", default=None, doc="sum over GPUs of the destination bytes the GPU does not hold already"),
    AttrSpec("makespan", "time", default=None, doc="scheduled duration (schedule-transfers)"),
    AttrSpec("port_bound", "time", default=None, doc="max over GPU send/receive ports of their busy time: no schedule is shorter"),
    AttrSpec("schedule_status", "choice", default=None, choices=("optimal", "feasible"), doc="CP-SAT's status for the schedule"),
    record("admit", ADMISSION, default=None, doc="admit's decision, cost, benefit, per-step saving and break-even steps"),
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


@dataclass(kw_only=True)
class Op:
    id: str
    kind: str
    family: str
    layers: tuple[int, int] | None
    box: Box
    bytes: int
    link: str
    state: str = "weight"
    src: list[Endpoint] = field(default_factory=list)
    dst: list[Endpoint] = field(default_factory=list)
    deps: list[str] = field(default_factory=list)
    start: float | None = None
    duration: float | None = None
    loc: Loc = field(default=NOWHERE, compare=False, repr=False)
    locs: dict[str, Loc] = field(default_factory=dict, compare=False, repr=False)
    endpoint_locs: list[Loc] = field(default_factory=list, compare=False, repr=False)
    comments: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def tensor(self) -> str:
        return tensor_name(self.family, self.layers)


@dataclass(kw_only=True)
class Transition:
    name: str
    source: str
    target: str
    ops: list[Op] = field(default_factory=list)
    bytes_moved: int | None = None
    lower_bound: int | None = None
    makespan: float | None = None
    port_bound: float | None = None
    schedule_status: str | None = None
    admit: Admission | None = None
    loc: Loc = field(default=NOWHERE, compare=False, repr=False)
    locs: dict[str, Loc] = field(default_factory=dict, compare=False, repr=False)
    comments: dict = field(default_factory=dict, compare=False, repr=False)
