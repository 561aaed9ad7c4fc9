"""What every rank runs in the RL examples' tests: ``examples/grpo_tiny.py``'s (or ``ppo_tiny.py``'s) ``main`` with an
adapter that checks each move against the full state gathered and re-sliced."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import torch

from nereus.backend.shards import ShardSpec, plan_layout
from nereus.integrations.llama_adapter import JobAdapter
from nereus.integrations.llama_state import export_states
from nereus.runtime.execute import Fault
from nereus.runtime.state import cut

from .workers import gather_full

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


class CheckedAdapter(JobAdapter):
    """``JobAdapter`` that, around each move, gathers plan A's full state of every model (every
    rank: the default group is whole then) and checks, per model-stage, that this rank's plan B
    state is its slices, bit for bit, with AdamW's step carried over (a frozen model has none)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.checks: list[dict] = []
        self.regroup_checks: list[dict] = []

    def gpu(self) -> int:
        """This process's GPU id (its rank in the job's group until that is re-formed)."""
        rank = torch.distributed.get_rank(self.group)
        return rank if self.gpus is None else self.gpus[rank]

    def regroup(self, module, plan: str, gpus: list[int], group=None) -> None:
        """Every model's state under ``plan`` on this GPU before the default group was re-formed
        against after: the same shards, bit for bit, and the same AdamW steps."""
        before, steps = self.exported(module, plan)
        before = {k: v.clone() for k, v in before.items()}
        super().regroup(module, plan, gpus, *([group] if group is not None else []))
        after, steps_after = export_states(self.lives, module, plan)
        self.regroup_checks.append(
            {
                "gpus": list(gpus),
                "keys": len(before),
                "same_keys": set(before) == set(after),
                "exact": all(torch.equal(before[k], after[k]) for k in before if k in after),
                "steps": steps == steps_after,
            }
        )

    def specs(self, module, plan: str, rank: int) -> list:
        """This rank's shards of the live models under ``plan`` (not the engines')."""
        return [s for s in plan_layout(module, plan).get(rank, []) if s.key.model_stage in self.lives]

    def move(self, module, source, target, **kwargs) -> None:
        if kwargs.get("gpus") is not None:  # the default group was re-formed over the survivors of a failure
            self.gpus = list(kwargs["gpus"])
        rank = self.gpu()
        state_a, steps_a = self.exported(module, source)
        full = gather_full(state_a, self.specs(module, source, rank), self.group)
        try:
            super().move(module, source, target, **kwargs)
        except Exception as e:  # a rollback: plan A's state of every model must be as it was
            after, steps = export_states(self.lives, module, source)
            self.checks.append(
                {
                    "source": source,
                    "target": target,
                    "failed": type(e).__name__,
                    "steps_a": steps_a,
                    "intact": steps == steps_a
                    and all(
                        torch.equal(after[s.key], cut(full[s.key], s.box)) for s in self.specs(module, source, rank)
                    ),
                }
            )
            raise
        restore = kwargs.get("restore")
        ckpt_agrees = None
        if restore is not None:  # the survivors' gather lacks what only the dead held: it is the checkpoint's
            ckpt_agrees = from_checkpoint(full, restore)
        state_b, steps_b = export_states(self.lives, module, target)
        models = {}
        for ms, live in self.lives.items():
            specs = [s for s in self.specs(module, target, rank) if s.key.model_stage == ms]
            mine = {k for k in state_b if k.model_stage == ms}
            models[ms] = {
                "in_b": live.model is not None,
                "keys": len(specs),
                "states": sorted({s.key.state for s in specs}),
                "same_keys": mine == {s.key for s in specs},
                "exact": all(torch.equal(state_b[s.key], cut(full[s.key], s.box)) for s in specs),
            }
        self.checks.append(
            {
                "source": source,
                "target": target,
                "models": models,
                "steps_a": steps_a,
                "steps_b": steps_b,
                "restored": getattr(self, "restored", {}),
                "checkpoint_agrees": ckpt_agrees,
            }
        )


def from_checkpoint(full: dict, path: str) -> bool:
    """Fill the parts of the gathered full tensors that no survivor held (NaN) from the DCP
    checkpoint at ``path`` (every rank reads every tensor whole); whether the checkpoint equals the
    survivors' state everywhere they held it (a checkpoint of the state the failure found)."""
    from nereus.runtime import dcp

    specs = [ShardSpec(k, tuple(t.shape), tuple((0, n) for n in t.shape), "fp32") for k, t in sorted(full.items())]
    saved = dcp.load(path, specs, torch.distributed.get_rank(), torch.distributed.get_world_size())
    agrees = True
    for k, t in full.items():
        lost = torch.isnan(t)
        agrees &= torch.equal(saved[k][~lost], t[~lost])
        t[lost] = saved[k][lost]
    return bool(agrees)


def run(
    rank: int,
    world: int,
    argv: list[str],
    example: str = "grpo_tiny",
    fault_rank: int | None = None,
    fault: str = "raise",
) -> dict:
    """``examples/<example>.py``'s ``main`` (``grpo_tiny`` or ``ppo_tiny``) with ``CheckedAdapter``;
    ``fault_rank``: that rank raises inside every transition (``Fault("raise")``), or dies
    (``fault="kill"``: SIGKILL in the first)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    module = importlib.import_module(example)
    if fault_rank is None:
        return module.main(argv, adapter_cls=CheckedAdapter)
    return module.main(argv, adapter_cls=CheckedAdapter, faults=(Fault(fault, rank=fault_rank),))


def run_in_group(rank: int, world: int, argv: list[str]) -> dict:
    """The caller's world: ranks 1.. run ``grpo_tiny``'s loop in a process group of their own
    (``main(group=)``: the Controller, the models and every move inside it) with
    ``CheckedAdapter``; rank 0 is not in the job and all-reduces with rank 1, on a group of the
    world made before the job, at the start and at the end (rank 1 brings its last loss)."""
    import torch.distributed as dist

    from nereus.runtime.launch import init_from_env

    init_from_env(timeout=60)
    job = dist.new_group(list(range(1, world)))
    pair = dist.new_group([0, 1])
    out: dict = {"rank": rank}
    if rank in (0, 1):
        hello = torch.tensor([float(rank + 1)])
        dist.all_reduce(hello, group=pair)
        out["hello"] = float(hello)
    if rank > 0:
        if str(EXAMPLES) not in sys.path:
            sys.path.insert(0, str(EXAMPLES))
        out.update(importlib.import_module("grpo_tiny").main(argv, adapter_cls=CheckedAdapter, group=job))
    if rank in (0, 1):
        last = torch.tensor([out["history"][-1]["loss"] if rank == 1 else 0.0], dtype=torch.float64)
        dist.all_reduce(last, group=pair)
        out["bye"] = float(last)
    return out


def run_join(rank: int, world: int, argv: list[str], example: str = "grpo_tiny") -> dict:
    """``run`` on the job's ranks; on a process started to join it (``NEREUS_JOIN``), the same
    example with ``--join``. The job's ranks start once the join request is in the job's store:
    the joiner imports and builds as long as the job's first steps take, and on a loaded machine
    it asked only after the job had ended (seen in CI: the joiner waited out the test's timeout)."""
    import os
    import time

    if os.environ.get("NEREUS_JOIN"):
        return run(rank, world, argv + ["--join"], example)
    from nereus.runtime.regroup import job_store, waiting

    store, deadline = job_store(60), time.monotonic() + 120
    while waiting(store) < 1:
        if time.monotonic() > deadline:
            raise TimeoutError("no process asked to join within 120 s")
        time.sleep(0.05)
    return run(rank, world, argv, example)
