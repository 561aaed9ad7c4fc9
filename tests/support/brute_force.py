"""Brute force over a plan-search problem: the optimum by trying every option, start and
grouping, for tests on small instances (independent of the CP-SAT model)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import numpy as np

from nereus.passes.search.space import SearchProblem


def brute_force(
    problem: SearchProblem,
    limit: int = 2_000_000,
    allow: Callable | None = None,
    admit: Callable | None = None,
) -> tuple[int | None, dict | None, dict | None, dict | None]:
    """The optimum by trying every option, start and grouping (small instances), through
    ``evaluate``. Independent of the CP-SAT model. Returns (objective, choice, start, partition).
    ``allow(model_stage, option)``: only options it accepts; ``admit(choice, start, partition)``:
    only combinations it accepts (a framework's rules, written by the caller)."""
    names = list(problem.spaces)
    per_ms = [
        [
            (c, s)
            for c, o in enumerate(problem.spaces[ms].options)
            if allow is None or allow(ms, o)
            for k in o.times
            for s in problem.positions.starts(k, o.gpus)
        ]
        for ms in names
    ]
    if not all(per_ms):
        return None, None, None, None
    parts = list(itertools.product(*(range(len(problem.partitions[s])) for s, _ in problem.stages)))
    if math.prod(len(p) for p in per_ms) * len(parts) > limit:
        raise ValueError("too many combinations for brute force")
    best = (None, None, None, None)
    for k in parts:
        partition = {s: ki for (s, _), ki in zip(problem.stages, k)}
        for combo in itertools.product(*per_ms):
            choice = {ms: c for ms, (c, _) in zip(names, combo)}
            start = {ms: s for ms, (_, s) in zip(names, combo)}
            if admit is not None and not admit(choice, start, partition):
                continue
            v = problem.evaluate(choice, start, partition)
            if v is not None and (best[0] is None or v < best[0]):
                best = (v, choice, start, partition)
    return best


def branch_and_bound(problem: SearchProblem, cap: int | None = None) -> tuple:
    """The optimum of ``problem`` (objective, choice, start, partition) among plans of step time at
    most ``cap`` units, by depth-first search over options, starts and groupings, checked at every
    leaf by ``evaluate``. Pruned only by what adding a model-stage cannot undo: runs of different
    groups that overlap, members of one group at different starts, memory over the GPU's (the state
    on a GPU only grows as model-stages are placed) and a partial step time over the best so far."""
    names = [ms for _, mss in problem.stages for ms in mss]
    stage_of = {ms: st for st, mss in problem.stages for ms in mss}
    pos = problem.positions
    per_ms = {
        ms: sorted(
            (
                (min(o.times.values()) if o.times else 0, c, s, o.times.get(pos.class_of(s, o.gpus)))
                for c, o in enumerate(problem.spaces[ms].options)
                for k in o.times
                for s in pos.starts(k, o.gpus)
            ),
            key=lambda x: x[0],
        )
        for ms in names
    }
    per_ms = {ms: [(c, s, t) for _, c, s, t in v if t is not None] for ms, v in per_ms.items()}
    if not all(per_ms.values()):
        return None, None, None, None
    fastest = {ms: min(t for _, _, t in v) for ms, v in per_ms.items()}
    lb = {st: max(fastest[ms] for ms in mss) for st, mss in problem.stages}
    best = [cap + 1 if cap is not None else None, None, None, None]
    for k in itertools.product(*(range(len(problem.partitions[st])) for st, _ in problem.stages)):
        partition = {st: ki for (st, _), ki in zip(problem.stages, k)}
        group_of = {}
        for st, _ in problem.stages:
            for gi, g in enumerate(problem.partitions[st][partition[st]]):
                for ms in g:
                    group_of[ms] = (st, gi)
        load = np.zeros(pos.n, dtype=np.int64)
        choice, start, span, gtime = {}, {}, {}, {}

        def bound():
            out = 0
            for st, _ in problem.stages:
                out += max([lb[st]] + [v for (s2, _), v in gtime.items() if s2 == st])
            return out

        def ok(ms, o, s):
            lo, hi = s, s + o.gpus
            for other, (a, b) in span.items():
                if group_of[other] == group_of[ms]:
                    if start[other] != s:
                        return False
                elif stage_of[other] == stage_of[ms] and lo < b and a < hi:
                    return False
            load[lo:hi] += o.resident
            good = True
            for x, (a, b) in list(span.items()) + [(ms, (lo, hi))]:
                ox = problem.spaces[x].options[choice[x]] if x != ms else o
                here = int(load[a:b].max())
                if ox.extra + here > problem.memory or here - ox.resident > ox.rho:
                    good = False
                    break
            if not good:
                load[lo:hi] -= o.resident
            return good

        def dfs(i):
            if i == len(names):
                v = problem.evaluate(choice, start, partition)
                if v is not None and (best[0] is None or v < best[0]):
                    best[:] = [v, dict(choice), dict(start), dict(partition)]
                return
            ms = names[i]
            for c, s, t in per_ms[ms]:
                o = problem.spaces[ms].options[c]
                g = group_of[ms]
                gtime[g] = gtime.get(g, 0) + t
                if best[0] is None or bound() < best[0]:
                    if ok(ms, o, s):
                        choice[ms], start[ms], span[ms] = c, s, (s, s + o.gpus)
                        dfs(i + 1)
                        del choice[ms], start[ms], span[ms]
                        load[s : s + o.gpus] -= o.resident
                gtime[g] -= t
                if not gtime[g]:
                    del gtime[g]

        dfs(0)
    if best[1] is None:
        return None, None, None, None
    return tuple(best)
