"""A live sharded state: what one rank holds of every model-stage under a plan.

The runtime's unit is one tensor as a training loop names it (Hugging Face names, one tensor per
layer: ``layers.3.mlp.up_proj.weight``), not the IR's per-family slice entries that cover a
layer range. A ``StateKey`` names the model-stage, the state (``weight``, ``master``,
``exp_avg``, ``exp_avg_sq``) and the tensor; a ``ShardSpec`` says which box of the full tensor
a rank holds and in which dtype. ``plan_layout`` expands a plan's EMUs into these specs, rank by
rank, so that a user's state dict, a DCP checkpoint, a DTensor and a collective program all
speak of the same slices.

Ranks are the GPUs of the cluster in order (``rank_of``): rank r runs on GPU id r of the
plan's cluster, as ``torchrun`` numbers one process per GPU.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from ..ir import Module
from ..ir.emu import Box

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True, order=True)
class StateKey:
    model_stage: str  # e.g. actor.train
    state: str  # weight | master | exp_avg | exp_avg_sq
    tensor: str  # e.g. layers.3.mlp.up_proj.weight

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
    dtype: torch.dtype

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
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


LocalState = dict[StateKey, torch.Tensor]


def state_dtype(m: Module, model: str, state: str) -> torch.dtype:
    """Weights in the model's dtype; fp32 master weights and Adam moments in fp32."""
    return TORCH_DTYPES[m.models[model].dtype] if state == "weight" else torch.float32


def plan_layout(m: Module, plan: str) -> dict[int, list[ShardSpec]]:
    """GPU -> the shards it holds under ``plan`` (from the module's EMUs of that plan), in EMU order."""
    out: dict[int, list[ShardSpec]] = defaultdict(list)
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
                    out[s.gpu].append(ShardSpec(StateKey(ms, e.state, name), tuple(spec.shape), tuple(e.box),
                                                state_dtype(m, model.name, e.state)))
    return dict(out)


def full_tensor(spec: ShardSpec, seed: int = 0) -> torch.Tensor:
    """A deterministic full tensor for ``spec.key`` (the same on every rank, and for every
    model-stage of one model: they hold the same weights): for tests and benchmarks."""
    g = torch.Generator().manual_seed(hash_key(spec.key) ^ seed)
    return torch.randn(spec.shape, generator=g, dtype=torch.float32).to(spec.dtype)


def hash_key(key: StateKey) -> int:
    """A stable 62-bit hash of a key's model, state and tensor (Python's ``hash`` of a string
    changes between processes)."""
    h = 1469598103934665603
    for ch in f"{key.model}:{key.state}:{key.tensor}".encode():
        h = ((h ^ ch) * 1099511628211) & ((1 << 62) - 1)
    return h


def cut(full: torch.Tensor, box: Box) -> torch.Tensor:
    return full[tuple(slice(lo, hi) for lo, hi in box)]


def synthetic_state(specs: list[ShardSpec], seed: int = 0) -> LocalState:
    """This rank's shards of deterministic full tensors (``full_tensor``), each its own tensor
    (a clone: a view would keep the whole full tensor alive)."""
    return {s.key: cut(full_tensor(s, seed), s.box).clone() for s in specs}
