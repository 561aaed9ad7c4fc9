"""``nereus bench elastic``: from a rank's death to the next training step done, Nereus's live
recovery beside the way users recover today (a restart from the last checkpoint), on the same
job, the same failure and the same checkpoint.

The job: a Hugging Face Llama (built from a config, seeded; ``hf_llama``) trained with AdamW on
4 gloo processes of this machine, DP 4 under DDP (``zero 0``: every rank holds the whole state)
or FSDP2 (``zero 3``: each rank alone holds a quarter), the Controller around every step, a DCP
checkpoint every ``every`` steps (``Controller(checkpoint_every=)``: what users keep anyway).
In step ``fail`` rank 3 dies by SIGKILL before its update, without notice.

- **Nereus** (the same processes): the survivors' collectives break, they agree who is alive
  (``runtime.liveness``), re-form the default group, the decision core plans a layout on the 3
  survivors and the transition moves the state there from their memory (under ZeRO-3 the dead
  rank's quarter, held nowhere else, is read from the checkpoint: ``restore``), then step
  ``fail`` runs again. Time: from the death (the dying rank's clock, written to the job's store
  just before) to the end of that step, on the survivors.
- **Restart** (what torchrun's agent does, ``--max-restarts``; or a job relaunched on the GPUs it
  has left): new processes on the 3 remaining GPUs, each importing torch and the model code,
  joining a new process group, building the model under DP 3 and loading the last checkpoint
  (DCP, resharded to DP 3), then redoing every step since the checkpoint and the one that
  failed. Time: from the spawn to the end of step ``fail``. The agent's detection and the
  stopping of the old workers are not counted (in favour of the restart).

Lost work: the steps a side runs twice. Nereus reruns only the step in flight; the restart, every
step since the last checkpoint too (``fail - every`` here; half the checkpoint interval on
average). Under ZeRO-3, Nereus's restored quarter is as of the checkpoint (its updates since are
lost, the decision log says which tensors); the rest is live. Both sides' losses at the redone
step are reported: the same step, from the same state (DDP) up to reduction order.
"""

from __future__ import annotations

import datetime
import math
import os
import signal
import tempfile
import time

import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from ..backend.shards import plan_layout
from ..control import ControlOptions
from ..integrations.controller import Controller
from ..integrations.hf_llama import batch, build, llama_config, train_step
from ..integrations.job import layout, training_job
from ..integrations.llama_adapter import LlamaAdapter
from ..integrations.llama_state import live_keep, load_state, shard_specs
from ..ir import Model
from ..runtime import dcp
from ..runtime.launch import init_from_env, run_local
from ..runtime.regroup import job_store
from .controller_bench import _model as tiny_model

WORLD = 4
ROWS, SEQ = 12, 32  # the global batch splits over DP 4 and DP 3
PG_TIMEOUT = 5.0  # every group's timeout (the default group's and the model's): the longest a collective waits
START_TIMEOUT = 60.0  # connecting the groups at start-up: on a loaded machine a rank may be seconds late


def _start(model: Model, module) -> object:
    """Join the job and build its model with a generous connect timeout, then bound every group's
    collectives by ``PG_TIMEOUT`` (gloo's connect uses the group's timeout, so one ``PG_TIMEOUT``
    for both made a rank that started late fail the whole run)."""
    init_from_env(timeout=START_TIMEOUT)
    live = build(llama_config(model), module.plans["a"].layouts["actor.train"], seed=0, timeout=START_TIMEOUT)
    for group in list(dist.distributed_c10d._world.pg_map):
        group.set_timeout(datetime.timedelta(seconds=PG_TIMEOUT))
    return live


def _model(hidden: int, layers: int) -> Model:
    return tiny_model(hidden, layers, vocab=1536)


def _module(model: Model, dp: int, zero: int, gpus: int):
    return training_job(model, {"a": layout(model, tp=1, dp=dp, zero=zero)}, gpus, rows=ROWS, seq=SEQ)


