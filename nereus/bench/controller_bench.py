"""``nereus bench controller``: what the Controller costs inside a real RL job of four models, and
the whole job's move inside the loop beside the way users change layout today (DCP save, then load).

4 gloo processes of this machine run one IR job of four Hugging Face Llamas (built from a config,
seeded; ``nereus.integrations.hf_llama``), each under its own layout of the plan, TP 2 x DP 2
to start: the actor (``actor.train``: LM loss, AdamW), the critic (``critic.train``: a value
head, AdamW), the reference (``ref.infer``, frozen) and the reward model (``reward.infer``, a
frozen value head). The Controller is around every step (``JobAdapter``: every model moved by
one transition; search limited to what the live models take). Per rank:

- ``step``: one step of the job (the actor's and the critic's forward, backward, DP all-reduce
  and AdamW; the reference's and the reward model's forward) without the Controller, and
  ``with_controller``: the same step inside ``ctl.step()``, each model-stage timed (every decision a
  stay: one ``all_gather`` of a fixed-size tensor of measurements, the decision on the leader,
  one broadcast of a number); blocks of steps of each kind alternate after two warm-up steps,
  wall time between barriers per step, the median over blocks. ``controller`` is the
  difference: what the Controller adds when it stays. That difference is two noisy medians
  apart; ``own_s`` measures the same cost directly: the seconds each rank spends in the
  Controller's end of step (``Controller.end_of_step_s``: the gather, the decision, the
  broadcast), the median over the steps, the slowest rank's. On both sides every step ends at a
  barrier, so the ranks reach the Controller together: without it the gather would also wait
  for the slowest rank (4 processes on 2 cores drift by 10-20 ms a step), time a loop without
  the Controller spends at its next collective instead;
- at step ``leave_step`` rank 3 announces it leaves: the forced decision (``decide_s``: triggers,
  plan-search, remap, plan-transition, schedule-transfers, admit on the leader) and the move
  inside the loop (``move_s``: plan B's four models built, the one transition lowered and
  executed into them, AdamW's steps carried);
- the same move the DCP way, on the same processes and the same plan-A state of all four models:
  every rank saves it with ``torch.distributed.checkpoint`` before the leave (``dcp_save_s``), and
  after it the remaining ranks load plan B's boxes (``nereus.runtime.dcp``), build plan B's four
  models and load them (``dcp_load_s``); ``dcp_s`` is the sum.

Times are the slowest rank's; 4 processes share this machine's 2 cores, so the ranks also wait
for each other at every collective, with or without the Controller.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from ..backend.shards import plan_layout
from ..control import ControlOptions
from ..control.decide import layout_changes
from ..integrations.controller import Controller
from ..integrations.hf_llama import batch, build, forward, ir_model, llama_config, optimize, train_step
from ..integrations.job import layout, rl_job, training_job
from ..integrations.llama_adapter import JobAdapter
from ..integrations.llama_state import export_states, load_state
from ..integrations.stage_data import rows
from ..ir import Model
from ..runtime.dcp import load, save
from ..runtime.launch import init_from_env, run_local

WORLD = 4
ROWS = 12  # splits over DP 4, and DP 3 after a rank left


# the job's four models: (name, stage, head, trained)
MODELS = (
    ("actor", "train", "lm", True),
    ("critic", "train", "value", True),
    ("ref", "infer", "lm", False),
    ("reward", "infer", "value", False),
)


def _model(
    hidden: int, layers: int, name: str = "actor", head: str = "lm", trained: bool = True, vocab: int = 1024
) -> Model:
    """A tiny Llama-shaped model of the benchmarks (8 heads, 4 KV heads, ffn 11/4 of hidden)."""
    return Model(
        name=name,
        layers=layers,
        hidden=hidden,
        heads=8,
        kv_heads=4,
        ffn=hidden * 11 // 4,
        vocab=vocab,
        dtype="fp32",
        head=head,
        trained=trained,
    )


def value_loss(values, target):
    return 0.5 * ((values.squeeze(-1) - target) ** 2).mean()


def job_step(lives: dict, tokens, ctl=None) -> None:
    """One step of the four models on the global batch ``tokens`` (each replica its DP share),
    every model-stage timed by ``ctl`` when given."""
    for ms, live in lives.items():
        timed = ctl.stage(ms) if ctl is not None else contextlib.nullcontext()
        with timed:
            if live.model is None:
                continue
            mine = tokens[rows(live, len(tokens))]
            if ms == "actor.train":
                train_step(live, tokens)
            elif ms == "critic.train":
                optimize(live, mine, (mine % 7).float(), value_loss)
            else:
                forward(live, mine)


def worker(rank: int, world: int, hidden: int, layers: int, steps: tuple[int, int], tmp: str) -> dict:
    init_from_env(timeout=600)
    models = {name: _model(hidden, layers, name, head, trained) for name, _, head, trained in MODELS}
    config = llama_config(models["actor"])
    assert ir_model(config, "actor") == models["actor"]
    module = rl_job(
        list(models.values()),
        {"a": [layout(models[name], tp=2, dp=2, stage=stage) for name, stage, _, _ in MODELS]},
        world,
        rows=ROWS,
        seq=64,
        algorithm="ppo",
    )
    a = module.plans["a"].layouts
    plan_a = copy.deepcopy(module.plans["a"])  # the core drops plan A once it commits plan B

    def lives_of(plan_layouts) -> dict:
        return {
            f"{name}.{stage}": build(
                config, plan_layouts[f"{name}.{stage}"], seed=0, head=head, trained=trained, timeout=300
            )
            for name, stage, head, trained in MODELS
        }

    adapter = JobAdapter(lives_of(a), module, "a")
    options = ControlOptions(
        recalibrate_every=0,
        slowdown=1e9,
        response_drift=1e9,
        max_pp=1,
        max_zero=0,
        offload=False,
        search_time_limit=5.0,
        schedule_time_limit=1.0,
    )
    ctl = Controller(module, "a", adapter, options=options, total_steps=1000, show=False, timeout=300)
    out: dict = {}
    blocks, size = steps
    tokens = iter([batch(config, i, rows=ROWS, seq=64) for i in range(2 * blocks * size + 3)])
    for _ in range(2):  # warm-up: first allocations, first collectives
        job_step(adapter.lives, next(tokens))
    plain, inside, own, stays = [], [], [], 0
    for _ in range(blocks):  # blocks of steps without and with the Controller, alternating
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(size):
            job_step(adapter.lives, next(tokens))
            dist.barrier()  # the ranks aligned at every step's end, on both sides
        dist.barrier()
        t1 = time.perf_counter()
        for _ in range(size):
            with ctl.step():
                job_step(adapter.lives, next(tokens), ctl)
                dist.barrier()
            stays += ctl.last.action == "stay" and not ctl.last.triggers
            own.append(ctl.end_of_step_s)
        dist.barrier()
        t2 = time.perf_counter()
        plain.append((t1 - t0) / size)
        inside.append((t2 - t1) / size)
    out.update(
        step_s=statistics.median(plain),
        with_controller_s=statistics.median(inside),
        stays=stays,
        own_s=statistics.median(own),
        own_p90_s=sorted(own)[int(0.9 * (len(own) - 1))],
    )
    # the DCP way, first half: every rank of plan A saves its state of the four models (as a user
    # does before restarting without the rank that leaves), on the default group of all ranks
    state, opt_steps = export_states(adapter.lives, module, "a")
    saved = {k: v.clone() for k, v in state.items()}
    dist.barrier()
    t0 = time.perf_counter()
    save(saved, plan_layout(module, "a").get(rank, []), f"{tmp}/ckpt", rank, world)
    dist.barrier()
    out["dcp_save_s"] = time.perf_counter() - t0
    # rank 3 announces it leaves: a forced decision and the move inside the loop
    with ctl.step():
        job_step(adapter.lives, next(tokens), ctl)
        if rank == world - 1:
            ctl.leave()
    d = ctl.last
    if d.action != "transition":
        raise RuntimeError(f"the leave was not applied: {d.action} ({d.message})")
    out.update(
        decide_s=d.numbers.get("decide_s"),
        move_s=d.numbers.get("execute_s"),
        target=d.target,
        bytes_moved=d.numbers.get("bytes_moved"),
        models=sorted(adapter.lives),
        changed=sorted(layout_changes(plan_a, ctl.core.m.plans[ctl.plan])),
    )
    if rank == world - 1:  # it left: the job's default group is re-formed without it
        return out
    # the DCP way, second half: the remaining ranks load plan B's boxes and build plan B's models,
    # on the default group the move re-formed over them (ranks 0..2, as before)
    left = dist.get_world_size()
    plan_b = ctl.plan
    box = [plan_b]
    dist.broadcast_object_list(box, src=0)
    plan_b = box[0]
    b_module = ctl.core.m if rank == 0 else None
    box = [b_module]
    dist.broadcast_object_list(box, src=0)
    b_module = box[0]
    steps = torch.tensor([opt_steps[ms] for ms in sorted(opt_steps)], dtype=torch.int64)
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)  # as the move agrees on them
    dist.barrier()
    t0 = time.perf_counter()
    new = load(f"{tmp}/ckpt", plan_layout(b_module, plan_b).get(rank, []), rank, left)
    fresh = lives_of(b_module.plans[plan_b].layouts)
    for step, ms in zip(steps.tolist(), sorted(opt_steps)):
        load_state(fresh[ms], b_module, plan_b, new, step)
    dist.barrier()
    out["dcp_load_s"] = time.perf_counter() - t0
    out["dcp_s"] = out["dcp_save_s"] + out["dcp_load_s"]
    out["controller_s"] = out["with_controller_s"] - out["step_s"]
    return out


def end_of_step(rank: int, world: int, steps: int) -> float:
    """The Controller's end of step when it stays, alone: ``world`` processes, one model-stage
    timed around a 10 ms sleep, every step ending at a barrier; the median over ``steps``
    (after 20 warm-up steps) of ``Controller.end_of_step_s``."""
    init_from_env(timeout=120)
    model = _model(128, 2)
    module = training_job(model, {"a": layout(model, dp=world)}, world)
    options = ControlOptions(recalibrate_every=0, slowdown=1e9, response_drift=1e9)
    ctl = Controller(module, "a", None, options=options, total_steps=10**6, show=False)
    own = []
    for _ in range(steps + 20):
        with ctl.step():
            with ctl.stage("actor.train"):
                time.sleep(0.01)
            dist.barrier()
        if ctl.last.action != "stay" or ctl.last.triggers:
            raise RuntimeError(f"expected a plain stay, got {ctl.last.action}")
        own.append(ctl.end_of_step_s)
    return statistics.median(own[20:])


def run(quick: bool = False, json_output: bool = False) -> dict:
    hidden, layers, steps = (128, 2, (2, 3)) if quick else (256, 4, (5, 4))  # (blocks, steps per block)
    with tempfile.TemporaryDirectory(prefix="nereus-controller-") as tmp:
        per_rank = run_local(worker, WORLD, hidden, layers, steps, tmp, timeout=1800, threads=1)
    slow = lambda k: max(r[k] for r in per_rank if r.get(k) is not None)  # noqa: E731
    result = {
        "benchmark": "controller",
        "world": WORLD,
        "hidden": hidden,
        "layers": layers,
        "steps": steps,
        "params": sum(_model(hidden, layers, n, h, t).num_params() for n, _, h, t in MODELS),
        "models": per_rank[0]["models"],
        "changed": per_rank[0]["changed"],
        "step_s": slow("step_s"),
        "with_controller_s": slow("with_controller_s"),
        "controller_s": slow("with_controller_s") - slow("step_s"),
        "decide_s": per_rank[0]["decide_s"],
        "move_s": slow("move_s"),
        "dcp_s": slow("dcp_s"),
        "dcp_save_s": slow("dcp_save_s"),
        "dcp_load_s": slow("dcp_load_s"),
        "bytes_moved": per_rank[0]["bytes_moved"],
        "target": per_rank[0]["target"],
        "stays": min(r["stays"] for r in per_rank),
        "own_s": slow("own_s"),
        "own_p90_s": slow("own_p90_s"),
    }
    result["controller_over_step"] = result["controller_s"] / result["step_s"]
    result["own_over_step"] = result["own_s"] / result["step_s"]
    result["end_of_step_s_by_world"] = {
        w: max(run_local(end_of_step, w, 50 if quick else 180, timeout=600, threads=1)) for w in (1, 2, 4)
    }
    result["dcp_over_move"] = result["dcp_s"] / result["move_s"]
    if not json_output:
        t = Table(
            title=f"Controller in an RL job of four HF Llamas ({', '.join(result['models'])}; "
            f"{result['params'] / 1e6:.1f} M params in all) on {WORLD} gloo processes, each TP 2 x DP 2 to start",
            title_justify="left",
        )
        for col in (
            "step",
            "with controller (stay)",
            "added",
            "overhead",
            "own time (p90)",
            "own / step",
            "decision (re-plan)",
            "move in the loop",
            "DCP save + load",
            "DCP / move",
        ):
            t.add_column(col, justify="right")
        t.add_row(
            f"{result['step_s'] * 1e3:.1f} ms",
            f"{result['with_controller_s'] * 1e3:.1f} ms",
            f"{result['controller_s'] * 1e3:.2f} ms",
            f"{result['controller_over_step']:.1%}",
            f"{result['own_s'] * 1e3:.2f} ms ({result['own_p90_s'] * 1e3:.2f})",
            f"{result['own_over_step']:.2%}",
            f"{result['decide_s']:.2f} s",
            f"{result['move_s']:.3f} s",
            f"{result['dcp_s']:.3f} s",
            f"{result['dcp_over_move']:.1f}x",
        )
        Console(width=200).print(t)
        Console(width=200).print(
            f"the forced move @a -> @{result['target']} changed {', '.join(result['changed'])} "
            f"({result['bytes_moved'] / 2**20:.1f} MiB over the wire)"
        )
        Console(width=200).print(
            "the Controller's end of step alone (a stay; median, slowest rank): "
            + ", ".join(
                f"{w} process{'es' if w > 1 else ''} {v * 1e3:.2f} ms"
                for w, v in result["end_of_step_s_by_world"].items()
            )
        )
    return result
