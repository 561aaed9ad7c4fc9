"""Brute force over a plan-search problem: the optimum by trying every option, start and
grouping, for tests on small instances (independent of the CP-SAT model)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

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
