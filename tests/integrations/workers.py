"""What every rank runs (``run_local``) in the HF Llama integration tests; importable by spawned processes.

Each worker builds a tiny seeded ``LlamaForCausalLM`` under an IR layout, trains it with AdamW on
gloo and returns plain data (numpy arrays, floats, strings) for the test process to check.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig

from nereus.backend.shards import plan_layout
from nereus.integrations.hf_llama import batch, build, ir_model, train_step
from nereus.integrations.job import layout, training_job
from nereus.integrations.llama_reshard import reshard_llama
from nereus.integrations.llama_state import check_layout, export_state, load_state
from nereus.ir import DiagnosticError
from nereus.runtime.execute import Fault, TransitionError
from nereus.runtime.launch import init_from_env
from nereus.runtime.state import cut

SEED = 7
MS = "actor.train"


def tiny(kv_heads: int = 2) -> dict:
    """A tiny Llama config (as a dict, to travel to the workers): 2 layers, hidden 64, 4 heads."""
    return dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        tie_word_embeddings=False,
        max_position_embeddings=64,
    )


def job_of(cfg: dict, plans: dict[str, tuple], world: int):
    """The config, and the module with a plan per (tp, dp), (tp, dp, mesh) or (tp, dp, mesh, pp),
    on a node of at least ``world`` GPUs (a plan that is only checked, never run, may use more
    GPUs than the process group has)."""
    config = LlamaConfig(**cfg)
    model = ir_model(config)

    def lay(tp, dp, mesh=None, pp=1):
        return layout(model, tp=tp, dp=dp, pp=pp, mesh=mesh)

    layouts = {name: lay(*p) for name, p in plans.items()}
    gpus = max([world, *(lay.world for lay in layouts.values())])
    return config, training_job(model, layouts, gpus)


def shards(state) -> dict:
    """A LocalState as {str(key): numpy array} (numpy pickles by value across processes)."""
    return {str(k): v.detach().clone().numpy() for k, v in state.items()}


def gather_full(state, specs, group=None) -> dict:
    """The full tensor of every key, assembled from every rank's shards (``specs``: this rank's)
    over ``group`` (None: the default group)."""
    mine = [(s.key, s.shape, s.box, state[s.key].detach().clone()) for s in specs]
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    full = {}
    for part in every:
        for k, shape, box, v in part:
            t = full.setdefault(k, torch.full(shape, float("nan")))
            t[tuple(slice(lo, hi) for lo, hi in box)] = v
    return full


def full_by_dtensor(live) -> dict:
    """Every parameter and AdamW state of this rank's stage as DTensor gathers it
    (``full_tensor``: the TP shards of this rank's replica, with the placements
    ``parallelize_module`` gave them; under DDP the live tensors are the local shards), keyed
    like a StateKey: a check of the export that owes nothing to IR boxes."""
    out = {}
    for name, p in live.params().items():
        held = live.optimizer.state[p]
        for state, t in (("weight", p), ("exp_avg", held["exp_avg"]), ("exp_avg_sq", held["exp_avg_sq"])):
            placed = live.placements[name]
            if placed is not None and not isinstance(t, DTensor):
                t = DTensor.from_local(t.detach(), live.mesh["tp"], placed, run_check=False)
            full = t.full_tensor() if isinstance(t, DTensor) else t
            out[f"{MS}:{state}:{name}"] = full.detach().clone().numpy()
    return out


def continuity(
    rank: int,
    world: int,
    cfg: dict,
    a: tuple,
    b: tuple,
    k: int,
    n: int,
    bad: tuple | None = None,
    c: tuple | None = None,
) -> dict:
    """k steps under plan A, the transition to B, n more steps three ways: the moved model, one
    restarted under B from the full state sliced, and plan A's model that never moved. With
    ``c`` (a plan on fewer ranks), the moved model then goes to plan C (the other ranks leave,
    sending what they hold). With ``bad`` (a (tp, dp) the live model cannot take), ``rollback``
    on plan A's model last (it leaves the default group unusable)."""
    init_from_env(timeout=60)
    extra = {**({"bad": bad} if bad else {}), **({"c": c} if c else {})}
    config, job = job_of(cfg, {"a": a, "b": b, **extra}, world)
    check_layout(job, "a", MS)
    live = build(config, job.plans["a"].layouts[MS], seed=SEED, timeout=30)
    losses_a = [train_step(live, batch(config, s, seed=SEED)) for s in range(k)]
    state_a, step_a = export_state(live, job, "a")
    out = {"a": shards(state_a), "step_a": step_a, "losses_a": losses_a, "dtensor_full": full_by_dtensor(live)}

    moved = reshard_llama(live, job, "a", "b", timeout=30, seed=SEED + 1)  # another init: values must come from A
    state_b, step_b = export_state(moved, job, "b")
    out.update(b=shards(state_b), step_b=step_b)

    full = gather_full(state_a, plan_layout(job, "a")[rank])
    restart = build(config, job.plans["b"].layouts[MS], seed=SEED + 2, timeout=30)
    sliced = {s.key: cut(full[s.key], s.box).clone() for s in plan_layout(job, "b")[rank]}
    load_state(restart, job, "b", sliced, step_a)
    out["moved"] = [train_step(moved, batch(config, s, seed=SEED)) for s in range(k, k + n)]
    out["restart"] = [train_step(restart, batch(config, s, seed=SEED)) for s in range(k, k + n)]
    out["stay"] = [train_step(live, batch(config, s, seed=SEED)) for s in range(k, k + n)]
    end_moved, end_restart = export_state(moved, job, "b"), export_state(restart, job, "b")
    out["end_differs"] = [str(key) for key, v in end_moved[0].items() if not torch.equal(v, end_restart[0][key])]
    out["end_steps"] = (end_moved[1], end_restart[1])
    if c:
        out["b_end"] = shards(end_moved[0])
        shrunk = reshard_llama(moved, job, "b", "c", timeout=30)
        state_c, step_c = export_state(shrunk, job, "c")
        out.update(
            c=shards(state_c),
            step_c=step_c,
            in_c=shrunk.model is not None,
            loss_c=train_step(shrunk, batch(config, k + n, seed=SEED)) if shrunk.model is not None else None,
        )
    if bad:
        out["rollback"] = rollback(live, job, config, k + n)
    return out


