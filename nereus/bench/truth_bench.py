"""``nereus bench truth``: the cost model against the event truth, and the event truth's own cost.

The simulator's event truth (``nereus.sim.truth``) plays a step out and shares no formula with
the cost model, so the cost model has a real error against it. On the 70B PPO job of the traces
(1,024 GPUs), the plans every baseline policy starts with (``fixed``, ``fixed-dp``, verl-like,
OpenRLHF-like, Nereus's), at response lengths from the ``length_growth`` trace:

- **error per model-stage kind** (generate, infer, train): the cost model's time against the
  event truth's, with the priors, and after ``calibrate`` at each step on the event truth's
  times of half the plans, for the other half at that step (held out);
- **ranking**: of the pairs of plans at the same lengths, the share the cost model orders
  otherwise than the event truth (step time);
- **speed**: seconds per evaluation of a plan at a step, and per 1,000 steps of one policy that
  keeps its plan (one evaluation per distinct condition of the trace; conditions repeat).
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ..ir import Plan, parse, verify
from ..passes.cost.calibrate import calibrate_records
from ..passes.cost.estimate import estimate_plan
from ..sim.policies import POLICIES
from ..sim.simulated_cluster import SimCluster, conditions
from ..sim.trace import read_trace
from ..testing.jobs import EXAMPLES

TRACES = Path(__file__).resolve().parents[1] / "sim" / "traces"
STARTS = ("fixed", "fixed-dp", "verl", "openrlhf", "nereus")


def _estimate(m, plan: Plan) -> tuple[float, dict[str, float]]:
    p = copy.deepcopy(plan)
    p.name = "_bench"
    m.plans["_bench"] = p
    try:
        estimate_plan(m, p)
    finally:
        del m.plans["_bench"]
    return (p.step_time or math.inf), {ms: lay.time for ms, lay in p.layouts.items() if lay.time is not None}


def run(quick: bool = False, json_output: bool = False) -> dict:
    module = verify(parse(EXAMPLES["ppo_70b_1024gpu.nir"](), "ppo_70b_1024gpu.nir"))
    trace = read_trace(TRACES / "length_growth.jsonl")
    sim = SimCluster(module, trace, model="event")
    plans: dict[str, Plan] = {}
    for name in STARTS[:3] if quick else STARTS:
        policy = POLICIES[name]()
        policy.start(sim)
        plans[name] = policy.plan
    steps = [0, 499] if quick else [0, 199, 399, 599, 799, 999]
    kinds = {ms: st.kind for st in sim.workload.stages for ms in st.model_stages()}
    rows = []  # (step, plan, model-stage, truth s, prior s)
    step_times = []  # (step, plan, truth, prior)
    t_eval = []
    for i in steps:
        m = sim.module_at(i)
        for name, plan in plans.items():
            t0 = time.perf_counter()
            out = sim.evaluate(plan, i)
            t_eval.append(time.perf_counter() - t0)
            est, per = _estimate(copy.deepcopy(m), plan)
            step_times.append((i, name, out.step_time if not out.failure else math.inf, est))
            for ms, sec in out.seconds.items():
                if math.isfinite(sec) and per.get(ms):
                    rows.append((i, name, ms, sec, per[ms]))
    # calibration at each step on half the plans' event times (what the Controller measures of the
    # plan it runs, at the lengths of the moment), predicted for the other half at that step
    names = list(plans)
    fit_on, held = names[::2], names[1::2]
    after = []
    for i in steps:
        cal = copy.deepcopy(sim.module_at(i))
        for name in names:
            p = copy.deepcopy(plans[name])
            p.name, p.workload, p.cluster = name, sim.workload.name, sim.cluster.name
            cal.plans[name] = p
        records = [(n, ms, sec, None, 0) for j, n, ms, sec, _ in rows if j == i and n in fit_on]
        calibrate_records(cal, records)
        for name in held:
            _, per = _estimate(cal, plans[name])
            for j, n, ms, sec, _ in rows:
                if j == i and n == name and per.get(ms):
                    after.append((kinds[ms], sec, per[ms]))

    def errors(pairs) -> dict[str, dict]:
        by: dict[str, list[float]] = {}
        for kind, truth, est in pairs:
            by.setdefault(kind, []).append(abs(est - truth) / truth)
        return {k: {"median": statistics.median(v), "max": max(v), "n": len(v)} for k, v in sorted(by.items())}

    prior_err = errors([(kinds[ms], sec, est) for _, _, ms, sec, est in rows])
    held_prior = errors([(kinds[ms], sec, est) for _, n, ms, sec, est in rows if n in held])
    after_err = errors(after)
    wrong = total = 0
    for i in steps:
        at = [(t, e) for j, _, t, e in step_times if j == i and math.isfinite(t) and math.isfinite(e)]
        for a in range(len(at)):
            for b in range(a + 1, len(at)):
                total += 1
                wrong += (at[a][0] - at[b][0]) * (at[a][1] - at[b][1]) < 0
    distinct = len({conditions(s) for s in trace.steps})
    per_eval = statistics.median(t_eval)
    result = {
        "plans": names,
        "steps": steps,
        "error_prior": prior_err,
        "error_held_out_prior": held_prior,
        "error_held_out_calibrated": after_err,
        "calibrated_on": fit_on,
        "ranking_wrong": wrong,
        "ranking_pairs": total,
        "seconds_per_evaluation": round(per_eval, 4),
        "distinct_conditions": distinct,
        "seconds_per_1000_steps_one_plan": round(per_eval * distinct * 1000 / len(trace.steps), 2),
    }
    if json_output:  # the command line prints it
        return result
    table = Table(title="the cost model against the event truth (PPO 70B, 1,024 GPUs, length_growth)")
    for col in ("kind", "priors: median / max", "held out, priors", "held out, calibrated"):
        table.add_column(col, justify="right" if col != "kind" else "left")
    for kind in prior_err:

        def cell(e):
            return f"{e[kind]['median']:.0%} / {e[kind]['max']:.0%}" if kind in e else "-"

        table.add_row(kind, cell(prior_err), cell(held_prior), cell(after_err))
    console = Console()
    console.print(table)
    console.print(
        f"pairs of plans ordered otherwise than the truth: {wrong} of {total}; event truth: "
        f"{per_eval * 1e3:.0f} ms per evaluation, {result['seconds_per_1000_steps_one_plan']} s per 1,000 "
        f"steps of one plan ({distinct} distinct conditions in {len(trace.steps)} steps)"
    )
    return result
