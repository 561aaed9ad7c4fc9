"""Move a live RL job's HF Llamas (+ AdamW) from plan A's layouts to plan B's with one Nereus transition.

``reshard_job({"actor.train": actor, "ref.infer": ref}, module, "a", "b")`` (``reshard_llama``
for one model), on every rank of the default group:

1. ``check_layout`` on plan B, for every model-stage: where a live model cannot take its
   layout, a ``DiagnosticError`` naming the model-stage before any state moves (and before any
   collective: every rank raises the same);
2. plan (``plan-transition`` with ``drain=true``: a rank plan B does not use is alive and sends
   what it holds; unless the module holds the transition) and lower it (``move.plan_move``);
3. build plan B's models and optimizers (``hf_llama.build``: groups of their own, created
   through the store; a frozen model gets none) and agree on each model's AdamW step (one
   all-reduce; ranks off a model's plan-A layout hold none);
4. ``execute`` the one program with every model's plan-A shards (views of the live tensors) as
   input and plan B's live tensors as ``out``: the bytes land in the new models directly;
5. ``load_state`` per model: checks ``master`` against ``weight`` and sets the step.

What is exact: after a successful call the new models and optimizers hold bit-for-bit the values
plan A's held (``execute`` copies bytes), so training continues as a model built under plan B
from the same full state would. On failure in 4 ``execute`` raises ``TransitionError`` on every
surviving rank and every live model is untouched (its tensors were only read): the caller goes on with
it, on its own TP and DP groups (``hf_llama.private_mesh``). The default group is another
matter: on gloo a receive that timed out closes its connection, so after any failed transition
the default group must be re-created before the next ``reshard_llama`` (the executor's contract),
which this module does not do.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..backend.shards import plan_layout
from ..ir import DiagnosticError, Module
from ..runtime.dcp import restore_lost
from ..runtime.execute import Fault, execute
from .hf_llama import LiveLlama, build, ir_model
from .job import restrict
from .llama_state import buffers, check_layout, export_states, load_state
from .move import plan_move


def same_model(live: LiveLlama, module: Module) -> None:
    """The module's model is the live model's config (the fields the inventory depends on)."""
    theirs, ours = module.models[live.layout.model], ir_model(live.config, live.layout.model, head=live.head)
    fields = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "hd", "tied_embeddings", "head")
    diff = [f"{f} {getattr(theirs, f)} != {getattr(ours, f)}" for f in fields if getattr(theirs, f) != getattr(ours, f)]
    if diff:
        raise ValueError(f"model @{theirs.name} in the module is not the live model: {', '.join(diff)}")


def reshard_job(
    lives: dict[str, LiveLlama],
    module: Module,
    plan_a: str,
    plan_b: str,
    *,
    transition: str | None = None,
    timeout: float = 60.0,
    faults: tuple[Fault, ...] = (),
    seed: int = 0,
    elsewhere: frozenset[str] = frozenset(),
    gpus: list[int] | None = None,
    restore: str | None = None,
    restored: dict | None = None,
    exported: tuple | None = None,
    group: dist.ProcessGroup | None = None,
) -> dict[str, LiveLlama]:
    """This rank's live models under plan B, one per model-stage of ``lives`` (``actor.train``,
    ``ref.infer``, ``critic.train``), holding plan A's state; see the module docstring. One
    transition moves every model at once: one program (the transition's, which orders the
    models' transfers together), one ``execute`` over the union of their shards. ``lives`` run
    under plan A and are untouched on failure. ``faults`` are passed to ``execute`` (tests).
    ``elsewhere``: model-stages of the plans that another component moves (the generation
    engines, ``engine_stage``); the transition is then planned on the job without them
    (``job.restrict``), so that no live model's shard comes from, or goes to, them. ``gpus``: the
    GPU id of each rank of the default group (None: rank r is GPU r), as after
    ``runtime.regroup.reform``; plan A's and plan B's GPUs are the plans' own. ``restore``: the
    DCP checkpoint that the parts of plan B no GPU of the group holds come from (the transition
    was planned with ``restore``: their GPUs died); ``restored`` gets the bytes read, by FQN.
    ``exported``: plan A's state and AdamW steps of this rank, taken before the live models were
    dropped (``JobAdapter.detach``), in place of the live models'. ``group``: the process group
    the job runs on (None: the default group; ``gpus`` are then the GPUs of its ranks): every
    collective of the move and of plan B's models is made inside it, the move's broadcasts as
    chains of point-to-point messages (``execute`` makes no subgroups in a group of some ranks)."""
    for live in lives.values():
        same_model(live, module)
    problems = []
    for ms in lives:  # every model-stage is checked before any state moves or any group is made
        try:
            check_layout(module, plan_b, ms)
        except DiagnosticError as e:
            problems += e.diagnostics
    if problems:  # all of them at once
        raise DiagnosticError(problems)
    missing = sorted(set(module.plans[plan_b].layouts) - set(lives) - set(elsewhere))
    if missing:
        raise ValueError(f"plan @{plan_b} has model-stages with no live model: {', '.join(missing)}")
    if elsewhere:
        module, transition = restrict(module, set(lives)), None
    program = plan_move(  # before building plan B: a bad plan raises first
        module,
        plan_a,
        plan_b,
        transition,
        dist.get_world_size(group),
        gpus=gpus,
        broadcast="auto" if group is None else "chain",
    )
    targets = {
        ms: build(
            live.config,
            module.plans[plan_b].layouts[ms],
            seed=seed,
            adamw=live.adamw,
            timeout=timeout,
            trained=module.models[live.layout.model].trained,
            head=live.head,
            gpus=gpus,
            group=group,
        )
        for ms, live in lives.items()
    }
    state, held = exported if exported is not None else export_states(lives, module, plan_a)
    steps = torch.tensor([held[ms] for ms in lives], dtype=torch.int64)
    dist.all_reduce(steps, op=dist.ReduceOp.MAX, group=group)  # ranks off a model's plan-A layout hold no step
    out = {k: v for target in targets.values() for k, v in buffers(target, module, plan_b).items()}
    new = execute(program, state, timeout=timeout, faults=faults, out=out, restore=restore is not None, group=group)
    if restore is not None:  # what only the dead held, from the checkpoint; the rest came from memory
        group_gpus = gpus if gpus is not None else list(range(dist.get_world_size(group)))
        lay_a, lay_b = plan_layout(module, plan_a), plan_layout(module, plan_b)
        held = [s for g in group_gpus for s in lay_a.get(g, []) if s.key.model_stage in lives]
        mine = [s for s in lay_b.get(group_gpus[dist.get_rank(group)], []) if s.key.model_stage in lives]
        read = restore_lost(restore, new, mine, held, group=group)
        if restored is not None:
            restored.update(read)
    for i, target in enumerate(targets.values()):
        load_state(target, module, plan_b, new, int(steps[i]))
    return targets


def reshard_llama(live: LiveLlama, module: Module, plan_a: str, plan_b: str, **move) -> LiveLlama:
    """``reshard_job`` of a one-model job (``move``: its keyword options): this rank's live model
    and optimizer under plan B."""
    ms = live.layout.model_stage
    return reshard_job({ms: live}, module, plan_a, plan_b, **move)[ms]
