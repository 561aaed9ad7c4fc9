"""Why plan-search chose its plan (``plan-search{explain=true}``, ``nereus opt --explain``).

Every answer is a solve of the same problem with one thing changed, so each figure is an
optimum (or says it is not), never a guess:

- the runner-up of each model-stage: the best plan whose layout of it has other TP, PP or DP
  sizes, and that plan's step time;
- the bottleneck: the model-stage taking the largest share of the step;
- memory: the fullest GPU against what the headroom leaves, and the best step time if what
  model-stages keep on shared GPUs did not count against each other (every layout still fits
  on its own): memory binds when it is lower;
- colocation and offload: when the plan uses them, the best plan without; when it does not,
  whether they were in the search at all.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from ..ir import Module, Plan
from ..ir.plan import RunnerUp
from .estimate import layout_costs
from .search_space import SearchProblem, Space

UNLIMITED_KIB = 1 << 50


@dataclass
class Explanation:
    """What ``explain`` found; ``lines()`` says it in words."""

    plan: str
    step_time: float  # seconds, estimate's
    shares: dict[str, float]  # model-stage -> seconds of the step it is on the critical path
    bottleneck: str
    runner_ups: dict[str, RunnerUp | None]  # None: no plan without this model-stage's layout
    fullest: tuple[str, int, float, float]  # model-stage, GPU, bytes used, bytes allowed (less headroom)
    headroom: float
    unbounded: float | None  # seconds, when model-stages sharing GPUs do not limit each other's memory
    colocation: str
    offload: str
    notes: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        s = _seconds
        gib = lambda b: f"{b / 2**30:.1f} GiB"
        out = [f"plan @{self.plan}: step {s(self.step_time)}; bottleneck {self.bottleneck} "
               f"({self.shares[self.bottleneck] / self.step_time:.0%} of the step)"]
        for ms, r in self.runner_ups.items():
            if r is None:
                out.append(f"  {ms}: no plan with other TP/PP/DP sizes for it")
            else:
                slower = (r.step_time - self.step_time) / self.step_time
                out.append(f"  {ms}: runner-up TP {r.tp} x PP {r.pp} x DP {r.dp}"
                           + (f" ZeRO {r.zero}" if r.zero else "") + f", step {s(r.step_time)} ({slower:+.1%})")
        ms, gpu, used, allowed = self.fullest
        out.append(f"  memory: fullest GPU {gpu} holds {gib(used)} during {ms}, of {gib(allowed)} allowed "
                   f"({self.headroom:.0%} headroom kept free)")
        if self.unbounded is not None and self.unbounded < self.step_time * (1 - 1e-6):
            out.append(f"  memory binds: if what model-stages keep on shared GPUs did not count against each "
                       f"other, the best step would be {s(self.unbounded)} "
                       f"({(self.unbounded - self.step_time) / self.step_time:+.1%})")
        else:
            out.append("  memory shared between model-stages does not bind: without that limit no plan is faster")
        out.append(f"  colocation: {self.colocation}")
        out.append(f"  offload: {self.offload}")
        out.extend("  " + n for n in self.notes)
        return out


def _seconds(x: float) -> str:
    return f"{x:.2f} s" if x >= 1 else f"{x * 1e3:.1f} ms"


def _without(problem: SearchProblem, keep) -> SearchProblem:
    """``problem`` with only the options ``keep(model_stage, option)`` accepts."""
    spaces = {ms: Space(sp.model_stage, sp.kind, [o for o in sp.options if keep(ms, o)], sp.generated)
              for ms, sp in problem.spaces.items()}
    return replace(problem, spaces=spaces, partitions=problem.partitions)


def _step(problem: SearchProblem, solve, deadline: float):
    """(step seconds, solution) of the best plan of ``problem``, or (None, solution)."""
    sol = solve(problem, max(deadline - time.monotonic(), 0.5))
    return (sol.objective * problem.unit_s if sol.objective is not None else None), sol


def explain(module: Module, plan: Plan, problem: SearchProblem, choice: dict[str, int], solve,
            time_limit: float) -> Explanation:
    """Explain ``plan`` (placed from ``choice``, option indices of ``problem``); ``solve(problem,
    time_limit)`` is plan-search's solver. Each re-solve gets an even share of ``time_limit``."""
    solves = len(problem.spaces) + 3
    share = time_limit / solves
    notes = []
    chosen = {ms: problem.spaces[ms].options[c] for ms, c in choice.items()}

    runner_ups: dict[str, RunnerUp | None] = {}
    for ms, o in chosen.items():
        sizes = (o.tp, o.pp, o.dp)
        step, sol = _step(_without(problem, lambda m, x: m != ms or (x.tp, x.pp, x.dp) != sizes), solve,
                          time.monotonic() + share)
        if step is None:
            runner_ups[ms] = None
            continue
        alt = [x for x in problem.spaces[ms].options if (x.tp, x.pp, x.dp) != sizes]
        r = alt[sol.choice[ms]]
        runner_ups[ms] = RunnerUp(tp=r.tp, pp=r.pp, dp=r.dp, zero=r.zero, step_time=round(step, 6))
        if sol.status != "optimal":
            notes.append(f"{ms}'s runner-up is the best found in {share:.1f} s, not proven best")

    unbounded, _ = _step(replace(problem, memory=UNLIMITED_KIB), solve, time.monotonic() + share)

    if plan.colocate:
        singles = {st: [p for p in parts if all(len(g) == 1 for g in p)] for st, parts in problem.partitions.items()}
        alone = replace(problem, partitions=singles)
        step, _ = _step(alone, solve, time.monotonic() + share)
        groups = "; ".join(" + ".join(g) for g in plan.colocate)
        colocation = (f"{groups} share GPUs; with no GPUs shared the best step is "
                      + (_seconds(step) + f" ({(step - plan.step_time) / plan.step_time:+.1%})"
                         if step is not None else "none: no plan fits"))
    elif any(len(mss) > 1 for _, mss in problem.stages):
        colocation = "searched; no plan that shares GPUs inside a stage is faster"
    else:
        colocation = "no stage runs more than one model"

    c = problem.cluster
    offloaders = [ms for ms, lay in plan.layouts.items() if lay.offload]
    if offloaders:
        step, _ = _step(_without(problem, lambda m, x: not x.offload), solve, time.monotonic() + share)
        offload = (f"{', '.join(offloaders)} offload; without offload the best step is "
                   + (_seconds(step) + f" ({(step - plan.step_time) / plan.step_time:+.1%})"
                      if step is not None else "none: no plan fits"))
    elif c.host_link is None or c.host_memory is None:
        missing = " and ".join(k for k in ("host_link", "host_memory") if getattr(c, k) is None)
        offload = f"not searched: cluster @{c.name} declares no {missing}"
    elif not any(o.offload for sp in problem.spaces.values() for o in sp.options):
        offload = "not searched (offload=false, or no layout keeps state worth offloading)"
    else:
        offload = "searched; no plan that offloads is faster"

    costs = layout_costs(module, plan)
    shares = _critical_shares(module, plan)
    fullest = max(((ms, *max(lc.others.items(), key=lambda kv: kv[1])) for ms, lc in costs.items()),
                  key=lambda t: plan.layouts[t[0]].memory or 0)
    ms, gpu, _ = fullest
    headroom = problem.headroom
    kinds = {m: sp.kind for m, sp in problem.spaces.items()}
    allowed = c.gpu_memory * (1 - headroom) if kinds[ms] != "generate" else c.gpu_memory
    return Explanation(plan=plan.name, step_time=plan.step_time, shares=shares, bottleneck=max(shares, key=shares.get),
                       runner_ups=runner_ups, fullest=(ms, gpu, float(plan.layouts[ms].memory), allowed),
                       headroom=headroom, unbounded=unbounded, colocation=colocation, offload=offload, notes=notes)


def _critical_shares(module: Module, plan: Plan) -> dict[str, float]:
    """Seconds each model-stage adds to the step: its time if it is in its stage's slowest group
    of GPU-sharing model-stages, else 0."""
    from .estimate import stage_groups

    out = {}
    for st in module.workloads[plan.workload].stages:
        mss = [ms for ms in st.model_stages() if ms in plan.layouts]
        groups = stage_groups(plan, mss)
        slow = max(groups, key=lambda g: sum(plan.layouts[ms].time for ms in g))
        for ms in mss:
            out[ms] = plan.layouts[ms].time if ms in slow else 0.0
    return out
