"""The cost model against the running job: the live examples' measured stage times, predicted
by the priors and by a calibration fitted to the job's other layouts.

    python benchmarks/live_calibration.py            # 6 layouts of each example, 5 steps each
    python benchmarks/live_calibration.py --quick    # 5 layouts, 4 steps
    python benchmarks/live_calibration.py --save m.json; ... --load m.json   # measure once, evaluate again

For each example (``examples/grpo_tiny.py``: ``actor.train`` and ``ref.infer``;
``examples/ppo_tiny.py``: ``actor.train``, ``critic.train``, ``ref.infer`` and ``reward.infer``,
its reward model fitted once first, ``reward_model.py``) and each layout
of its models on 4 gloo processes of this machine, the example runs with ``--stay`` (the
Controller measures, never moves). What the Controller measured per model-stage (its slowest
rank's seconds; the first step is warm-up and dropped) is the truth. The IR job of every layout
(the example's own ``job``) runs on a cluster block of this machine, its figures measured first
as a user would (``probe``: a process's GEMM rate and gloo's all-reduce latency and bandwidth
on 4 processes), and is estimated three ways:

- **prior**: the cost model's default coefficients;
- **held out**: ``calibrate`` fitted to the measurements of the *other* layouts of the same
  example (leave one layout out), then ``estimate``: what a job calibrated on what it ran can
  say of a layout it has not run;
- **in sample**: fitted to every layout, this one included (how well the model's form can fit
  at all).

Errors are |predicted - measured| / measured per (layout, model-stage); the table prints each,
and the summary the median and the worst, beside a constant predictor (every model-stage
predicted at the median of the other layouts' measurements of it), which a calibrated model
must beat to say anything.
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from nereus.ir import Cluster, Link
from nereus.passes.cost.calibrate import Calibrate
from nereus.registry import run_pipeline
from nereus.runtime.launch import init_from_env, run_local

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
GIB = 2**30


def probe(rank: int, world: int) -> dict:
    """This machine's figures as a user would take them for a cluster block, on ``world``
    processes at once: one process's fp32 GEMM rate (256 x 256, one thread) and a gloo
    all-reduce's time for 64 B (latency) and 4 MiB (bandwidth)."""
    torch.set_num_threads(1)
    init_from_env(timeout=60)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    for _ in range(10):
        a @ b
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(200):
        a @ b
    flops = 2 * 256**3 * 200 / (time.perf_counter() - t0)
    small, big = torch.zeros(16), torch.zeros(1 << 20)
    times = {}
    for name, x, n in (("small", small, 200), ("big", big, 20)):
        for _ in range(5):
            dist.all_reduce(x)
        laps = []
        for _ in range(n):
            t0 = time.perf_counter()
            dist.all_reduce(x)
            laps.append(time.perf_counter() - t0)
        times[name] = statistics.median(laps)
    return {"flops": flops, "small_s": times["small"], "big_s": times["big"], "big_bytes": big.numel() * 4}


def cpu_cluster(figures: dict, world: int = 4) -> Cluster:
    """A cluster block of this machine from ``probe``'s figures (the slowest rank's): the cost
    model charges a ring all-reduce 2 (n - 1) latencies and 2 (n - 1) / n of its bytes over the
    link, so the link's latency and bandwidth are solved from the two all-reduce times."""
    ring = 2 * (world - 1)
    latency = figures["small_s"] / ring
    bandwidth = ring / world * figures["big_bytes"] / max(figures["big_s"] - ring * latency, 1e-9)
    return Cluster(
        name="cpu",
        nodes=1,
        gpus_per_node=world,
        gpu_memory=4 * GIB,
        peak_flops=figures["flops"],
        hbm_bandwidth=10e9,  # not measured: no decode runs here (generation is no model-stage)
        intra_node=Link(bandwidth, latency),
        inter_node=Link(bandwidth, latency),
    )


