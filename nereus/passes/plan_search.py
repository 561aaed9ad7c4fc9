"""``plan-search{time_limit=S,seed=N,objective=step-time}``: a memory-feasible global plan by CP-SAT.

The model (see ``search_space`` for the abstraction it solves):

- ``x[i, c]``: model-stage i takes candidate c (exactly one per model-stage, after pruning);
- ``y[X, k]``: stage X groups its model-stages by partition k (exactly one per stage);
- GPUs: a group's block is as large as its largest member; a stage's blocks fit in the available
  GPUs (in capacity units that keep TP groups inside nodes when GPUs have failed);
- time: ``T[X] >= sum of the times of the members of each group``; minimise ``sum T[X]``;
- memory: ``R[X] >= resident state of each group``; for each model-stage,
  ``own peak - own resident + sum R[X] <= GPU memory``, and for generation
  ``sum R[X] - own resident <= the candidate's allowance rho``.

No variable is indexed by GPU: GPUs are interchangeable, and blocks are placed on GPU ids after
solving, largest first. Results go into the IR as a plan with a ``search`` record (status,
objective, bound, gap); ``estimate`` then annotates it with the cost model's per-GPU view.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from ..ir import Diagnostic, DiagnosticError, Layout, Loc, Module, Plan
from ..ir.model import even_split
from ..ir.plan import SearchRecord
from ..ir.units import Dim, format_quantity
from ..ir.printer import printed_precision
from .estimate import estimate_plan
from .pass_manager import ModulePass, Ref, register
from .cost_model import CostModel
from .search_space import SearchProblem, _candidates, build_problem


@dataclass
class Solution:
    status: str  # optimal | feasible | infeasible | unknown
    objective: int | None
    bound: int | None
    choice: dict[str, int] | None
    partition: dict[str, int] | None

    @property
    def gap(self) -> float:
        if self.objective is None or not self.objective:
            return 0.0
        return (self.objective - self.bound) / self.objective


def solve(problem: SearchProblem, time_limit: float = 10.0, seed: int = 0) -> Solution:
    """CP-SAT on ``problem``; deterministic for a given seed (one worker)."""
    m = cp_model.CpModel()
    x, n_of, t_of, a_of, r_of = {}, {}, {}, {}, {}
    for ms, space in problem.spaces.items():
        if not space.options:
            return Solution("infeasible", None, None, None, None)
        xs = [m.new_bool_var(f"x[{ms},{c}]") for c in range(len(space.options))]
        m.add_exactly_one(xs)
        x[ms] = xs
        # one integer per quantity, tied once to the one-hot choice, so that the grouping
        # constraints below do not repeat the long sums (5x smaller model, faster presolve)
        for table, label, value in ((n_of, "n", lambda o: o.units), (t_of, "t", lambda o: o.time),
                                    (a_of, "a", lambda o: o.peak - o.resident), (r_of, "r", lambda o: o.resident)):
            vals = [value(o) for o in space.options]
            var = m.new_int_var(min(vals), max(vals), f"{label}[{ms}]")
            m.add(var == sum(v * b for v, b in zip(vals, xs)))
            table[ms] = var
    max_t = sum(max(o.time for o in s.options) for s in problem.spaces.values())  # bounds of T and R
    max_r = sum(max(o.resident for o in s.options) for s in problem.spaces.values())
    T, R, y = {}, {}, {}
    for stage, mss in problem.stages:
        T[stage] = m.new_int_var(0, max_t, f"T[{stage}]")
        R[stage] = m.new_int_var(0, max_r, f"R[{stage}]")
        ys = [m.new_bool_var(f"y[{stage},{k}]") for k in range(len(problem.partitions[stage]))]
        m.add_exactly_one(ys)
        y[stage] = ys
        for k, (groups, yk) in enumerate(zip(problem.partitions[stage], ys)):
            blocks = []
            for gi, g in enumerate(groups):
                if len(g) == 1:
                    blocks.append(n_of[g[0]])
                else:
                    b = m.new_int_var(0, problem.capacity, f"B[{stage},{k},{gi}]")
                    for ms in g:
                        m.add(b >= n_of[ms]).only_enforce_if(yk)
                    blocks.append(b)
                m.add(T[stage] >= sum(t_of[ms] for ms in g)).only_enforce_if(yk)
                m.add(R[stage] >= sum(r_of[ms] for ms in g)).only_enforce_if(yk)
            m.add(sum(blocks) <= problem.capacity).only_enforce_if(yk)
    resident = m.new_int_var(0, max_r, "resident")
    m.add(resident == sum(R.values()))
    for ms, space in problem.spaces.items():
        # per option: the option may be taken only if what stays resident leaves it room.
        # (One enforced bound per option, not one aggregated sum: a much tighter LP.)
        m.add(a_of[ms] + resident <= problem.memory)
        if space.kind == "generate":
            m.add(resident - r_of[ms] <= sum(o.rho * v for o, v in zip(space.options, x[ms])))
    m.minimize(sum(T.values()))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit)
    solver.parameters.random_seed = int(seed)
    solver.parameters.num_workers = 1  # byte-identical plans for the same input and seed
    # Presolve dominated the solve on the 1,024-GPU job and found little: no probing and one
    # presolve round make it several times faster, with the same optimum (an earlier profile; the
    # solve time now is in docs/PERFORMANCE.md, from nereus bench plan-search).
    solver.parameters.cp_model_probing_level = 0
    solver.parameters.max_presolve_iterations = 1
    status = solver.solve(m)
    name = {cp_model.OPTIMAL: "optimal", cp_model.FEASIBLE: "feasible", cp_model.INFEASIBLE: "infeasible"}.get(status, "unknown")
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return Solution(name, None, None, None, None)
    choice = {ms: next(c for c, v in enumerate(xs) if solver.boolean_value(v)) for ms, xs in x.items()}
    partition = {s: next(k for k, v in enumerate(ys) if solver.boolean_value(v)) for s, ys in y.items()}
    objective = int(round(solver.objective_value))
    bound = objective if status == cp_model.OPTIMAL else int(solver.best_objective_bound)
    return Solution(name, objective, bound, choice, partition)


def place_blocks(gpus: list[int], per_node: int, blocks: list[tuple[int, int]]) -> list[list[int]]:
    """GPU ids for each (size, tp) block, keeping every TP group of ``tp`` GPUs inside one node.

    Blocks are served in the given order from the nodes' free GPUs, ``tp`` GPUs at a time from
    nodes that still have that many; what cannot be served that way (too many failed GPUs)
    takes any free GPUs, and ``estimate`` then charges the cross-node TP links it implies.
    """
    free: dict[int, list[int]] = {}
    for g in gpus:
        free.setdefault(g // per_node, []).append(g)
    out = []
    for size, tp in blocks:
        got: list[int] = []
        for node in sorted(free, key=lambda n: (len(free[n]) % tp != 0, n)):
            while len(got) + tp <= size and len(free[node]) >= tp:
                got.extend(free[node][:tp])
                del free[node][:tp]
        if len(got) < size:  # fall back: any free GPUs
            rest = [g for node in sorted(free) for g in free[node]][: size - len(got)]
            for g in rest:
                free[g // per_node].remove(g)
            got.extend(rest)
        out.append(got)
    return out


def to_plan(problem: SearchProblem, sol: Solution, name: str, workload: str, cluster: str) -> Plan:
    """Lay the chosen blocks out on GPU ids: largest block first, TP groups inside nodes."""
    layouts, colocate = {}, []
    per_node = problem.cluster.gpus_per_node
    for stage, _ in problem.stages:
        groups = problem.partitions[stage][sol.partition[stage]]
        opts = {ms: problem.spaces[ms].options[sol.choice[ms]] for g in groups for ms in g}
        groups = sorted(groups, key=lambda g: (-max(opts[ms].gpus for ms in g), g[0]))
        # a block is sized for its largest member, in chunks of the largest TP among its members
        # (TP sizes here divide one another, so smaller TP groups stay inside nodes too)
        blocks = [(max(opts[ms].gpus for ms in g), max(opts[ms].tp for ms in g)) for g in groups]
        for g, mesh in zip(groups, place_blocks(problem.gpus, per_node, blocks)):
            if len(g) > 1:
                colocate.append(list(g))
            for ms in g:
                o = opts[ms]
                layers = problem.models[ms.rpartition(".")[0]].layers
                ranges = [(lo, hi - 1) for lo, hi in (even_split(layers, o.pp, r) for r in range(o.pp))]
                layouts[ms] = Layout(model_stage=ms, tp=o.tp, pp=o.pp, dp=o.dp, layers=ranges, mesh=list(mesh[:o.gpus]),
                                     micro_batches=o.micro_batches, zero=o.zero, recompute=o.recompute,
                                     offload=[k for k in ("weights", "grads", "optimizer") if k in o.offload])
    order = [ms for _, mss in problem.stages for ms in mss]
    layouts = {ms: layouts[ms] for ms in order}
    return Plan(name=name, workload=workload, cluster=cluster, colocate=colocate, layouts=layouts)


def infeasible_diagnostic(problem: SearchProblem, loc: Loc) -> Diagnostic:
    """Name the tightest model-stage and the memory it would need."""
    gib = lambda mib: format_quantity(Dim.SIZE, int(mib) * 2**20) if mib * 2**20 % 2**30 == 0 else f"{mib / 1024:.2f} GiB"
    empty = [ms for ms, s in problem.spaces.items() if not s.options]
    if empty:
        ms = empty[0]
        need = _min_need(problem, ms)
        what = f"at least {gib(need)} per GPU" if need is not None else "more GPUs than the cluster has"
        return Diagnostic(loc, f"no plan fits: {ms} needs {what} at its smallest layout on {problem.n} available GPUs, "
                               f"the GPUs have {gib(problem.memory)}",
                          "add GPUs, use GPUs with more memory, or shorten the responses")
    # every model-stage fits alone: the sum of what stays resident is the problem
    floor = {ms: min(o.resident for o in s.options) for ms, s in problem.spaces.items()}
    tight = max(problem.spaces, key=lambda ms: min(o.peak - o.resident for o in problem.spaces[ms].options) + sum(floor.values()))
    need = min(o.peak - o.resident for o in problem.spaces[tight].options) + sum(floor.values())
    return Diagnostic(loc, f"no plan fits: {tight} would need {gib(need)} per GPU with the state the other model-stages "
                           f"keep resident, the GPUs have {gib(problem.memory)}",
                      "offload state between stages, add GPUs, or shorten the responses")


def _min_need(problem: SearchProblem, ms: str) -> int | None:
    """The smallest own peak (MiB) of ``ms`` over every layout on the available GPUs, ignoring memory limits."""
    kind = problem.spaces[ms].kind
    model = problem.models[ms.rpartition(".")[0]]
    c = _candidates(CostModel(problem.cluster), problem.cluster, problem.workload, model, kind, problem.n,
                    problem.cluster.gpus_per_node)
    peaks = c["peak"][np.isfinite(c["time"])] if len(c["peak"]) else []
    return int(min(peaks)) if len(peaks) else None


@register
@dataclass(frozen=True)
class PlanSearch(ModulePass):
    """Options: ``time_limit`` (s), ``seed``, ``objective`` (step-time), ``workload``/``cluster``
    (``@name``; default: the only one), ``into`` (``@name`` of the new plan; default ``@<workload>_searched``),
    ``max_pp`` (0: any), ``max_zero`` and ``offload`` (false: none): only layouts the job can run."""

    name = "plan-search"
    time_limit: float = 10.0
    seed: int = 0
    objective: str = "step-time"
    workload: Ref = ""
    cluster: Ref = ""
    into: Ref = ""
    max_pp: int = 0
    max_zero: int = 3
    offload: bool = True

    def apply(self, module: Module) -> None:
        if self.objective != "step-time":
            raise DiagnosticError([Diagnostic(Loc(0, 0, module.filename), f"plan-search: unknown objective '{self.objective}'",
                                              "objectives: step-time")])
        w = _pick(module, "workload", self.workload)
        c = _pick(module, "cluster", self.cluster)
        problem = build_problem(c, w, module.models, max_pp=self.max_pp, max_zero=self.max_zero, offload=self.offload)
        sol = solve(problem, self.time_limit, self.seed)
        if sol.status == "unknown":
            raise DiagnosticError([Diagnostic(w.loc, f"plan-search found no plan within time_limit={self.time_limit:g} s "
                                                     "(and could not prove there is none)", "raise time_limit")], module.source)
        if sol.choice is None:
            raise DiagnosticError([infeasible_diagnostic(problem, w.loc)], module.source)
        if sol.status != "optimal":
            module.warnings.append(Diagnostic(w.loc, f"plan-search stopped at time_limit={self.time_limit:g} s without proving "
                                                     f"optimality: the plan is within {sol.gap:.2%} of the best possible",
                                              "raise time_limit for a proof", severity="warning"))
        name = self.into.lstrip("@") or f"{w.name}_searched"
        plan = to_plan(problem, sol, name, w.name, c.name)
        plan.search = SearchRecord(status=sol.status, objective=printed_precision(sol.objective * problem.unit_s),
                                   bound=printed_precision(sol.bound * problem.unit_s), gap=printed_precision(sol.gap, 4),
                                   candidates=sum(len(s.options) for s in problem.spaces.values()))
        module.plans[name] = plan
        problems = estimate_plan(module, plan)
        if problems:  # the conservative memory model should make this impossible
            raise DiagnosticError(problems, module.source)


def _pick(module: Module, kind: str, name: str):
    table = getattr(module, kind + "s")
    if name:
        if name.lstrip("@") not in table:
            raise DiagnosticError([Diagnostic(Loc(0, 0, module.filename), f"plan-search: no {kind} {name}")])
        return table[name.lstrip("@")]
    if len(table) != 1:
        raise DiagnosticError([Diagnostic(Loc(0, 0, module.filename),
                                          f"plan-search needs {kind}=@name: the module has {len(table)} {kind}s")])
    return next(iter(table.values()))
