"""Move a live HF Llama + AdamW from plan A's layout to plan B's with a Nereus transition.

``reshard_llama(live, module, "a", "b")``, on every rank of the default group:

1. ``check_layout`` on plan B: where the live model cannot take it, a ``DiagnosticError``
   before any state moves (and before any collective: every rank raises the same);
2. plan (``plan-transition`` with ``drain=true``: a rank plan B does not use is alive and sends
   what it holds; unless the module holds the transition) and lower it (``move.plan_move``);
3. build plan B's model and optimizer (``hf_llama.build``: groups of its own, created through
   the store) and agree on AdamW's step (an all-reduce; ranks off plan A hold none);
4. ``execute`` the program with plan A's exported shards (views of the live tensors) as input
   and plan B's live tensors as ``out``: the bytes land in the new model directly;
5. ``load_state``: checks ``master`` against ``weight`` and sets the step.

What is exact: after a successful call the new model and optimizer hold bit-for-bit the values
plan A's held (``execute`` copies bytes), so training continues as a model built under plan B
from the same full state would. On failure in 4 ``execute`` raises ``TransitionError`` on every
surviving rank and ``live`` is untouched (its tensors were only read): the caller goes on with
it, on its own TP and DP groups (``hf_llama.private_mesh``). The default group is another
matter: on gloo a receive that timed out closes its connection, so after any failed transition
the default group must be re-created before the next ``reshard_llama`` (the executor's contract),
which this module does not do.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..ir import Module
from ..runtime.execute import Fault, execute
from .hf_llama import LiveLlama, build, ir_model
from .llama_state import buffers, check_layout, export_state, load_state
from .move import plan_move


def same_model(live: LiveLlama, module: Module) -> None:
    """The module's model is the live model's config (the fields the inventory depends on)."""
    theirs, ours = module.models[live.layout.model], ir_model(live.config, live.layout.model)
    fields = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "hd", "tied_embeddings")
    diff = [f"{f} {getattr(theirs, f)} != {getattr(ours, f)}" for f in fields if getattr(theirs, f) != getattr(ours, f)]
    if diff:
        raise ValueError(f"model @{theirs.name} in the module is not the live model: {', '.join(diff)}")


def reshard_llama(
    live: LiveLlama,
    module: Module,
    plan_a: str,
    plan_b: str,
    *,
    transition: str | None = None,
    timeout: float = 60.0,
    faults: tuple[Fault, ...] = (),
    seed: int = 0,
) -> LiveLlama:
    """This rank's live model and optimizer under plan B, holding plan A's state; see the module
    docstring. ``live`` runs under plan A; ``faults`` are passed to ``execute`` (tests)."""
    ms = live.layout.model_stage
    same_model(live, module)
    check_layout(module, plan_b, ms)
    program = plan_move(module, plan_a, plan_b, transition)  # before building plan B: a bad plan raises first
    target = build(live.config, module.plans[plan_b].layouts[ms], seed=seed, adamw=live.adamw, timeout=timeout)
    state, step = export_state(live, module, plan_a)
    steps = torch.tensor([step], dtype=torch.int64)
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    new = execute(program, state, timeout=timeout, faults=faults, out=buffers(target, module, plan_b))
    load_state(target, module, plan_b, new, int(steps))
    return target