LAYOUTS = {  # flags of each example per layout: tp, dp, pp of the actor (and the critic), then the reference
    "grpo_tiny": [
        ["--tp", "2", "--dp", "2"],
        ["--tp", "1", "--dp", "4"],
        ["--tp", "4", "--dp", "1"],
        ["--tp", "1", "--dp", "2", "--pp", "2", "--ref-tp", "1", "--ref-dp", "4"],
        ["--tp", "2", "--dp", "1", "--pp", "2", "--ref-tp", "4", "--ref-dp", "1"],
        ["--tp", "1", "--dp", "2", "--ref-tp", "2", "--ref-dp", "1"],
    ],
    "ppo_tiny": [
        ["--tp", "2", "--dp", "2"],
        ["--tp", "1", "--dp", "4"],
        ["--tp", "4", "--dp", "1"],
        ["--tp", "1", "--dp", "2", "--pp", "2", "--ref-tp", "1", "--ref-dp", "4"],
        ["--tp", "2", "--dp", "1", "--critic-tp", "1", "--critic-dp", "4", "--ref-tp", "4", "--ref-dp", "1"],
        ["--tp", "1", "--dp", "2", "--critic-tp", "2", "--critic-dp", "1", "--ref-tp", "2", "--ref-dp", "1"],
    ],
}


def _example(name: str):
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    return importlib.import_module(name)


def run_example(rank: int, world: int, name: str, argv: list[str]) -> dict:
    return _example(name).main(argv)


@functools.cache
def reward_model_file() -> str:
    """``ppo_tiny``'s reward model, fitted once per run of the bench into a temporary file."""
    rm, g = _example("reward_model"), _example("grpo_tiny")
    state, _ = rm.train(g.config(), digits=3, alphabet=4)
    path = str(Path(tempfile.mkdtemp(prefix="nereus-rm-")) / "reward_model.pt")
    torch.save(state, path)
    return path


def measure(name: str, flags: list[str], steps: int) -> dict:
    """The example under one layout: per model-stage, the median seconds of steps 1.. (slowest
    rank, as the Controller records them), and the mean response length."""
    argv = [*flags, "--steps", str(steps), "--leave-step", "-1", "--stay", "--quiet", "--planned-response", "4"]
    if name == "ppo_tiny":
        argv += ["--reward-model", reward_model_file()]
    (first, *_) = run_local(run_example, 4, name, argv, timeout=600)
    rows = first["history"][1:]
    stages = {ms: statistics.median(r["stages"][ms] for r in rows) for ms in rows[0]["stages"]}
    return {"stages": stages, "response_mean": statistics.mean(r["response_mean"] for r in rows), "argv": argv}


