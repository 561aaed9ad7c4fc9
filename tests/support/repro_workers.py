"""Rank functions for the runtime repros (tests/runtime/repros/*.nir): each file names in its
header the pipeline to plan with, the lowering options and the executor's options."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

import nereus
from nereus.backend.lower import lower, pick_transition
from nereus.runtime.execute import TransitionError, execute
from nereus.runtime.launch import init_from_env
from nereus.runtime.state import cut, full_tensor, synthetic_state


def header(text: str, key: str) -> str:
    for line in text.splitlines():
        if line.startswith(f"// {key}:"):
            return line.split(":", 1)[1].strip()
    raise KeyError(key)


def program_of(path: str):
    text = Path(path).read_text()
    m = nereus.run_pipeline(nereus.parse(text, path), header(text, "pipeline"))
    return lower(m, pick_transition(m), **json.loads(header(text, "lower")))


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def run_repro(rank: int, world: int, path: str, dead: int | None, timeout: float) -> dict:
    """Execute the repro's program; rank ``dead`` exits before execute. Reports what this rank
    saw, how long execute took, and whether its result (or its plan-A state) is bit-exact."""
    init_from_env(timeout=60)
    prog = program_of(path)
    if rank == dead:
        os._exit(3)
    state = synthetic_state(prog.src.get(rank, []))
    before = {k: as_bytes(v).clone() for k, v in state.items()}
    t0 = time.perf_counter()
    try:
        new = execute(prog, state, timeout=timeout)
        error = None
    except TransitionError as e:
        new, error = None, e
    elapsed = time.perf_counter() - t0
    intact = all(torch.equal(as_bytes(state[k]), b) for k, b in before.items())
    exact = new is not None and all(
        new[s.key].dtype == cut(full_tensor(s), s.box).dtype
        and torch.equal(as_bytes(new[s.key]), as_bytes(cut(full_tensor(s), s.box)))
        for s in prog.dst.get(rank, [])
    )
    return {
        "elapsed": elapsed,
        "groups": len(prog.groups),
        "intact": intact,
        "exact": exact,
        "error": None
        if error is None
        else {
            "text": str(error),
            "rank": error.rank,
            "failed": error.failed_ranks,
            "unresponsive": error.unresponsive,
            "intact": error.state_intact,
        },
    }


def run_mismatched_programs(rank: int, world: int, path: str) -> dict:
    """Rank 1 lowers with another bucket size than the others: every rank must refuse, naming it."""
    init_from_env(timeout=60)
    text = Path(path).read_text()
    m = nereus.run_pipeline(nereus.parse(text, path), header(text, "pipeline"))
    prog = lower(m, pick_transition(m), bucket_bytes=4096 if rank == 1 else 8192)
    state = synthetic_state(prog.src.get(rank, []))
    try:
        execute(prog, state, timeout=20)
        return {"error": None}
    except TransitionError as e:
        return {"error": str(e), "failed": e.failed_ranks}
