"""The backend's vocabulary: the shards a rank holds, named as a training loop names tensors.

The runtime's unit is one tensor as a training loop names it (Hugging Face names, one tensor per
layer: ``layers.3.mlp.up_proj.weight``), not the IR's per-family slice entries that cover a
layer range. A ``StateKey`` names the model-stage, the state (``weight``, ``master``,
``exp_avg``, ``exp_avg_sq``) and the tensor; a ``ShardSpec`` says which box of the full tensor
a rank holds and in which dtype (an IR dtype name: ``bf16``, ``fp32``...; the runtime maps it
to a torch dtype). ``plan_layout`` expands a plan's EMUs into these specs, GPU by GPU, so that
a user's state dict, a DCP checkpoint, a DTensor and a collective program all speak of the
same slices.

Ranks are the GPUs of the cluster in order: rank r runs on GPU id r of the plan's cluster, as
``torchrun`` numbers one process per GPU, unless a program says otherwise (``Program.gpus``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from ..ir import Module
from ..ir.emu import Box
from ..ir.model import DTYPE_BYTES


@dataclass(frozen=True, order=True)
class StateKey:
    model_stage: str  # e.g. actor.train
    state: str  # weight | master | exp_avg | exp_avg_sq
    tensor: str  # e.g. layers.3.mlp.up_proj.weight

    def __hash__(self) -> int:  # a key is looked up per slice moved: hash once, not per lookup
        h = self.__dict__.get("_hash")
        if h is None:
            h = self.__dict__["_hash"] = hash((self.model_stage, self.state, self.tensor))
        return h

    def __eq__(self, other) -> bool:
        if self is other:
            return True
        if other.__class__ is not StateKey:
            return NotImplemented
        return (self.model_stage, self.state, self.tensor) == (other.model_stage, other.state, other.tensor)

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}  # str hashes differ between processes

    @property
    def model(self) -> str:
        return self.model_stage.rpartition(".")[0]

    def __str__(self) -> str:
        return f"{self.model_stage}:{self.state}:{self.tensor}"


@dataclass(frozen=True)
class ShardSpec:
    """The box (half-open spans of every dimension of the full tensor) that one rank holds."""

    key: StateKey
    shape: tuple[int, ...]  # of the full tensor
    box: Box
    dtype: str  # an IR dtype name (``ir.model.DTYPE_BYTES``)

    @property
    def local_shape(self) -> tuple[int, ...]:
        return tuple(hi - lo for lo, hi in self.box)

    @property
    def numel(self) -> int:
        n = 1
        for lo, hi in self.box:
            n *= hi - lo
        return n

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


def state_dtype(m: Module, model: str, state: str) -> str:
    """Weights in the model's dtype; fp32 master weights and Adam moments in fp32."""
    return m.models[model].dtype if state == "weight" else "fp32"


def plan_layout(
    m: Module, plan: str, keys: dict[tuple[str, str, str], StateKey] | None = None
) -> dict[int, list[ShardSpec]]:
    """GPU -> the shards it holds under ``plan`` (from the module's EMUs of that plan), in EMU order.

    Every key is one object however many GPUs hold it (its hash computed once); ``keys``, when
    given, is the table of those objects, shared with the caller (the lowering: both plans' keys).
    """
    out: dict[int, list[ShardSpec]] = defaultdict(list)
    keys = {} if keys is None else keys
    for (p, ms, _dp), emu in sorted(m.emus.items()):
        if p != plan:
            continue
        model = m.models[ms.rpartition(".")[0]]
        for s in emu.shards:
            for e in s.entries:
                spec = model.tensors[e.family]
                layers = range(e.layers[0], e.layers[1] + 1) if e.layers is not None else [None]
                for layer in layers:
                    name = e.family if layer is None else f"layers.{layer}.{e.family}"
                    t = (ms, e.state, name)
                    key = keys.get(t)
                    if key is None:
                        key = keys[t] = StateKey(*t)
                    out[s.gpu].append(
                        ShardSpec(key, tuple(spec.shape), tuple(e.box), state_dtype(m, model.name, e.state))
                    )
    return dict(out)
