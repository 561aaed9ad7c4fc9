"""``nereus bench estimate``: the cost model's speed.

1. ``estimate`` over every model-stage of the 70B PPO job on 1,024 GPUs (the pass: mesh
   analysis, resident memory per GPU, breakdowns, step time).
2. 10,000 candidate layouts of actor.train scored in one vectorized call, against the same
   10,000 scored one at a time (what a search loop that calls the model per layout pays).
   The plan search calls the model this often; target: under 1 s for 10,000.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
from rich.console import Console
from rich.table import Table

from ..ir import parse
from ..passes import Candidates, CostModel
from ..passes.cost.estimate import estimate_plan
from ..testing.jobs import ppo_70b

TARGET_S = 1.0


def candidates(cluster, model, n: int, seed: int = 0) -> Candidates:
    """``n`` random layouts with valid TP (dividing heads and kv_heads), PP up to 16, DP filling <= the cluster."""
    rng = np.random.default_rng(seed)
    tps = [t for t in (1, 2, 4, 8) if model.heads % t == 0]
    pps = [1, 2, 4, 5, 8, 10, 16]
    tp = rng.choice(tps, n)
    pp = rng.choice(pps, n)
    dp = np.maximum(1, rng.integers(1, cluster.num_gpus // 8 + 1, n) * 8 // (tp * pp))
    return Candidates.grid(
        cluster,
        model.layers,
        tp,
        pp,
        dp,
        micro_batches=rng.choice([1, 2, 4, 8, 16, 32], n),
        recompute=rng.random(n) < 0.5,
        zero=rng.integers(0, 4, n),
    )


def _median_s(fn, repeats):
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def run(quick: bool = False, json_output: bool = False) -> dict:
    m = parse(ppo_70b(1024, with_emus=False))
    plan = next(iter(m.plans.values()))
    cluster, workload, model = m.clusters[plan.cluster], m.workloads[plan.workload], m.models["actor"]
    cm = CostModel(cluster)
    repeats = 2 if quick else 7
    plan_s = _median_s(lambda: estimate_plan(m, plan), repeats)
    n = 10_000
    cand = candidates(cluster, model, n)
    vector_s = _median_s(lambda: cm.stage(model, workload, "train", cand).time(cm.coeffs), repeats)
    n_scalar = 200 if quick else 1000  # timed on a sample, scaled to 10,000
    singles = [
        Candidates(**{f: getattr(cand, f)[i : i + 1] for f in cand.__dataclass_fields__}) for i in range(n_scalar)
    ]
    t0 = time.perf_counter()
    scalar_times = [cm.stage(model, workload, "train", c).time(cm.coeffs)[0] for c in singles]
    scalar_s = (time.perf_counter() - t0) * n / n_scalar
    vec = cm.stage(model, workload, "train", cand).time(cm.coeffs)[:n_scalar]
    assert np.allclose(vec, scalar_times, equal_nan=True)  # the two paths compute the same thing
    result = {
        "benchmark": "estimate",
        "plan_model_stages": len(plan.layouts),
        "plan_gpus": cluster.num_gpus,
        "estimate_plan_ms": round(plan_s * 1e3, 2),
        "candidates": n,
        "vectorized_s": round(vector_s, 4),
        "one_at_a_time_s": round(scalar_s, 3),
        "speedup": round(scalar_s / vector_s, 1),
        "target_s": TARGET_S,
    }
    if not json_output:
        t = Table(title="cost model speed (median of repeated runs)", title_justify="left")
        for col in ("workload", "what", "time", "vs target"):
            t.add_column(col, justify="right" if col in ("time",) else "left")
        t.add_row(
            "estimate pass", f"{len(plan.layouts)} model-stages, {cluster.num_gpus} GPUs", f"{plan_s * 1e3:.1f} ms", ""
        )
        t.add_row(
            "10,000 layouts, vectorized",
            "actor.train of the 70B job",
            f"{vector_s * 1e3:.1f} ms",
            "meets" if vector_s < TARGET_S else "misses" + f" the {TARGET_S:.0f} s target",
        )
        t.add_row(
            "10,000 layouts, one at a time",
            f"timed on {n_scalar}, scaled",
            f"{scalar_s * 1e3:.0f} ms",
            f"{scalar_s / vector_s:.0f}x slower than vectorized",
        )
        Console(width=140).print(t)
    return result
