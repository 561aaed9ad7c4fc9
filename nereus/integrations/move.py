"""One way every integration moves state: plan the transition where the module has none, lower
it, run it on this rank's tensors.

``plan_move(module, a, b)`` is ``plan-transition{source=@a,to=@b,into=@NAME,drain=true}``
through the pass manager (``drain``: a rank that plan B does not use is alive and sends what it
holds; skipped where the module already holds the transition, as the decision core's) and
``lower`` over ranks 0..world-1 (rank r = GPU r): a pure function of the module, so every rank
gets the same program. ``move(module, a, b, state, out=...)`` runs it with ``execute``. The
reshard of a live Llama (``reshard.py``), of a state dict (``move_state.py``), the weight push
(``weight_push.py``) and the Controller all go through here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..backend.lower import lower
from ..backend.program import Program
from ..backend.shards import StateKey
from ..ir import Module
from ..registry import run_pipeline
from ..runtime.execute import execute


def plan_move(
    module: Module,
    source: str,
    target: str,
    transition: str | None = None,
    world: int | None = None,
    gpus: list[int] | None = None,
    broadcast: str = "auto",
    waves: int = 1,
) -> Program:
    """The lowered program of the move from plan ``source`` to ``target`` (named ``transition``,
    default ``source_to_target``), planned first where the module does not hold it. Rank ``r``
    is GPU ``gpus[r]`` (default: GPU ``r`` of ``world``, the default group's size): a process
    group of the ranks that remain after a shrink passes its members. ``broadcast``: ``lower``'s
    (``"chain"`` or ``"p2p"`` for a program that runs in a process group of some ranks, which
    makes no subgroups). ``waves``: ``lower``'s (the messages in that many rounds, in the order
    an engine loads the model)."""
    name = transition or f"{source}_to_{target}"
    if name not in module.transitions:
        run_pipeline(module, f"plan-transition{{source=@{source},to=@{target},into=@{name},drain=true}}")
    if gpus is None:
        gpus = list(range(dist.get_world_size() if world is None else world))
    return lower(module, name, gpus=list(gpus), broadcast=broadcast, waves=waves)


def move(
    module: Module,
    source: str,
    target: str,
    state: dict[StateKey, torch.Tensor],
    *,
    transition: str | None = None,
    out: dict[StateKey, torch.Tensor] | None = None,
    **run,
) -> dict[StateKey, torch.Tensor]:
    """This rank's state under plan ``target`` from its ``state`` under ``source``: ``plan_move``,
    then ``execute`` (``out``: plan B's buffers to fill in place; ``run``: ``execute``'s timeout,
    faults, device, stats)."""
    return execute(plan_move(module, source, target, transition), state, out=out, **run)
