"""A plan: the layout of every model-stage, what shares GPUs, what is offloaded."""

from __future__ import annotations

from dataclasses import dataclass, field

from .attributes import AttrSpec
from .diagnostics import NOWHERE, Loc

OFFLOADABLE = ("weights", "grads", "optimizer")

PLAN_ATTRS = [
    AttrSpec("workload", "symbol"),
    AttrSpec("cluster", "symbol"),
    AttrSpec("colocate", "dotted_groups", default=[],
             doc="groups of model-stages of one stage that share GPUs and run one after another"),
]

LAYOUT_ATTRS = [
    AttrSpec("tp", "posint"),
    AttrSpec("pp", "posint"),
    AttrSpec("dp", "posint"),
    AttrSpec("layers", "ranges", doc="layer range of each pipeline stage, e.g. [0..15, 16..31]"),
    AttrSpec("mesh", "ints", doc="GPU of each (dp, pp, tp) coordinate, tp fastest"),
    AttrSpec("micro_batches", "posint", default=1, doc="micro-batches per pipeline flush"),
    AttrSpec("zero", "int", default=0, doc="ZeRO stage: shard optimizer (1), grads (2), weights (3) over DP"),
    AttrSpec("recompute", "bool", default=False, doc="activation recomputation"),
    AttrSpec("offload", "names", default=[], choices=OFFLOADABLE, doc="state moved to host memory after the stage"),
    AttrSpec("time", "time", default=None, doc="predicted time of the model-stage (from estimate)"),
    AttrSpec("memory", "size", default=None, doc="predicted peak memory per GPU (from estimate)"),
]


@dataclass(kw_only=True)
class Layout:
    model_stage: str
    tp: int
    pp: int
    dp: int
    layers: list[tuple[int, int]]
    mesh: list[int]
    micro_batches: int = 1
    zero: int = 0
    recompute: bool = False
    offload: list[str] = field(default_factory=list)
    time: float | None = None
    memory: int | None = None
    loc: Loc = field(default=NOWHERE, compare=False, repr=False)
    locs: dict[str, Loc] = field(default_factory=dict, compare=False, repr=False)
    comments: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def model(self) -> str:
        return self.model_stage.rpartition(".")[0]

    @property
    def stage(self) -> str:
        return self.model_stage.rpartition(".")[2]

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.tp

    def gpu(self, dp: int, pp: int, tp: int) -> int:
        """The GPU at mesh coordinate (dp, pp, tp); tp varies fastest."""
        return self.mesh[(dp * self.pp + pp) * self.tp + tp]

    def coords(self):
        """Every (dp, pp, tp) coordinate, in mesh order."""
        for d in range(self.dp):
            for p in range(self.pp):
                for t in range(self.tp):
                    yield d, p, t


@dataclass(kw_only=True)
class Plan:
    name: str
    workload: str
    cluster: str
    colocate: list[list[str]] = field(default_factory=list)
    layouts: dict[str, Layout] = field(default_factory=dict)
    loc: Loc = field(default=NOWHERE, compare=False, repr=False)
    locs: dict[str, Loc] = field(default_factory=dict, compare=False, repr=False)
    comments: dict = field(default_factory=dict, compare=False, repr=False)

    def shares(self, a: str, b: str) -> bool:
        return any(a in g and b in g for g in self.colocate)