def rollback(live, job, config, steps: int) -> dict:
    """Plan A's model after ``steps`` steps: a layout it cannot take (plan @bad: a diagnostic), a
    transition to plan B that fails on rank 1 (rollback), then one more step under plan A beside
    a model that trained as many steps and never attempted anything.

    No transition follows the failure: the default group saw a failed program (on gloo the
    timed-out receive closes the pair); the executor's contract is to re-create it first. The
    live model's TP and DP groups are its own (``private_mesh``) and go on."""
    state, step = export_state(live, job, "a")
    before = {key: (v.data_ptr(), v.clone()) for key, v in state.items()}
    planned = sorted(job.transitions)
    out = {"diagnostic": None, "transition_error": None}
    try:
        reshard_llama(live, job, "a", "bad", timeout=30)
    except DiagnosticError as e:
        out["diagnostic"] = str(e)
    out["nothing_planned"] = sorted(job.transitions) == planned
    try:
        reshard_llama(live, job, "a", "b", timeout=3, faults=(Fault("raise", rank=1),))
    except TransitionError as e:
        out["transition_error"] = (str(e), e.failed_ranks, e.unresponsive)
    after, step_after = export_state(live, job, "a")
    out["intact"] = (
        step_after == step
        and set(after) == set(before)
        and all(after[key].data_ptr() == p and torch.equal(after[key], v) for key, (p, v) in before.items())
    )
    out["loss_after"] = train_step(live, batch(config, steps, seed=SEED))
    control = build(config, job.plans["a"].layouts[MS], seed=SEED, timeout=30)
    out["loss_control"] = [train_step(control, batch(config, s, seed=SEED)) for s in range(steps + 1)][-1]
    return out
