"""``nereus bench plan-search``: how fast CP-SAT finds the optimal plan, and how much it beats
the plan a careful operator writes by hand (``greedy_plan``: every model-stage of a stage on all
GPUs, each with its best TP/PP/DP under ``estimate``), both costed by ``estimate``.

Cases: the GRPO 7B job on 8 GPUs, the PPO 8B job on 16, the 70B PPO job on 128 to 16,384 GPUs
(Llama 3 trained on 16,384), and the 1,024-GPU job after 64 and 256 GPUs fail (seeded random
GPU ids). Times are wall time
of one run each (candidate generation + solve), as the controller would pay them online.
"fit alone": candidates whose own peak fits a GPU; "in model": what the last CP-SAT model held
(the candidates a plan under its step-time cap can use, less the dominated ones).
"searched step" is ``estimate`` on the placed plan; "objective" is the solver's own value of
it (integer time units, rounded up per candidate), and "agree" their relative difference.
"re-plan s" and "from plan s": the controller's re-plan when the responses grow by a tenth,
searched from scratch and from the running plan (``plan-search{incumbent=...}``): the same
optimum, the second usually on fewer candidates.
"""

from __future__ import annotations

import copy
import time

import numpy as np
from rich.console import Console
from rich.table import Table

from ..ir import parse
from ..passes.cost.estimate import estimate_plan
from ..passes.search.plan_search import placed, solve, to_plan
from ..passes.search.space import build_problem
from ..testing.jobs import grpo_7b_8gpu, ppo_8b_16gpu, ppo_70b
from .baselines.greedy_plan import greedy_plan

TARGET_S = 2.0


def cases(quick: bool):
    yield "GRPO 7B", 0, grpo_7b_8gpu()
    yield "PPO 8B", 0, ppo_8b_16gpu()
    for gpus in (128, 1024) if quick else (128, 256, 512, 1024, 4096, 16384):
        yield "PPO 70B", 0, ppo_70b(gpus, with_emus=False)
    if not quick:
        yield "PPO 70B", 64, ppo_70b(1024, with_emus=False)
        yield "PPO 70B", 256, ppo_70b(1024, with_emus=False)


def run(quick: bool = False, json_output: bool = False, time_limit: float = 30.0) -> dict:
    rows = []
    for label, lost, text in cases(quick):
        m = parse(text)
        m.emus.clear()
        w, c = next(iter(m.workloads.values())), next(iter(m.clusters.values()))
        if lost:
            c.unavailable = sorted(int(g) for g in np.random.default_rng(lost).choice(c.num_gpus, lost, replace=False))
        t0 = time.perf_counter()
        problem = build_problem(c, w, m.models, prune=False)  # as plan-search runs it
        t1 = time.perf_counter()
        sol = solve(problem, time_limit=time_limit)
        t2 = time.perf_counter()
        row = {
            "job": label,
            "gpus": len(c.available_gpus()),
            "model_stages": len(w.model_stages()),
            "candidates": sum(s.generated for s in problem.spaces.values()),
            "fit": sum(len(s.options) for s in problem.spaces.values()),
            "in_model": sol.options,
            "build_s": round(t1 - t0, 3),
            "solve_s": round(t2 - t1, 3),
            "total_s": round(t2 - t0, 3),
            "status": sol.status,
            "gap": round(sol.gap, 5),
        }
        if sol.choice is not None:
            plan = to_plan(problem, sol, "searched", w.name, c.name)
            m.plans["searched"] = plan
            assert estimate_plan(m, plan) == []
            row["searched_step_s"] = plan.step_time
            row["objective_s"] = sol.objective * problem.unit_s
            row["objective_vs_estimate"] = abs(row["objective_s"] - plan.step_time) / plan.step_time
            # the controller's re-plan: responses 10% longer, searched again from scratch and from the running plan
            grown = copy.deepcopy(w)
            grown.response_len_mean = int(w.response_len_mean * 1.1)
            t4 = time.perf_counter()
            again = build_problem(c, grown, m.models, prune=False)
            cold = solve(again, time_limit=time_limit)
            t5 = time.perf_counter()
            again = build_problem(c, grown, m.models, prune=False)
            warm = solve(again, time_limit=time_limit, known=placed(again, plan))
            t6 = time.perf_counter()
            assert warm.objective == cold.objective
            row.update(
                replan_cold_s=round(t5 - t4, 3), replan_warm_s=round(t6 - t5, 3), replan_warm_in_model=warm.options
            )
        t3 = time.perf_counter()
        greedy = greedy_plan(m, w, c)
        row["greedy_s"] = round(time.perf_counter() - t3, 2)
        if greedy:
            row["greedy_layouts"] = {ms: f"tp{l.tp} pp{l.pp} dp{l.dp}" for ms, l in greedy.layouts.items()}
        row["greedy_step_s"] = greedy.step_time if greedy else None
        if greedy and sol.choice is not None:
            row["greedy_over_searched"] = round(greedy.step_time / plan.step_time, 3)
        rows.append(row)
    result = {"benchmark": "plan-search", "target_s": TARGET_S, "time_limit_s": time_limit, "rows": rows}
    if not json_output:
        t = Table(
            title="plan-search (CP-SAT, 1 worker) vs the hand-tuned baseline (all GPUs per stage, best layout per "
            "model-stage)",
            title_justify="left",
        )
        for col in (
            "job",
            "GPUs",
            "candidates",
            "fit alone",
            "in model",
            "build s",
            "solve s",
            "status",
            "gap",
            "searched step",
            "objective",
            "agree",
            "baseline step",
            "baseline/searched",
            "re-plan s",
            "from plan s",
        ):
            t.add_column(col, justify="left" if col in ("job", "status") else "right")
        for r in rows:
            t.add_row(
                r["job"],
                str(r["gpus"]),
                f"{r['candidates']:,}",
                f"{r['fit']:,}",
                f"{r['in_model']:,}",
                f"{r['build_s']:.2f}",
                f"{r['solve_s']:.2f}",
                r["status"],
                f"{r['gap']:.2%}",
                f"{r.get('searched_step_s', float('nan')):.2f} s",
                f"{r.get('objective_s', float('nan')):.2f} s",
                f"{r.get('objective_vs_estimate', float('nan')):.3%}",
                f"{r['greedy_step_s']:.2f} s" if r["greedy_step_s"] else "does not fit",
                f"{r['greedy_over_searched']:.2f}x" if "greedy_over_searched" in r else "",
                f"{r['replan_cold_s']:.2f}" if "replan_cold_s" in r else "",
                f"{r['replan_warm_s']:.2f}" if "replan_warm_s" in r else "",
            )
        Console(width=200).print(t)
    return result
