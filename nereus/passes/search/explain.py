"""Why plan-search chose its plan (``plan-search{explain=true}``, ``nereus opt --explain``).

The runner-ups and the memory, colocation and offload figures are each a solve of the same
problem with one thing changed: an optimum, or a line saying it was not proven in its share of
the time limit. Percentages are against the chosen plan's solver objective, the figure the
re-solves are comparable with (``estimate`` may differ from it by ``estimate_gap``).

- the runner-up of each model-stage: the best plan whose layout of it has other TP, PP or DP
  sizes, and that plan's step time;
- the bottleneck: the model-stage taking the largest share of the step (``estimate``'s times);
- memory: the fullest GPU against what the headroom leaves, and the best step time if what
  model-stages keep on shared GPUs did not count against each other (every layout still fits
  on its own, generation's KV cache no longer shrinks for others' state): memory binds when
  it is lower;
- colocation and offload: when the plan uses them, the best plan without; when it does not,
  whether they were in the search at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import cast

from ...ir import Module, Plan
from ...ir.plan import RunnerUp
from ...ir.units import format_bytes
from ..cost.layout_costs import layout_costs, stage_groups
from .space import NO_RHO, SearchProblem, Space

MIN_SOLVE_S = 0.5  # each re-solve gets at least this long, so the whole may pass time_limit a little


@dataclass
class Explanation:
    """What ``explain`` found; ``lines()`` says it in words. Times in seconds, memory in bytes."""

    plan: str
    step_time: float  # estimate's
    objective: float  # the solver's, what the re-solves compare with
    shares: dict[str, float]  # model-stage -> seconds of the step it is on the critical path
    bottleneck: str
    runner_ups: dict[str, RunnerUp | None]  # None: no plan without this model-stage's layout
    fullest: tuple[str, int, float, float]  # model-stage, GPU, bytes used, bytes allowed
    headroom: float
    generation_fullest: bool  # the fullest is a generation stage, which keeps vLLM's own 10%
    unbounded: float | None  # when model-stages sharing GPUs do not limit each other's memory
    colocation: str
    offload: str
    notes: list[str] = field(default_factory=list)

    def change(self, x: float) -> str:
        return f"{(x - self.objective) / self.objective:+.1%}"

    def lines(self) -> list[str]:
        s = _seconds
        out = [
            f"plan @{self.plan}: step {s(self.step_time)}; bottleneck {self.bottleneck} "
            f"({self.shares[self.bottleneck] / self.step_time:.0%} of the step)"
        ]
        for ms, r in self.runner_ups.items():
            if r is None:
                out.append(f"  {ms}: no plan with other TP/PP/DP sizes for it")
            else:
                out.append(
                    f"  {ms}: runner-up TP {r.tp} x PP {r.pp} x DP {r.dp}"
                    + (f" ZeRO {r.zero}" if r.zero else "")
                    + f", step {s(r.step_time)} ({self.change(r.step_time)})"
                )
        ms, gpu, used, allowed = self.fullest
        kept = (
            "generation keeps vLLM's own 10% free"
            if self.generation_fullest
            else f"{self.headroom:.0%} headroom kept free"
        )
        out.append(
            f"  memory: fullest GPU {gpu} holds {format_bytes(used)} during {ms}, of {format_bytes(allowed)} allowed "
            f"({kept})"
        )
        if self.unbounded is not None and self.unbounded < self.objective * (1 - 1e-6):
            out.append(
                f"  memory binds: if what model-stages keep on shared GPUs did not count against each "
                f"other, the best step would be {s(self.unbounded)} ({self.change(self.unbounded)})"
            )
        else:
            out.append("  memory shared between model-stages does not bind: without that limit no plan is faster")
        out.append(f"  colocation: {self.colocation}")
        out.append(f"  offload: {self.offload}")
        out.extend("  " + n for n in self.notes)
        return out


def _seconds(x: float) -> str:
    return f"{x:.2f} s" if x >= 1 else f"{x * 1e3:.1f} ms"


def without(problem: SearchProblem, keep) -> SearchProblem:
    """``problem`` with only the options ``keep(model_stage, option)`` accepts."""
    spaces = {
        ms: Space(sp.model_stage, sp.kind, [o for o in sp.options if keep(ms, o)], sp.generated)
        for ms, sp in problem.spaces.items()
    }
    return replace(problem, spaces=spaces)


def _unshared(problem: SearchProblem) -> SearchProblem:
    """``problem`` where what model-stages keep on shared GPUs does not count against each other."""
    spaces = {
        ms: Space(sp.model_stage, sp.kind, [replace(o, rho=NO_RHO) for o in sp.options], sp.generated)
        for ms, sp in problem.spaces.items()
    }
    return replace(problem, spaces=spaces, memory=NO_RHO)


def explain(
    module: Module,
    plan: Plan,
    problem: SearchProblem,
    choice: dict[str, int],
    objective: float,
    solve,
    time_limit: float,
) -> Explanation:
    """Explain ``plan`` (placed from ``choice``, option indices of ``problem``, whose solver
    objective is ``objective`` seconds); ``solve(problem, time_limit)`` is plan-search's solver.
    Each re-solve gets an even share of ``time_limit`` (at least ``MIN_SOLVE_S``)."""
    share = max(time_limit / (len(problem.spaces) + 3), MIN_SOLVE_S)
    notes = []

    def best(p: SearchProblem, what: str):
        sol = solve(p, share)
        if sol.status not in ("optimal", "infeasible"):
            notes.append(f"{what} is the best found in {share:.1f} s, not proven best")
        return (sol.objective * p.unit_s if sol.objective is not None else None), sol

    runner_ups: dict[str, RunnerUp | None] = {}
    for ms, c in choice.items():
        o = problem.spaces[ms].options[c]
        sizes = (o.tp, o.pp, o.dp)
        other = without(problem, lambda m, x: m != ms or (x.tp, x.pp, x.dp) != sizes)
        step, sol = best(other, f"{ms}'s runner-up")
        if step is None:
            runner_ups[ms] = None
            continue
        r = other.spaces[ms].options[sol.choice[ms]]
        runner_ups[ms] = RunnerUp(tp=r.tp, pp=r.pp, dp=r.dp, zero=r.zero, step_time=round(step, 6))

    unbounded, _ = best(_unshared(problem), "the step without shared-memory limits")

    pct = lambda step: f"{(step - objective) / objective:+.1%}"
    if plan.colocate:
        singles = {st: [p for p in parts if all(len(g) == 1 for g in p)] for st, parts in problem.partitions.items()}
        step, _ = best(replace(problem, partitions=singles), "the step without colocation")
        groups = "; ".join(" + ".join(g) for g in plan.colocate)
        colocation = f"{groups} share GPUs; with no two model-stages of a stage sharing GPUs the best step is " + (
            f"{_seconds(step)} ({pct(step)})" if step is not None else "none: no plan fits"
        )
    elif any(len(mss) > 1 for _, mss in problem.stages):
        colocation = "searched; no plan where model-stages of one stage share GPUs is faster"
    else:
        colocation = "no stage runs more than one model"

    cluster = problem.cluster
    offloaders = [ms for ms, lay in plan.layouts.items() if lay.offload]
    if offloaders:
        step, _ = best(without(problem, lambda m, x: not x.offload), "the step without offload")
        offload = f"{', '.join(offloaders)} offload; without offload the best step is " + (
            f"{_seconds(step)} ({pct(step)})" if step is not None else "none: no plan fits"
        )
    elif cluster.host_link is None or cluster.host_memory is None:
        missing = " and ".join(k for k in ("host_link", "host_memory") if getattr(cluster, k) is None)
        offload = f"not searched: cluster @{cluster.name} declares no {missing}"
    elif not any(o.offload for sp in problem.spaces.values() for o in sp.options):
        offload = "not searched (offload=false, or no layout keeps state worth offloading)"
    else:
        offload = "searched; no plan that offloads is faster"

    shares = _critical_shares(module, plan)
    gpu_of = {
        ms: max(lc.others.items(), key=lambda kv: (kv[1], -kv[0]))[0] for ms, lc in layout_costs(module, plan).items()
    }
    ms = max(plan.layouts, key=lambda x: plan.layouts[x].memory or 0)
    generating = problem.spaces[ms].kind == "generate"
    allowed = cluster.gpu_memory if generating else cluster.gpu_memory * (1 - problem.headroom)
    assert plan.step_time is not None  # the plan is estimated
    return Explanation(
        plan=plan.name,
        step_time=plan.step_time,
        objective=objective,
        shares=shares,
        bottleneck=max(shares, key=shares.get),  # type: ignore[arg-type]
        runner_ups=runner_ups,
        fullest=(ms, gpu_of[ms], float(cast(int, plan.layouts[ms].memory)), allowed),
        headroom=problem.headroom,
        generation_fullest=generating,
        unbounded=unbounded,
        colocation=colocation,
        offload=offload,
        notes=notes,
    )


def _critical_shares(module: Module, plan: Plan) -> dict[str, float]:
    """Seconds each model-stage adds to the step: its time if it is in its stage's slowest group
    of GPU-sharing model-stages, else 0."""
    out: dict[str, float] = {}
    for st in module.workloads[plan.workload].stages:
        mss = [ms for ms in st.model_stages() if ms in plan.layouts]
        slow = max(stage_groups(plan, mss), key=lambda g: sum(cast(float, plan.layouts[ms].time) for ms in g))
        for ms in mss:
            out[ms] = cast(float, plan.layouts[ms].time) if ms in slow else 0.0
    return out
