"""Elastic Model Units: the distributed state of one replica of a model-stage.

An EMU is one data-parallel replica (``replica`` = dp index) of a model-stage under a plan.
For each pipeline/tensor coordinate (pp, tp) it records the GPU and the exact slices it holds:
which tensor (family and layer range), which state (weights, gradients, Adam moments, fp32
master copy) and the half-open span ``[start, stop)`` of every dimension; a generation shard
also records the KV-cache budget it may allocate (``kv_cache = 6GiB``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property

from .attributes import AttrSpec
from .diagnostics import NOWHERE, Loc

_LAYER_NAME = re.compile(r"layers\.(\d+)(?:\.\.(\d+))?\.(.+)\Z")

STATES = ("weight", "grad", "master", "exp_avg", "exp_avg_sq")
# A transition operation may move the same slice of several states of one tensor at once: the
# optimizer state of a trained model (fp32 master and Adam's two moments) is sliced alike under
# every layout, so plan-transition moves it as one operation per slice (``optimizer``), not
# three. EMU entries always name a single state.
STATE_GROUPS = {"optimizer": ("master", "exp_avg", "exp_avg_sq")}


def member_states(state: str) -> tuple[str, ...]:
    """The single states an operation's ``state`` names: itself, or a group's members in order."""
    return STATE_GROUPS.get(state, (state,))


Box = tuple[tuple[int, int], ...]


class _Immutable:
    """EMUs, their shards and their slices are values: frozen, so a pass replaces one (``dataclasses.replace``)
    and never edits it. Analyses that read them (``Module.analyses``) stay valid while the module holds the
    same objects, and a deep copy of a module shares them instead of copying every slice."""

    def __deepcopy__(self, memo):
        return self

    def __copy__(self):
        return self


@dataclass(frozen=True, kw_only=True)
class SliceEntry(_Immutable):
    """One slice: ``[state] layers.A..B.family [s0:e0, s1:e1]``; ``layers`` None for non-layer tensors."""

    family: str
    layers: tuple[int, int] | None
    box: Box
    state: str = "weight"
    loc: Loc = field(default=NOWHERE, compare=False, repr=False)

    @property
    def tensor(self) -> str:
        """The tensor as written in text: ``layers.0..15.mlp.up_proj.weight``."""
        return tensor_name(self.family, self.layers)

    @cached_property
    def region(self) -> Box:
        """The slice as one box (``region_of``); computed once (entries are frozen)."""
        return region_of(self.layers, self.box)

    def numel(self) -> int:
        n = 1 if self.layers is None else self.layers[1] - self.layers[0] + 1
        for lo, hi in self.box:
            n *= hi - lo
        return n


def volume(box: Box) -> int:
    """Elements in a box of half-open spans (a slice, a region, a cell): the product of its extents."""
    n = 1
    for lo, hi in box:
        n *= hi - lo
    return n


def region_of(layers: tuple[int, int] | None, box: Box) -> Box:
    """A slice as one box of half-open spans, the layer axis first for per-layer families:
    ``layers.0..15`` + ``[0:1024, 0:4096]`` -> ``((0, 16), (0, 1024), (0, 4096))``."""
    return (((layers[0], layers[1] + 1),) if layers is not None else ()) + tuple(box)


def tensor_name(family: str, layers: tuple[int, int] | None) -> str:
    if layers is None:
        return family
    lo, hi = layers
    return f"layers.{lo}.{family}" if lo == hi else f"layers.{lo}..{hi}.{family}"


def split_tensor_name(name: str) -> tuple[str, tuple[int, int] | None] | None:
    """``layers.0..15.mlp.up_proj.weight`` -> ``("mlp.up_proj.weight", (0, 15))``.

    Returns None when the layer segment is malformed (``layers.x.foo``).
    """
    if not name.startswith("layers."):
        return name, None
    match = _LAYER_NAME.match(name)
    if match is None:
        return None
    lo, hi, family = match.groups()
    return family, (int(lo), int(hi if hi is not None else lo))


SHARD_ATTRS = [
    AttrSpec("kv_cache", "size", default=None, doc="KV cache a generation shard may allocate on its GPU"),
]


@dataclass(frozen=True, kw_only=True)
class Shard(_Immutable):
    """The slices one (pp, tp) coordinate of a replica holds on its GPU. ``entries`` is a tuple
    (a list given is made one); replicas that hold the same slices share one tuple."""

    pp: int
    tp: int
    gpu: int
    entries: tuple[SliceEntry, ...] = ()
    kv_cache: int | None = None
    loc: Loc = field(default=NOWHERE, compare=False, repr=False)
    comments: dict = field(default_factory=dict, compare=False, repr=False)  # the printer's, not the IR's

    def __post_init__(self):
        if not isinstance(self.entries, tuple):
            object.__setattr__(self, "entries", tuple(self.entries))


@dataclass(frozen=True, kw_only=True)
class Emu(_Immutable):
    plan: str
    model_stage: str
    replica: int
    shards: tuple[Shard, ...] = ()
    loc: Loc = field(default=NOWHERE, compare=False, repr=False)
    plan_loc: Loc = field(default=NOWHERE, compare=False, repr=False)
    comments: dict = field(default_factory=dict, compare=False, repr=False)  # the printer's, not the IR's

    def __post_init__(self):
        if not isinstance(self.shards, tuple):
            object.__setattr__(self, "shards", tuple(self.shards))

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.plan, self.model_stage, self.replica)

    def shard(self, pp: int, tp: int) -> Shard | None:
        for s in self.shards:
            if s.pp == pp and s.tp == tp:
                return s
        return None
