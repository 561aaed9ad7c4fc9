"""Lower bounds on the step time of any plan of a ``SearchProblem``, and the candidates that a
plan no slower than a given step time can use (what lets ``plan_search`` prove optimality on
large jobs in a fraction of the full model's time).

The bounds follow from the model's structure alone, so they hold for every plan, whatever its
memory: every model-stage runs in some group of its stage, and a stage takes at least as long
as each of its groups. So for each member ``i`` of stage ``X``, ``T[X] >= t(i)``; and for each
pair ``(i, j)`` of members, either they share a group (``T[X] >= t(i) + t(j)``) or they take
disjoint runs of the ``n`` positions (``G(i) + G(j) <= n`` and ``T[X] >= max(t(i), t(j))``).
And over all members at once, GPU-time: groups take disjoint runs, a group's run is as wide as
its widest member and lasts the sum of its members' times, so ``sum_i G(i) t(i) <= n T[X]``
(``T[X] >= (G(i) t(i) + the least G t of every other member) / n``). It is what bounds a stage
of four models side by side, each on a quarter of the GPUs, where the pairs alone allow each
three quarters. ``t`` is an option's fastest start class. A plan with step time at most ``cap`` uses, for each
model-stage, only options whose stage bound plus the other stages' bounds is at most ``cap``:
``restrict`` keeps exactly those.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .space import SearchProblem, columns, prune_options


def option_bounds(problem: SearchProblem) -> dict[str, np.ndarray]:
    """Per model-stage, per option: a lower bound (units) on its stage's time when it takes that option."""
    n = problem.n
    cols = {ms: columns(sp.options) for ms, sp in problem.spaces.items()}
    fastest = {ms: c["fastest"] for ms, c in cols.items()}
    gpus = {ms: c["gpus"] for ms, c in cols.items()}
    # per model-stage: the fastest option using at most g GPUs, for every g
    within = {}
    for ms, t in fastest.items():
        best = np.full(n + 1, np.iinfo(np.int64).max, dtype=np.int64)
        np.minimum.at(best, np.minimum(gpus[ms], n), t)
        within[ms] = np.minimum.accumulate(best)
    # GPU-time: a model-stage on g GPUs for t units covers g x t of the stage's n x T (area bound)
    area = {ms: gpus[ms] * fastest[ms] for ms in fastest}
    least = {ms: int(a.min()) if len(a) else 0 for ms, a in area.items()}
    out = {}
    for _, mss in problem.stages:
        others = sum(least[j] for j in mss)
        for i in mss:
            lb = fastest[i].copy()
            for j in mss:
                if j == i or not len(fastest[j]):
                    continue
                together = fastest[i] + fastest[j].min()
                apart = np.maximum(fastest[i], within[j][np.clip(n - gpus[i], 0, n)])
                lb = np.maximum(lb, np.minimum(together, apart))
            if n:
                lb = np.maximum(lb, -(-(area[i] + others - least[i]) // n))  # ceil: T is whole units
            out[i] = lb
    return out


def stage_bounds(problem: SearchProblem, bounds: dict[str, np.ndarray]) -> dict[str, int]:
    """A lower bound (units) on each stage's time: the least of any member's option bounds."""
    return {
        stage: max((int(bounds[ms].min()) for ms in mss if len(bounds[ms])), default=0) for stage, mss in problem.stages
    }


def restrict(
    problem: SearchProblem, bounds: dict[str, np.ndarray], cap: int
) -> tuple[SearchProblem, dict[str, np.ndarray], bool]:
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
            if problem.constraints is not None:  # dominance only among options the framework's ties treat alike
                keep[ms] = problem.constraints.prune(ms, options, under)
            else:
                keep[ms] = under[prune_options(options, under)]
    spaces = {ms: replace(sp, options=[sp.options[i] for i in keep[ms]]) for ms, sp in problem.spaces.items()}
    return replace(problem, spaces=spaces), keep, complete