def nereus_side(rank: int, world: int, hidden: int, layers: int, zero: int, every: int, fail: int, ckpt: str) -> dict:
    """The job on ``world`` ranks; rank 3 dies in step ``fail``; the survivors' times."""
    model = _model(hidden, layers)
    config = llama_config(model)
    module = _module(model, world, zero, world)
    live = _start(model, module)
    adapter = LlamaAdapter(live, module, "a")
    options = ControlOptions(
        recalibrate_every=0, slowdown=1e9, response_drift=1e9, cooldown=10**6, max_pp=1, max_zero=zero, offload=False
    )
    ctl = Controller(
        module,
        "a",
        adapter,
        options=options,
        total_steps=1000,
        show=False,
        timeout=60,
        detect_timeout=PG_TIMEOUT,
        checkpoint_dir=ckpt,
        checkpoint_every=every,
        keep=live_keep(module),
    )
    store = job_store()
    steps: list[float] = []
    losses: dict = {}
    step = 0
    while step <= fail:
        t0 = time.perf_counter()
        with ctl.step():
            if step == fail and rank == world - 1 and not ctl.failures:
                store.set("bench/killed_at", repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            with ctl.stage("actor.train"):
                loss = train_step(adapter.live, batch(config, step, rows=ROWS, seq=SEQ)) if adapter.live.model else None
        if ctl.redo:
            continue
        steps.append(time.perf_counter() - t0)
        losses[step] = loss
        step += 1
    done = time.time()
    killed = float(store.get("bench/killed_at"))
    failure = ctl.failures[0]
    return {
        "rank": rank,
        "recover_s": done - killed,
        "step_s": sorted(steps[1:fail])[len(steps[1:fail]) // 2],  # the median step before the failure
        "detect_s": failure["detect_s"],
        "regroup_s": failure["regroup_s"],
        "move_s": failure["recover_s"] - failure["detect_s"] - failure["regroup_s"],
        "loss": losses[fail],
        "checkpoint_s": sorted(c["save_s"] for c in ctl.checkpoints)[len(ctl.checkpoints) // 2],
    }


def restart_side(rank: int, world: int, hidden: int, layers: int, zero: int, every: int, fail: int, ckpt: str) -> dict:
    """What a restart does on ``world`` (the survivors') GPUs: fresh processes, the model under
    DP ``world``, the last checkpoint loaded, the steps since it and the failed one redone."""
    t_start = time.time()
    model = _model(hidden, layers)
    config = llama_config(model)
    module = _module(model, world, zero, world)
    live = _start(model, module)
    last = (fail // every) * every
    specs = shard_specs(live, module, "a")
    state = dcp.load(os.path.join(ckpt, f"step_{last}"), specs, dist.get_rank(), world)
    load_state(live, module, "a", state, last)
    loaded = time.time()
    loss = None
    for step in range(last, fail + 1):
        loss = train_step(live, batch(config, step, rows=ROWS, seq=SEQ))
    dist.barrier()
    return {
        "rank": rank,
        "t_start": t_start,
        "loaded": loaded,
        "done": time.time(),
        "loss": loss,
        "redone": fail - last,
    }


def measure(hidden: int, layers: int, zero: int, every: int, fail: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "ckpt")
        ours = [
            r
            for r in run_local(nereus_side, WORLD, hidden, layers, zero, every, fail, ckpt, timeout=600, dies=(3,))
            if r
        ]
        t_spawn = time.time()
        theirs = run_local(restart_side, WORLD - 1, hidden, layers, zero, every, fail, ckpt, timeout=600)
    ours_s = max(r["recover_s"] for r in ours)
    restart_s = max(r["done"] for r in theirs) - t_spawn
    step_s = max(r["step_s"] for r in ours)
    return {
        "zero": zero,
        "every": every,
        "fail": fail,
        "state_mib": round(_state_bytes(_module(_model(hidden, layers), WORLD, zero, WORLD)) / 2**20, 1),
        "step_s": round(step_s, 3),
        "nereus_s": round(ours_s, 3),
        "detect_s": round(max(r["detect_s"] for r in ours), 3),
        "regroup_s": round(max(r["regroup_s"] for r in ours), 3),
        "move_s": round(max(r["move_s"] for r in ours), 3),
        "restart_s": round(restart_s, 3),
        "restart_up_s": round(max(r["loaded"] for r in theirs) - t_spawn, 3),  # processes, group, model, DCP load
        "lost_steps_nereus": 0,
        "lost_steps_restart": theirs[0]["redone"],
        "ratio": round(restart_s / ours_s, 2),
        "loss_nereus": next(r["loss"] for r in ours if r["loss"] is not None),
        "loss_restart": theirs[0]["loss"],
        "checkpoint_s": max(r["checkpoint_s"] for r in ours),
    }


def _state_bytes(module) -> int:
    """The job's whole state (weights, fp32 master where it is one, Adam moments), each tensor once."""
    full = {}
    for specs in plan_layout(module, "a").values():
        for sp in specs:
            full[sp.key] = math.prod(sp.shape) * sp.itemsize
    return sum(full.values())


def run(quick: bool = False, json_output: bool = False):
    # every dimension splits evenly over 4 and over 3 ranks (FSDP2's and the IR's rules agree)
    hidden, layers = (96, 2) if quick else (192, 4)
    cases = [(0, 10, 15)] if quick else [(0, 10, 15), (3, 10, 15)]
    rows = [measure(hidden, layers, zero, every, fail) for zero, every, fail in cases]
    if json_output:
        return {"hidden": hidden, "layers": layers, "world": WORLD, "cases": rows}
    table = Table(
        title=f"a rank dies: to the next step done (Llama hidden {hidden} x {layers} layers, 4 -> 3 gloo ranks)"
    )
    for col in ("layout", "step", "Nereus", "detect", "regroup", "move", "restart", "(up)", "lost steps", "ratio"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            f"DP 4, ZeRO-{r['zero']}",
            f"{r['step_s'] * 1e3:.0f} ms",
            f"{r['nereus_s']:.2f} s",
            f"{r['detect_s']:.2f} s",
            f"{r['regroup_s']:.2f} s",
            f"{r['move_s']:.2f} s",
            f"{r['restart_s']:.2f} s",
            f"{r['restart_up_s']:.2f} s",
            f"0 / {r['lost_steps_restart']}",
            f"{r['ratio']:.1f}x",
        )
    Console().print(table)
    return rows
