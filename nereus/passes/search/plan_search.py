"""``plan-search{time_limit=S,seed=N,objective=step-time}``: a memory-feasible global plan by CP-SAT.

The model (see ``search.space`` for the abstraction and the candidate space):

- ``w[i, c, k]``: model-stage i takes candidate c starting in start class k (exactly one);
  its GPU count, time (``estimate``'s for the mesh at that start), extra peak, resident state
  and generation allowance are sums over them; ``s[i]`` is the first position of its run;
- ``y[X, k]``: stage X groups its model-stages by partition k (exactly one per stage); members
  of a group share their start, runs of different groups of a stage do not overlap;
- time: ``T[X] >= sum of the times of the members of each group``; minimise ``sum T[X]``;
- memory: exactly ``estimate``'s per GPU. The state on a GPU changes only where a run starts,
  so every model-stage is checked at its own start and at every start inside its run:
  ``extra[i] + load(start) <= memory`` and, for generation, ``load(start) - resident[i] <= rho[i]``.

Solved by tightening caps on the step time (``solve``, ``search.bounds``): only the candidates
a plan under the cap can use enter the model, so a 1,024-GPU job is proven optimal over a few
percent of its candidates.

What is approximate, and how the result says so: times are rounded up to integer units (a
step of the fastest candidates is a million units); on large jobs the candidate space is
thinner (``layout_grid(full=False)``) and runs start aligned, so the optimum is proven for that
space only. Every searched plan is placed and re-estimated; the ``search`` record keeps the
solver's status, objective, bound and gap, and ``estimate`` (the placed plan's step time) with
``estimate_gap`` = (objective - estimate) / estimate.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, cast

import numpy as np
from ortools.sat.python import cp_model

from ...ir import Diagnostic, DiagnosticError, Layout, Loc, Module, Plan
from ...ir.diagnostics import plural
from ...ir.model import even_split
from ...ir.plan import SearchRecord
from ...ir.printer import printed_precision
from ...ir.units import Dim, format_quantity
from ..cost.cost_model import VLLM_GPU_MEMORY_UTILIZATION, Candidates, CostModel
from ..cost.estimate import estimate_plan
from ..infra.pass_manager import ModulePass, Ref, api_option, check_time_limit, no_such, register
from ..infra.solver_budget import Budget
from .bounds import option_bounds, restrict, stage_bounds
from .explain import explain
from .space import (
    ANYWHERE,
    DEFAULT_HEADROOM,
    KIB,
    SPAN,
    SearchProblem,
    build_problem,
    columns,
    layout_grid,
    sequence_parallel,
)

FIRST_SLACK = 64  # the first cap: lb + lb / FIRST_SLACK
SLACK_GROWTH = 4  # each next cap: lb + SLACK_GROWTH x the slack before


@dataclass
class Solution:
    status: str  # optimal | feasible | infeasible | unknown
    objective: int | None
    bound: int | None
    choice: dict[str, int] | None  # model-stage -> option index
    start: dict[str, int] | None  # model-stage -> first position of its run
    partition: dict[str, int] | None  # stage -> partition index
    options: int = 0  # options in the model solved last (``solve``: under its last cap)

    @property
    def gap(self) -> float:
        if self.objective is None or not self.objective:
            return 0.0
        # a solution with an objective has a bound, but for placed()'s, which never get here
        return (self.objective - cast(int, self.bound)) / self.objective


def solve(
    problem: SearchProblem,
    time_limit: float = 10.0,
    seed: int = 0,
    known: Solution | None = None,
    deterministic: bool = False,
) -> Solution:
    """The optimal plan of ``problem`` (CP-SAT, deterministic for a given seed: one worker).

    Solved under a cap on the step time: with ``lb`` the bound of ``search.bounds``, the model
    holds only the options a plan at most ``cap`` can use (``restrict``), ``cap`` = ``lb`` plus
    1/64 of it at first. If the model's optimum is within the cap, it is the optimum of the whole
    problem (a better plan would use only kept options). Otherwise no plan is within the cap, and
    the cap grows (1/16, 1/4, ... of ``lb`` over it), but never past the best plan found so far
    (a model's optimum above its cap is a plan of the problem too): a model that holds that
    plan, given to CP-SAT as its hint, and every better one. ``known``: a plan of the problem
    (``placed``), the best so far from the start, so the first cap is at most its step time. So
    the result, its status and its bound are those of the whole problem; on a time-out, the best
    plan so far with the bound proven so far. ``deterministic``: ``time_limit`` is CP-SAT's
    deterministic time (``infra.solver_budget``), so a time-out too gives the same plan under load."""
    budget = Budget(float(time_limit), deterministic)
    bounds = option_bounds(problem)
    lb = floor = sum(stage_bounds(problem, bounds).values())  # no plan is faster than floor
    slack = max(lb // FIRST_SLACK, 1)
    cap = lb + slack
    best = None  # the best plan found so far (choice in the problem's option indices)
    if known is not None and known.objective is not None:  # a plan of the problem: the optimum is no slower
        best = known
        cap = min(cap, known.objective)
    while True:
        model, keep, complete = restrict(problem, bounds, cap)
        hint = None
        if best is not None:  # unless pruning dropped one of its options for one that dominates it
            assert best.choice is not None  # best is a plan
            index = {ms: {int(c): i for i, c in enumerate(kept)} for ms, kept in keep.items()}
            if all(c in index[ms] for ms, c in best.choice.items()):
                hint = replace(best, choice={ms: index[ms][c] for ms, c in best.choice.items()})
        sol = _solve_model(model, budget, seed, hint)
        sol.options = sum(len(sp.options) for sp in model.spaces.values())
        if sol.choice is not None:
            sol.choice = {ms: int(keep[ms][c]) for ms, c in sol.choice.items()}
        if sol.status == "unknown":  # out of time: the best plan so far
            return _timed_out(best, floor)
        # every plan at most cap fast was in the model
        if sol.choice is not None and (complete or cast(int, sol.objective) <= cap):
            if sol.status != "optimal":
                assert sol.bound is not None  # a plan CP-SAT found comes with its bound
                sol.bound = max(sol.bound, floor)
            return sol
        if complete:  # infeasible
            return sol
        if (
            sol.status == "feasible"
        ):  # out of time, with a plan above the cap: a better one is above the model's bound or the cap
            assert sol.bound is not None  # a plan CP-SAT found comes with its bound
            return _timed_out(sol, max(min(sol.bound, cap + 1), floor))
        floor = cap + 1  # no plan at most cap fast
        if sol.choice is not None and (best is None or cast(int, sol.objective) < cast(int, best.objective)):
            best = sol
        slack *= SLACK_GROWTH
        cap = lb + slack
        if best is not None and cast(int, best.objective) <= cap:
            cap = cast(int, best.objective)


def placed(problem: SearchProblem, plan: Plan) -> Solution | None:
    """``plan`` as a solution of ``problem`` (its options, starts and groups, with its step time
    in the problem's units), or None where the problem has no such plan: a layout that is not
    among its candidates, a mesh that is not a run of its positions, or a plan that breaks one
    of its constraints (memory, say, when the responses grew). Of the generation candidates of
    one layout (one per allowance for others' state), the fastest that the plan satisfies."""
    pos = problem.positions
    index = {g: i for i, g in enumerate(pos.gpus)}
    choices, start = {}, {}
    for ms, sp in problem.spaces.items():
        lay = plan.layouts.get(ms)
        if lay is None or not lay.mesh or lay.mesh[0] not in index:
            return None
        if lay.pipeline_schedule != lay.megatron_schedule or lay.tp_overlap or not lay.dp_overlap:
            return None  # the search's candidates run Megatron's schedules, without TP overlap, DP overlapped
        if lay.attention != "flash":
            return None  # ... and flash attention
        if lay.pp_overlapped != (lay.vpp > 1):
            return None  # ... and their pipeline sends as Megatron does
        s = start[ms] = index[lay.mesh[0]]
        if list(pos.gpus[s : s + len(lay.mesh)]) != list(lay.mesh):
            return None
        col, opts = columns(sp.options), sp.options
        rows = np.flatnonzero(
            (col["tp"] == lay.tp)
            & (col["pp"] == lay.pp)
            & (col["dp"] == lay.dp)
            & (col["vpp"] == lay.vpp)
            & (col["ep"] == lay.ep)
            & (col["etp"] == lay.expert_tp)
            & (col["mb"] == lay.micro_batches)
            & (col["rc"] == bool(lay.recompute))
            & (col["zero"] == lay.zero)
        )
        k = pos.class_of(s, len(lay.mesh))
        same = [c for c in rows.tolist() if k in opts[c].times and frozenset(opts[c].offload) == frozenset(lay.offload)]
        if not same:
            return None
        choices[ms] = sorted(same, key=lambda c: (opts[c].times[k], c))
    partition = {}
    together = [set(g) for g in plan.colocate]
    for stage, mss in problem.stages:
        groups = {frozenset(g & set(mss)) for g in together if len(g & set(mss)) > 1}
        groups |= {frozenset([ms]) for ms in mss if not any(ms in g for g in groups)}
        found = [i for i, part in enumerate(problem.partitions[stage]) if {frozenset(g) for g in part} == groups]
        if not found:
            return None
        partition[stage] = found[0]
    # a layout's candidates differ only in the allowance for others' state (generation), so what
    # others keep on each GPU is known: only the allowances that cover it can be the plan's
    load = np.zeros(pos.n, dtype=np.int64)
    for ms, cs in choices.items():
        o = problem.spaces[ms].options[cs[0]]
        load[start[ms] : start[ms] + o.gpus] += o.resident
    for ms, cs in choices.items():
        opts = problem.spaces[ms].options
        here = int(load[start[ms] : start[ms] + opts[cs[0]].gpus].max())
        choices[ms] = [c for c in cs if here - opts[c].resident <= opts[c].rho]
    for choice in itertools.islice(itertools.product(*choices.values()), 64):  # the allowances, fastest first
        pick = dict(zip(choices, choice))
        value = problem.evaluate(pick, start, partition)
        if value is not None:
            return Solution("feasible", value, None, pick, start, partition)
    return None


def _timed_out(best: Solution | None, bound: int) -> Solution:
    if best is None:
        return Solution("unknown", None, None, None, None, None)
    assert best.objective is not None  # best is a plan
    return replace(best, status="feasible", bound=min(bound, best.objective))


def _solve_model(problem: SearchProblem, budget: Budget, seed: int, hint: Solution | None = None) -> Solution:
    """CP-SAT on ``problem``'s whole model, starting from ``hint`` (a plan of it) if given;
    deterministic for a given seed (one worker)."""
    pos = problem.positions
    n, pn = pos.n, pos.per_node
    m = cp_model.CpModel()
    G: dict[str, Any]
    t: dict[str, Any]
    a: dict[str, Any]
    r: dict[str, Any]
    rho: dict[str, Any]
    pick, G, t, a, r, rho, s = {}, {}, {}, {}, {}, {}, {}
    for ms, space in problem.spaces.items():
        if not space.options:
            return Solution("infeasible", None, None, None, None, None)
        # one boolean per (option, start class); the quantities are sums over them
        w = {(c, k): m.new_bool_var(f"w[{ms},{c},{k}]") for c, o in enumerate(space.options) for k in o.times}
        m.add_exactly_one(w.values())
        pick[ms] = w
        opts = space.options
        for table, label, value in (
            (G, "G", lambda c, k: opts[c].gpus),
            (t, "t", lambda c, k: opts[c].times[k]),
            (a, "a", lambda c, k: opts[c].extra),
            (r, "r", lambda c, k: opts[c].resident),
            (rho, "rho", lambda c, k: min(opts[c].rho, problem.memory)),
        ):
            vals = {ck: value(*ck) for ck in w}
            var = m.new_int_var(min(vals.values()), max(vals.values()), f"{label}[{ms}]")
            m.add(var == sum(v * w[ck] for ck, v in vals.items()))
            table[ms] = var
        # start = the class's first start + a whole number of nodes (a run inside a segment), the
        # run's own start (across segments), or any start (ANYWHERE); the run ends in its segment
        s[ms] = m.new_int_var(0, n - 1, f"s[{ms}]")
        terms, ends, anywhere = [], [], []
        by_segment: dict[int, list] = {}
        for (c, k), b in w.items():
            if k == ANYWHERE:
                base, end = 0, n
                anywhere.append(b)
            elif k >= SPAN:
                base, end = k - SPAN, n
            else:
                base, _, end, _ = pos.segment(k)
                by_segment.setdefault(k // pn, []).append(b)
            terms.append(base * b)
            ends.append(end * b)
        for seg, bs in by_segment.items():
            a_j, e_j, f_j = pos.segments[seg]
            top = max((e_j - a_j) // f_j - 1, 0)
            q = m.new_int_var(0, top, f"q[{ms},{seg}]")
            m.add(q <= top * sum(bs))
            terms.append(f_j * q)
        if anywhere:
            free = m.new_int_var(0, n, f"free[{ms}]")
            m.add(free <= n * sum(anywhere))
            terms.append(free)
        m.add(s[ms] == sum(terms))
        m.add(s[ms] + G[ms] <= sum(ends))
    names = list(problem.spaces)
    max_t = sum(max(max(o.times.values()) for o in sp.options) for sp in problem.spaces.values())
    T, y, before = {}, {}, {}
    for stage, mss in problem.stages:
        T[stage] = m.new_int_var(0, max_t, f"T[{stage}]")
        ys = [m.new_bool_var(f"y[{stage},{k}]") for k in range(len(problem.partitions[stage]))]
        m.add_exactly_one(ys)
        y[stage] = ys
        for i, j in itertools.combinations(mss, 2):  # which of two disjoint runs comes first
            before[i, j] = m.new_bool_var(f"before[{i},{j}]")
        for kk, (groups, yk) in enumerate(zip(problem.partitions[stage], ys)):
            blocks = []  # redundant, for a tight relaxation: a stage's runs fit in the GPUs
            for gi, g in enumerate(groups):
                for other in g[1:]:
                    m.add(s[other] == s[g[0]]).only_enforce_if(yk)
                m.add(T[stage] >= sum(t[ms] for ms in g)).only_enforce_if(yk)
                if len(g) == 1:
                    blocks.append(G[g[0]])
                else:
                    b = m.new_int_var(0, n, f"B[{stage},{kk},{gi}]")
                    for ms in g:
                        m.add(b >= G[ms]).only_enforce_if(yk)
                    blocks.append(b)
            m.add(sum(blocks) <= n).only_enforce_if(yk)
            for ga, gb in itertools.combinations(groups, 2):
                for i in ga:
                    for j in gb:
                        i2, j2 = (i, j) if (i, j) in before else (j, i)
                        m.add(s[i2] + G[i2] <= s[j2]).only_enforce_if([yk, before[i2, j2]])
                        m.add(s[j2] + G[j2] <= s[i2]).only_enforce_if([yk, before[i2, j2].Not()])
    _break_symmetry(m, problem, s, t)
    _exact_memory(m, problem, names, s, G, a, r, rho)
    if problem.constraints is not None:  # a framework's ties (plan-search{target=...})
        problem.constraints.add(m, problem, pick, s, G)
    m.minimize(sum(T.values()))
    if hint is not None:
        assert hint.choice is not None and hint.start is not None and hint.partition is not None  # a plan
        for ms, w in pick.items():
            for (c, k), b in w.items():
                m.add_hint(
                    b, c == hint.choice[ms] and k == pos.class_of(hint.start[ms], problem.spaces[ms].options[c].gpus)
                )
            m.add_hint(s[ms], hint.start[ms])
        for st, ys in y.items():
            for k, b in enumerate(ys):
                m.add_hint(b, k == hint.partition[st])
    solver = cp_model.CpSolver()
    budget.limit(solver)
    solver.parameters.random_seed = int(seed)
    solver.parameters.num_workers = 1  # byte-identical plans for the same input and seed
    # presolve found little on these models and dominated small solves: no probing, one round
    solver.parameters.cp_model_probing_level = 0
    solver.parameters.max_presolve_iterations = 1
    # measured on 127 searches of a run of the combined trace (every third of the oracle's,
    # every second of the other policies', pickled and solved again alone, two settings side by
    # side): no LP relaxation (linearization 0: the relaxation has one row here and costs
    # propagation time), no search for big linear overlaps in presolve (up to half of a 0.2 s
    # solve at 1,024 GPUs), no symmetry detection (one generator of two variables on these
    # models), and the default search instead of the lower-bound search (which paid only with
    # the LP on): 16.6 -> 12.3 s on the oracle's 38 and 12.1 -> 9.6 s on the others' 89, every
    # optimum the same
    solver.parameters.linearization_level = 0
    solver.parameters.find_big_linear_overlap = False
    solver.parameters.symmetry_level = 0
    status = solver.solve(m)
    budget.charge(solver)
    name = {cp_model.OPTIMAL: "optimal", cp_model.FEASIBLE: "feasible", cp_model.INFEASIBLE: "infeasible"}.get(
        status, "unknown"
    )
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return Solution(name, None, None, None, None, None)
    choice = {ms: next(c for (c, _), v in w.items() if solver.boolean_value(v)) for ms, w in pick.items()}
    start = {ms: int(solver.value(s[ms])) for ms in names}
    partition = {st: next(k for k, v in enumerate(ys) if solver.boolean_value(v)) for st, ys in y.items()}
    objective = int(round(solver.objective_value))
    bound = objective if status == cp_model.OPTIMAL else int(solver.best_objective_bound)
    return Solution(name, objective, bound, choice, start, partition)


def _break_symmetry(m, problem: SearchProblem, s, t) -> None:
    """Two model-stages of one stage with the same candidates (a reference and the actor it
    copies, say) can swap options and runs without changing anything: keep only the swap whose
    (start, time) is lexicographically ordered."""

    def signature(ms):
        return tuple(
            (o.gpus, tuple(sorted(o.times.items())), o.extra, o.resident, o.rho) for o in problem.spaces[ms].options
        )

    tied = problem.constraints.members if problem.constraints is not None else set()
    for stage, mss in problem.stages:
        for i, j in itertools.combinations(mss, 2):
            if i not in tied and j not in tied and signature(i) == signature(j):  # a tie may tell them apart
                first = m.new_bool_var(f"first[{i},{j}]")
                m.add(s[i] + 1 <= s[j]).only_enforce_if(first)
                m.add(s[i] == s[j]).only_enforce_if(first.Not())
                m.add(t[i] <= t[j]).only_enforce_if(first.Not())


def _exact_memory(m, problem: SearchProblem, names, s, G, a, r, rho) -> None:
    """Memory per GPU exactly as ``estimate`` counts it. The state on a GPU changes only where a
    run starts, so it suffices to check every model-stage at its own start and at the start of
    every run that begins inside its run."""
    max_r = sum(max(o.resident for o in sp.options) for sp in problem.spaces.values())
    load, cover = {}, {}
    for k in names:
        terms = [r[k]]
        for j in names:
            if j == k:
                continue
            c = cover[k, j] = m.new_bool_var(f"cover[{k},{j}]")  # j's run holds k's first GPU
            side = m.new_bool_var(f"side[{k},{j}]")
            m.add(s[j] >= s[k] + 1).only_enforce_if([c.Not(), side])
            m.add(s[k] >= s[j] + G[j]).only_enforce_if([c.Not(), side.Not()])
            z = m.new_int_var(0, max(o.resident for o in problem.spaces[j].options), f"z[{k},{j}]")
            m.add(z >= r[j]).only_enforce_if(c)
            terms.append(z)
        load[k] = m.new_int_var(0, max_r, f"load[{k}]")
        m.add(load[k] == sum(terms))
    for i, space in problem.spaces.items():
        for k in names:
            on = [] if k == i else [cover[k, i]]
            m.add(a[i] + load[k] <= problem.memory).only_enforce_if(on)
            if space.kind == "generate":
                m.add(load[k] - r[i] <= rho[i]).only_enforce_if(on)


def to_plan(problem: SearchProblem, sol: Solution, name: str, workload: str, cluster: str) -> Plan:
    """The solution as a plan: each model-stage on the GPUs of its run, colocated groups declared."""
    assert sol.choice is not None and sol.start is not None and sol.partition is not None  # a plan
    layouts, colocate = {}, []
    for stage, _ in problem.stages:
        for g in problem.partitions[stage][sol.partition[stage]]:
            if len(g) > 1:
                colocate.append(list(g))
            for ms in g:
                o = problem.spaces[ms].options[sol.choice[ms]]
                layers = problem.models[ms.rpartition(".")[0]].layers
                ranges = [(lo, hi - 1) for lo, hi in (even_split(layers, o.pp, r) for r in range(o.pp))]
                mesh = problem.positions.gpus[sol.start[ms] : sol.start[ms] + o.gpus]
                layouts[ms] = Layout(
                    model_stage=ms,
                    tp=o.tp,
                    pp=o.pp,
                    dp=o.dp,
                    layers=ranges,
                    mesh=list(mesh),
                    micro_batches=o.micro_batches,
                    zero=o.zero,
                    recompute=o.recompute,
                    sp=bool(sequence_parallel(o.tp, problem.spaces[ms].kind)),
                    vpp=o.vpp,
                    ep=o.ep,
                    etp=o.etp,
                    offload=[k for k in ("weights", "grads", "optimizer") if k in o.offload],
                )
    order = [ms for _, mss in problem.stages for ms in mss]
    return Plan(
        name=name, workload=workload, cluster=cluster, colocate=colocate, layouts={ms: layouts[ms] for ms in order}
    )


def infeasible_diagnostic(problem: SearchProblem, loc: Loc) -> Diagnostic:
    """Say what does not fit: a model-stage that fits in no layout (with the memory its smallest
    layout needs), or, when each fits alone, that no combination fits together (with what each
    needs at least)."""
    gib = lambda b: format_quantity(Dim.SIZE, int(b)) if b % 2**30 == 0 else f"{b / 2**30:.3f} GiB"
    have = gib(problem.cluster.gpu_memory)
    if problem.headroom:  # what training and inference may use
        have += (
            f" of which training and inference may use {gib(problem.cluster.gpu_memory * (1 - problem.headroom))} "
            f"(headroom={problem.headroom:g} keeps the rest free)"
        )
    empty = [ms for ms, sp in problem.spaces.items() if not sp.options]
    if empty:
        ms = empty[0]
        need = min_need(problem, ms)
        what = (
            f"at least {gib(need)} per GPU at its smallest layout"
            if need is not None
            else "more GPUs than the cluster has"
        )
        return Diagnostic(
            loc,
            f"no plan fits: {ms} needs {what} on {problem.n} available GPUs, the GPUs have {have}",
            "add GPUs, use GPUs with more memory, or shorten the responses"
            + (", or lower plan-search{headroom=...}" if problem.headroom else ""),
        )
    reserve = int(
        np.ceil(problem.headroom * problem.cluster.gpu_memory / KIB)
    )  # counted in training and inference peaks
    alone = "; ".join(
        f"{ms} at least {gib((min(o.peak for o in sp.options) - reserve) * KIB)} while it runs, "
        f"{gib(min(o.resident for o in sp.options) * KIB)} kept between stages"
        for ms, sp in problem.spaces.items()
        if sp.kind != "generate"
    )
    gen = [ms for ms, sp in problem.spaces.items() if sp.kind == "generate"]
    return Diagnostic(
        loc,
        f"no plan fits: each model-stage fits on its own, but no placement of them together fits "
        f"in {have} per GPU on {plural(problem.n, 'GPU')} ({alone}"
        + (
            f"; {', '.join(gen)} also {'needs' if len(gen) == 1 else 'need'} room for the KV cache of "
            "at least one sequence"
            if gen
            else ""
        )
        + ")",
        "offload state between stages, add GPUs, or shorten the responses",
    )


def min_need(problem: SearchProblem, ms: str) -> float | None:
    """The least memory (bytes) ``ms`` needs on a GPU, over every layout on the available GPUs,
    with nothing else resident: its whole peak (generation: weights and one sequence's KV cache)."""
    kind = problem.spaces[ms].kind
    model = problem.models[ms.rpartition(".")[0]]
    cost = CostModel(problem.cluster)
    rows = layout_grid(
        model, problem.workload, kind, problem.n, problem.positions.per_node, problem.cluster.gpus_per_node
    )
    if not rows:
        return None
    tp, pp, dp, mb, rc, z, _, v, ep, etp = (list(col) for col in zip(*rows))
    sc = cost.stage(
        model,
        problem.workload,
        kind,
        Candidates.grid(
            problem.cluster,
            model.layers,
            tp,
            pp,
            dp,
            micro_batches=mb,
            recompute=rc,
            zero=z,
            sp=sequence_parallel(tp, kind),
            vpp=v,
            ep=ep,
            etp=etp,
        ),
    )
    if kind == "generate":
        layers = np.ceil(model.layers / np.array(pp))
        seq = problem.workload.prompt_len_mean + problem.workload.response_len_mean
        need = (
            sc.weights
            + seq * CostModel.kv_bytes_per_token(model, np.array(tp), layers)
            + model.vocab * 4 / np.array(tp)
        )
        return float(need.min() / VLLM_GPU_MEMORY_UTILIZATION)
    return float(sc.memory().min())


@register
@dataclass(frozen=True)
class PlanSearch(ModulePass):
    """Options: ``time_limit`` (s), ``seed``, ``deterministic`` (true: ``time_limit`` counts CP-SAT's
    deterministic time, so a search that times out still gives the same plan on a loaded
    machine; see ``infra.solver_budget``), ``objective`` (step-time), ``workload``/``cluster``
    (``@name``; default: the only one), ``into`` (``@name`` of the new plan; default ``@<workload>_searched``),
    ``max_pp`` (0: any), ``max_zero`` and ``offload`` (false: none): only layouts the job can run;
    ``headroom`` (fraction of GPU memory training and inference leave free for the CUDA context,
    NCCL buffers and fragmentation; default 0.1, see ``search_space.DEFAULT_HEADROOM``; generation
    keeps vLLM's own 10%); ``explain`` (true: re-solve to say why, see ``search.explain``: a
    runner-up per model-stage, the bottleneck, whether memory, colocation and offload matter);
    ``incumbent`` (``@name`` of a plan, the running one, say: where it is still a plan of the
    problem, on the same GPUs and fitting, the search starts from it and only proves that nothing
    is faster, usually on far fewer candidates; the result is the same optimum). From Python,
    ``keep``: ``keep(model_stage, options, n)`` returns the options of each model-stage's search
    space that a kind of system can run (the simulator's restarting policies keep their TP/PP).
    ``target`` (``verl``, ``openrlhf`` or ``megatron``; default: none, the free search): only
    plans that framework runs as written, by its own rules (``search.targets``: verl puts every
    role on all GPUs, runs a stage's model-stages one after another, gives training and
    inference one set of model-parallel sizes, FSDP's ZeRO-2/3 or Megatron's ZeRO-1, and no
    rollout PP; OpenRLHF one placement group per model unless colocated, one DeepSpeed TP and
    ZeRO stage for all, no PP; Megatron-LM ZeRO-1 to 3 and one flush per global batch)."""

    name = "plan-search"
    time_limit: float = 10.0
    seed: int = 0
    deterministic: bool = False
    objective: str = "step-time"
    workload: Ref = ""
    cluster: Ref = ""
    into: Ref = ""
    max_pp: int = 0
    max_zero: int = 3
    offload: bool = True
    headroom: float = DEFAULT_HEADROOM
    explain: bool = False
    incumbent: Ref = ""
    target: str = ""
    keep: Callable | None = api_option()

    def apply(self, module: Module) -> None:
        if self.objective != "step-time":
            raise DiagnosticError(
                [
                    Diagnostic(
                        Loc(0, 0, module.filename),
                        f"plan-search: unknown objective '{self.objective}'",
                        "objectives: step-time",
                    )
                ]
            )
        check_time_limit(module, self.name, self.time_limit)
        if not 0 <= self.headroom < 0.5:
            raise DiagnosticError(
                [
                    Diagnostic(
                        Loc(0, 0, module.filename),
                        f"plan-search: headroom is a fraction of GPU memory in [0, 0.5), got {self.headroom:g}",
                        f"the default is {DEFAULT_HEADROOM:g}",
                    )
                ]
            )
        w = _pick(module, "workload", self.workload)
        c = _pick(module, "cluster", self.cluster)
        if self.target:
            from .targets import TARGETS, unavailable_reason

            if self.target not in TARGETS:
                raise DiagnosticError(
                    [
                        Diagnostic(
                            Loc(0, 0, module.filename),
                            f"plan-search: unknown target '{self.target}'",
                            f"targets: {', '.join(TARGETS)} (or none, the free search)",
                        )
                    ]
                )
            reason = unavailable_reason(c, self.target)
            if reason:
                raise DiagnosticError(
                    [Diagnostic(c.loc, f"plan-search{{target={self.target}}}: {reason}")], module.source
                )
        problem = build_problem(
            c,
            w,
            module.models,
            max_pp=self.max_pp,
            max_zero=self.max_zero,
            offload=self.offload,
            prune=False,
            headroom=self.headroom,
            zeros=_zeros(self.target),
        )  # solve prunes what each of its models holds
        if self.target:
            from .targets import apply_target

            apply_target(problem, self.target)
        if self.keep is not None:
            for ms, sp in problem.spaces.items():
                sp.options = self.keep(ms, sp.options, problem.n)
        known = None
        if self.incumbent:
            if self.incumbent not in module.plans:
                raise no_such(module, "plan-search", "plan", self.incumbent)
            known = placed(problem, module.plans[self.incumbent])
        sol = solve(problem, self.time_limit, self.seed, known, self.deterministic)
        if sol.status == "unknown":
            raise DiagnosticError(
                [
                    Diagnostic(
                        w.loc,
                        f"plan-search found no plan within time_limit={self.time_limit:g} s "
                        "(and could not prove there is none)",
                        "raise time_limit",
                    )
                ],
                module.source,
            )
        if sol.choice is None:
            d = infeasible_diagnostic(problem, w.loc)
            if self.target:
                d = replace(d, message=d.message + f" (within {self.target}'s rules)")
            raise DiagnosticError([d], module.source)
        if sol.status != "optimal":
            module.warnings.append(
                Diagnostic(
                    w.loc,
                    f"plan-search stopped at time_limit={self.time_limit:g} s without proving "
                    f"optimality: the plan is within {sol.gap:.2%} of the best possible",
                    "raise time_limit for a proof",
                    severity="warning",
                )
            )
        name = self.into or f"{w.name}_searched"
        plan = to_plan(problem, sol, name, w.name, c.name)
        module.plans[name] = plan
        problems = estimate_plan(module, plan)
        if problems:  # the model is estimate's: a plan it accepts fits
            raise DiagnosticError(problems, module.source)
        assert sol.objective is not None and sol.bound is not None  # sol is a plan
        assert plan.step_time is not None  # estimate_plan leaves it None only with a problem
        objective = sol.objective * problem.unit_s
        plan.search = SearchRecord(
            status=sol.status,
            objective=printed_precision(objective),
            bound=printed_precision(sol.bound * problem.unit_s),
            gap=printed_precision(sol.gap, 4),
            candidates=sum(len(s.options) for s in problem.spaces.values()),
            estimate=plan.step_time,
            estimate_gap=printed_precision((objective - plan.step_time) / plan.step_time, 4),
            headroom=self.headroom,
        )
        if self.explain:
            why = explain(
                module,
                plan,
                problem,
                sol.choice,
                objective,
                lambda p, t: solve(p, t, self.seed, deterministic=self.deterministic),
                self.time_limit,
            )
            for ms, r in why.runner_ups.items():
                plan.layouts[ms].runner_up = r and replace(r, step_time=printed_precision(r.step_time))
            plan.search = replace(
                plan.search,
                bottleneck=why.bottleneck,
                unbounded=None if why.unbounded is None else printed_precision(why.unbounded),
            )
            module.explanations.extend(why.lines())


def _zeros(target: str) -> tuple[int, ...] | None:
    if not target:
        return None
    from .targets import zeros_of

    return zeros_of(target)


def _pick(module: Module, kind: str, name: str):
    table = getattr(module, kind + "s")
    if name:
        if name not in table:
            raise no_such(module, "plan-search", kind, name)
        return table[name]
    if len(table) != 1:
        raise DiagnosticError(
            [
                Diagnostic(
                    Loc(0, 0, module.filename), f"plan-search needs {kind}=@name: the module has {len(table)} {kind}s"
                )
            ]
        )
    return next(iter(table.values()))
