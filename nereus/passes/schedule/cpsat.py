"""The CP-SAT model of a bucket schedule: no-overlap per port, precedences, the makespan minimised from
the better list schedule, under a time limit; above ``SEARCH_MAX`` buckets the list schedules alone
(above ``LARGE``: ``dense``, or ``serial`` where dense would cost too much, then ``insertion``, and
``backwards`` where they stay above the bound by more than 5%, the best of them).

Part of ``schedule-transfers`` (``schedule_transfers.py``)."""

from __future__ import annotations

from collections import defaultdict
from itertools import chain

import numpy as np
from ortools.sat.python import cp_model

from ..infra.solver_budget import Budget
from .buckets import Bucket, Precedences, bucket_ports, precedence_pairs
from .list_schedules import (
    Schedule,
    backwards,
    bottom_levels,
    bucket_durations,
    dense,
    greedy,
    insertion,
    port_bound,
    port_graph,
    serial,
)

SEARCH_MAX = 2000
"""Buckets: above this, no CP-SAT search after the list schedules. On every transition of 2,169
to 3,984 buckets where the search ran (the simulator's three traces and the transition bench:
12 searches given 0.5-3 s each) it found no shorter schedule, most often no schedule at all in
its time; on the test suite's (up to 279 buckets) it shortened 26 of 329 (docs/PERFORMANCE.md)."""
INSERTION_MAX = 100_000  # buckets: up to this, a large schedule also tries ``insertion`` (it is not O(n log n))
LARGE = 4000  # buckets: above this, list schedules of one pass (``serial``, ``insertion``) instead of ``greedy``
BACKWARDS_ABOVE = 1.05
"""Above ``LARGE``, with precedences: where the best list schedule is above this times the port
bound, ``backwards`` (the dense schedule of the reversed problem, about as costly as ``dense``)
is tried too; a schedule within 5% of the bound is not worth another pass."""
DENSE_MAX = 30_000_000
"""Above ``LARGE``, ``dense`` (and ``backwards``) runs where the sum over ports of their buckets squared (what its
scans of ready buckets can read, at most) is at most this: 5.6 million on the transition bench's
case 3 (0.8-1.1 s), 27.8 million on its case 5 (1.0 s, most buckets waiting on others)."""


def _dense_work(graph) -> int:
    """The sum over ports of their buckets squared (``DENSE_MAX``), from ``port_graph``'s ports."""
    per_port = np.bincount(np.fromiter(chain.from_iterable(graph[2]), dtype=np.int64))
    return int((per_port**2).sum())


def solve_schedule(
    buckets: list[Bucket], prec: Precedences, time_limit: float, seed: int = 0, deterministic: bool = False
) -> Schedule:
    if not buckets:
        return Schedule([], 0, 0, "optimal", 0)
    graph = port_graph(buckets, prec)  # read by the bound and the one-pass schedule; greedy's changes its busy times
    bound = port_bound(buckets, prec, graph)
    if len(buckets) > LARGE:  # no search on this scale: the better of two list schedules, and the bound
        pairs = precedence_pairs(prec)
        tails = bottom_levels(
            bucket_durations(buckets), pairs[:, 0], pairs[:, 1]
        ).tolist()  # both list schedules order by them
        dense_ok = _dense_work(graph) <= DENSE_MAX
        # dense where it can run (2.08x -> 1.10x the bound on the bench's widest move; serial was
        # 2-4x longer than it on every move above LARGE of the bench and of availability's Nereus
        # run, and never shorter than the best of the others); serial, one pass, where it cannot
        warm = dense(buckets, prec, graph, tails) if dense_ok else serial(buckets, prec, graph, tails)
        horizon = max(s + b.duration for s, b in zip(warm, buckets))
        # with insertion: 8.83 s -> 0.757 s on a 94,535-bucket move whose bound is 0.755 s (2.6 s
        # more to schedule); it ran over 10 minutes on 200,504 buckets with 4.59 million precedences
        if horizon > bound and len(buckets) <= INSERTION_MAX and len(prec) <= 10 * INSERTION_MAX:
            other = insertion(buckets, prec, len(prec) > 0, graph, tails)
            span = max(s + b.duration for s, b in zip(other, buckets))
            if span < horizon:
                warm, horizon = other, span
        if horizon > BACKWARDS_ABOVE * bound and len(pairs) and dense_ok:
            other = backwards(buckets, prec, graph)  # 1.30x -> 1.07x the bound on the bench's case 5
            span = max(s + b.duration for s, b in zip(other, buckets))
            if span < horizon:
                warm, horizon = other, span
        return Schedule(warm, horizon, bound, "optimal" if horizon == bound else "feasible", bound, searched=False)
    warm = greedy(buckets, prec)
    horizon = max(s + b.duration for s, b in zip(warm, buckets))
    for chains in (False, True):  # then list schedules with insertion; the best of them
        if horizon == bound or (chains and not len(prec)):
            break
        other = insertion(buckets, prec, chains)
        span = max(s + b.duration for s, b in zip(other, buckets))
        if span < horizon:
            warm, horizon = other, span
    if horizon == bound:  # a list schedule meets the lower bound: optimal, no search needed
        return Schedule(warm, horizon, bound, "optimal", bound)
    if len(buckets) > SEARCH_MAX:
        return Schedule(warm, horizon, bound, "feasible", bound, searched=False)
    m = cp_model.CpModel()
    starts, ends, intervals = [], [], []
    for i, b in enumerate(buckets):
        s = m.new_int_var(0, horizon - b.duration, f"s{i}")
        e = m.new_int_var(b.duration, horizon, f"e{i}")
        intervals.append(m.new_interval_var(s, b.duration, e, f"i{i}"))
        starts.append(s)
        ends.append(e)
        m.add_hint(s, warm[i])
    by_port: dict[int, list] = defaultdict(list)
    for i, b in enumerate(buckets):
        for p in bucket_ports(b):
            by_port[p].append(intervals[i])
    for ivs in by_port.values():
        if len(ivs) > 1:
            m.add_no_overlap(ivs)
    for a, b in precedence_pairs(prec).tolist():
        m.add(starts[b] >= ends[a])
    makespan = m.new_int_var(bound, horizon, "makespan")
    m.add_max_equality(makespan, ends)
    m.minimize(makespan)
    solver = cp_model.CpSolver()
    Budget(float(time_limit), deterministic).limit(solver)
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = seed
    status = solver.solve(m)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return Schedule(warm, horizon, bound, "feasible", bound)
    found = [solver.value(s) for s in starts]
    span = int(solver.objective_value)
    if span > horizon:  # never worse than the warm start
        found, span = warm, horizon
    return Schedule(
        found, span, bound, "optimal" if status == cp_model.OPTIMAL else "feasible", int(solver.best_objective_bound)
    )