def module_of(name: str, runs: list[dict], cluster: Cluster):
    """One IR module with a plan per layout (``L0``..), the example's own job on ``cluster``, each
    plan with a workload of its own (``job_L0``..) at the measured response length and with the
    live loop's micro-batch: a replica runs its whole share in one pass (``micro_batches`` of it
    under PP), so the micro-batch is the share, the smallest over the plan's model-stages where
    their DP differ (the IR holds one micro-batch size per workload)."""
    ex = _example(name)
    merged = None
    mean = statistics.mean(r["response_mean"] for r in runs)
    for i, run in enumerate(runs):
        _, m = ex.job(ex.parse(run["argv"]), 4, cluster=copy.deepcopy(cluster))
        plan = m.plans.pop("a")
        plan.name, plan.workload = f"L{i}", f"job_L{i}"
        w = copy.deepcopy(m.workloads["job"])
        w.name = plan.workload
        w.micro_batch = min(w.samples // (lay.dp * lay.micro_batches) for lay in plan.layouts.values())
        w.response_len_mean = max(1, round(mean))
        if merged is None:
            merged = m
            merged.emus.clear()  # plan @a's; the estimate needs none
        merged.workloads[w.name] = w
        merged.plans[plan.name] = plan
    del merged.workloads["job"]
    return merged


def predicted(m, records: list | None) -> dict[str, dict[str, float]]:
    """Per plan and model-stage, the estimate's seconds, after ``calibrate`` on ``records`` if given."""
    m = copy.deepcopy(m)
    if records:
        run_pipeline(m, [Calibrate(records=records)])
    run_pipeline(m, "estimate")
    return {p.name: {ms: lay.time for ms, lay in p.layouts.items()} for p in m.plans.values()}


def evaluate(name: str, runs: list[dict], cluster: Cluster) -> list[dict]:
    m = module_of(name, runs, cluster)
    records = [(f"L{i}", ms, s, None, i) for i, r in enumerate(runs) for ms, s in r["stages"].items()]
    prior = predicted(m, None)
    in_sample = predicted(m, records)
    rows = []
    for i, run in enumerate(runs):
        plan = f"L{i}"
        held = predicted(m, [r for r in records if r[0] != plan])[plan]
        for ms, seconds in run["stages"].items():
            others = [r["stages"][ms] for j, r in enumerate(runs) if j != i]
            rows.append(
                {
                    "example": name,
                    "plan": plan,
                    "layout": " ".join(run["argv"][: run["argv"].index("--steps")]),
                    "model_stage": ms,
                    "measured": seconds,
                    "prior": prior[plan][ms],
                    "held_out": held[ms],
                    "in_sample": in_sample[plan][ms],
                    "constant": statistics.median(others),
                }
            )
    return rows


def error(row: dict, key: str) -> float:
    return abs(row[key] - row["measured"]) / row["measured"]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--save", help="write the measurements to this file (JSON)")
    p.add_argument("--load", help="evaluate the measurements of this file instead of running the examples")
    args = p.parse_args(argv)
    steps = 4 if args.quick else 5
    if args.load:
        measured = json.loads(Path(args.load).read_text())
    else:
        every = run_local(probe, 4, timeout=300)
        measured = {
            "machine": {k: (min if k == "flops" else max)(r[k] for r in every) for k in every[0]},
            **{
                name: [measure(name, flags, steps) for flags in (layouts[:5] if args.quick else layouts)]
                for name, layouts in LAYOUTS.items()
            },
        }
    cluster = cpu_cluster(measured["machine"])
    if args.save:
        Path(args.save).parent.mkdir(parents=True, exist_ok=True)
        Path(args.save).write_text(json.dumps(measured, indent=1))
    rows = [row for name in LAYOUTS for row in evaluate(name, measured[name], cluster)]
    summary = {}
    for name in LAYOUTS:
        mine = [r for r in rows if r["example"] == name]
        summary[name] = {
            key: {"median": statistics.median(error(r, key) for r in mine), "worst": max(error(r, key) for r in mine)}
            for key in ("prior", "held_out", "in_sample", "constant")
        }
    result = {"benchmark": "live-calibration", "machine": measured["machine"], "rows": rows, "summary": summary}
    if args.json:
        print(json.dumps(result))
        return result
    console = Console(width=200)
    link = cluster.intra_node
    console.print(
        f"this machine as a cluster (probe, 4 processes): {cluster.peak_flops / 1e9:.0f} GFLOP/s a process, "
        f"gloo link {link.bandwidth / 1e9:.2f} GB/s, {link.latency * 1e6:.0f} us a ring step"
    )
    t = Table(title="Stage times on this machine: measured, and predicted by the cost model", title_justify="left")
    for col in ("example", "layout", "model-stage", "measured", "prior", "held out", "in sample", "constant"):
        t.add_column(col, justify="left" if col in ("example", "layout", "model-stage") else "right")
    for r in rows:
        t.add_row(
            r["example"],
            r["layout"],
            r["model_stage"],
            f"{r['measured'] * 1e3:.1f} ms",
            *(f"{r[k] * 1e3:.1f} ms ({error(r, k):.0%})" for k in ("prior", "held_out", "in_sample", "constant")),
        )
    console.print(t)
    s = Table(title="|predicted - measured| / measured: median (worst)", title_justify="left")
    for col in ("example", "prior", "held out", "in sample", "constant"):
        s.add_column(col, justify="right")
    for name, v in summary.items():
        s.add_row(
            name,
            *(f"{v[k]['median']:.0%} ({v[k]['worst']:.0%})" for k in ("prior", "held_out", "in_sample", "constant")),
        )
    console.print(s)
    return result


if __name__ == "__main__":
    main()
