"""Lower bounds on the step time of any plan of a ``SearchProblem``, and the candidates that a
plan no slower than a given step time can use (what lets ``plan_search`` prove optimality on
large jobs in a fraction of the full model's time).

The bounds follow from the model's structure alone, so they hold for every plan, whatever its
memory: every model-stage runs in some group of its stage, and a stage takes at least as long
as each of its groups. So for each member ``i`` of stage ``X``, ``T[X] >= t(i)``; and for each
pair ``(i, j)`` of members, either they share a group (``T[X] >= t(i) + t(j)``) or they take
disjoint runs of the ``n`` positions (``G(i) + G(j) <= n`` and ``T[X] >= max(t(i), t(j))``).
``t`` is an option's fastest start class. A plan with step time at most ``cap`` uses, for each
model-stage, only options whose stage bound plus the other stages' bounds is at most ``cap``:
``restrict`` keeps exactly those.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .search_space import SearchProblem, prune_options


def option_bounds(problem: SearchProblem) -> dict[str, np.ndarray]:
    """Per model-stage, per option: a lower bound (units) on its stage's time when it takes that option."""
    n = problem.n
    fastest = {ms: np.array([min(o.times.values()) for o in sp.options], dtype=np.int64) for ms, sp in problem.spaces.items()}
    gpus = {ms: np.array([o.gpus for o in sp.options], dtype=np.int64) for ms, sp in problem.spaces.items()}
    # per model-stage: the fastest option using at most g GPUs, for every g
    within = {}
    for ms, t in fastest.items():
        best = np.full(n + 1, np.iinfo(np.int64).max, dtype=np.int64)
        np.minimum.at(best, np.minimum(gpus[ms], n), t)
        within[ms] = np.minimum.accumulate(best)
    out = {}
    for _, mss in problem.stages:
        for i in mss:
            lb = fastest[i].copy()
            for j in mss:
                if j == i or not len(fastest[j]):
                    continue
                together = fastest[i] + fastest[j].min()
                apart = np.maximum(fastest[i], within[j][np.clip(n - gpus[i], 0, n)])
                lb = np.maximum(lb, np.minimum(together, apart))
            out[i] = lb
    return out


def stage_bounds(problem: SearchProblem, bounds: dict[str, np.ndarray]) -> dict[str, int]:
    """A lower bound (units) on each stage's time: the least of any member's option bounds."""
    return {stage: max((int(bounds[ms].min()) for ms in mss if len(bounds[ms])), default=0) for stage, mss in problem.stages}


def restrict(problem: SearchProblem, bounds: dict[str, np.ndarray], cap: int) -> tuple[SearchProblem, dict[str, np.ndarray], bool]:
    """The problem with only the options a plan of step time at most ``cap`` can use, less the
    dominated ones (``prune_rows``); per model-stage the original index of each kept option; and
    whether the cap excluded nothing (the model is then the whole problem's).

    Pruning after the cap is sound: an option that dominates another is no slower at any start
    and takes no more GPUs, so its bound is no larger, and it is kept whenever the other is."""
    lower = stage_bounds(problem, bounds)
    total = sum(lower.values())
    keep, complete = {}, True
    for stage, mss in problem.stages:
        for ms in mss:
            under = np.flatnonzero(bounds[ms] + (total - lower[stage]) <= cap)
            complete &= len(under) == len(bounds[ms])
            options = problem.spaces[ms].options
            keep[ms] = under[prune_options([options[i] for i in under])]
    spaces = {ms: replace(sp, options=[sp.options[i] for i in keep[ms]]) for ms, sp in problem.spaces.items()}
    return replace(problem, spaces=spaces), keep, complete
