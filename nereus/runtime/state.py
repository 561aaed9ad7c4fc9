"""A live sharded state: what one rank holds of every model-stage under a plan, as tensors.

The shard vocabulary (``StateKey``, ``ShardSpec``, ``plan_layout``) is the backend's
(``nereus.backend.shards``); this module adds what needs torch: IR dtype names mapped to torch
dtypes (``torch_dtype``), deterministic full tensors for tests and benchmarks, and slicing.
"""

from __future__ import annotations

import torch

from ..backend.shards import ShardSpec, StateKey, plan_layout, state_dtype
from ..ir.emu import Box

__all__ = [
    "LocalState",
    "ShardSpec",
    "StateKey",
    "TORCH_DTYPES",
    "cut",
    "full_tensor",
    "hash_key",
    "plan_layout",
    "state_dtype",
    "synthetic_state",
    "torch_dtype",
]

# every dtype the IR accepts (``ir.model.DTYPE_BYTES``) has a torch dtype here; fp8 is E4M3, the
# format weights and activations are stored in (E5M2 is for gradients, which the IR does not name)
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of an IR dtype name (``bf16`` -> ``torch.bfloat16``)."""
    return TORCH_DTYPES[name]


LocalState = dict[StateKey, torch.Tensor]


def full_tensor(spec: ShardSpec, seed: int = 0) -> torch.Tensor:
    """A deterministic full tensor for ``spec.key`` (the same on every rank, and for every
    model-stage of one model: they hold the same weights): for tests and benchmarks."""
    g = torch.Generator().manual_seed(hash_key(spec.key) ^ seed)
    return torch.randn(spec.shape, generator=g, dtype=torch.float32).to(torch_dtype(spec.dtype))


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
