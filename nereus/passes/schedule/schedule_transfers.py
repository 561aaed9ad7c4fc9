"""``schedule-transfers{time_limit=S}``: start times for a transition's transfers, by CP-SAT.

Transfers between the same sender and the same receivers over the same link are one bucket
(a contiguous flat buffer, as verl and NeMo-RL pack weights): bucket count grows with GPU pairs,
not with tensors. Each bucket is an interval of ``latency + bytes / (bandwidth x efficiency)``
on its link (NVLink inside a node, the NIC across nodes; efficiencies from the cluster's
calibrated cost model). Every GPU has a send port and a receive port per link kind, each a
no-overlap resource; a broadcast holds its sender's port and every receiver's. Dependencies
between operations become precedences between their buckets. The solver minimises the
makespan, starting from the better of two list schedules (``greedy``: the bucket whose ports
have the most work left, at the earliest time its ports are free; ``insertion``: buckets by
their busiest port, each in the earliest gap that all its ports share), and past the time limit
returns the best schedule with its gap. When a list schedule meets the port bound, no search
is needed; above ``SEARCH_MAX`` buckets none is run (it found nothing better there), and above
``LARGE`` the list schedules are of one pass.

The engines are beside the pass: ``buckets.py`` (buckets, ports, precedences),
``list_schedules.py`` (greedy, insertion, serial, the port bound) and ``cpsat.py`` (the model and
the size limits).

The port lower bound is the busiest port's total busy time: no schedule is shorter. Local
copies run on HBM after their dependencies and frees after the operations that read what they
free; both are timed but hold no link port.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import repeat

import numpy as np

from ...ir import Diagnostic, DiagnosticError, Loc, Module, Transition
from ...ir.gc_pause import gc_paused
from ...ir.printer import printed_precision
from ..cost.cost_model import CostModel
from ..infra.pass_manager import ModulePass, Ref, check_time_limit, register
from .buckets import TICK, Bucket, bucket_precedences, buckets_of
from .cpsat import SEARCH_MAX, solve_schedule
from .list_schedules import Schedule, bucket_durations


def schedule_transition(
    m: Module, t: Transition, time_limit: float = 5.0, seed: int = 0, deterministic: bool = False
) -> Schedule:
    """Set start and duration of every operation; makespan, port bound and status on the transition."""
    with gc_paused():
        return _schedule_transition(m, t, time_limit, seed, deterministic)


def _schedule_transition(m: Module, t: Transition, time_limit: float, seed: int, deterministic: bool) -> Schedule:
    cluster = m.clusters[m.plans[t.target].cluster]
    model = CostModel(cluster)
    buckets, bucket_of = buckets_of(m, t, model)
    prec = bucket_precedences(t, buckets, bucket_of)
    sched = solve_schedule(buckets, prec, time_limit, seed, deterministic)
    end = _times_in_buckets(buckets, sched.starts)
    hbm = cluster.hbm_bandwidth * model.efficiency.hbm
    printed: dict[float, float] = {}  # ``_printed`` by value: a GPU's frees share the end of their last bucket
    zero = repeat(0.0)
    for op in t.ops:  # copies and frees: after their dependencies, on no link port
        if op.id in end:
            continue
        ready = max(map(end.get, op.deps, zero), default=0.0)
        start = printed.get(ready)
        if start is None:
            start = printed[ready] = _printed(ready)
        op.start = start
        op.duration = _printed(2 * op.bytes / hbm) if op.spec.local else 0.0
        end[op.id] = ready + (op.duration or 0.0)
    t.makespan = _printed(max(end.values(), default=0.0))
    t.port_bound = _printed(sched.port_bound * TICK)
    t.schedule_status = sched.status
    return sched


def _times_in_buckets(buckets: list[Bucket], starts: list[int]) -> dict[str, float]:
    """Start and duration of every operation in a bucket (a bucket's operations back to back, in
    order, from its start; each its share of the bucket's time by bytes), set on the operations
    at the printed precision; returns each one's end, unrounded, by id.

    With numpy over all operations at once, the same arithmetic as one operation after another:
    a bucket's running time is summed in order, position by position across buckets (a bucket
    holds at most a few hundred operations), and each distinct time is rounded once."""
    ops = [op for b in buckets for op in b.ops]
    if not ops:
        return {}
    sizes = np.fromiter((len(b.ops) for b in buckets), dtype=np.int64, count=len(buckets))
    nbytes = np.fromiter((b.bytes for b in buckets), dtype=np.int64, count=len(buckets))
    per_byte = bucket_durations(buckets) * TICK / np.maximum(nbytes, 1)
    offsets = np.cumsum(sizes) - sizes
    d = np.fromiter((op.bytes for op in ops), dtype=np.int64, count=len(ops)) * np.repeat(per_byte, sizes)
    t = np.empty(len(ops))
    t[offsets] = np.asarray(starts, dtype=np.int64) * TICK
    place = np.arange(len(ops)) - np.repeat(offsets, sizes)  # each operation's place in its bucket
    order = np.argsort(place, kind="stable")
    bounds = np.cumsum(np.bincount(place)).tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):  # the second operations of every bucket, then the third, ...
        at = order[a:b]
        t[at] = t[at - 1] + d[at - 1]
    for op, start, duration in zip(ops, _rounded(t), _rounded(d)):
        op.start, op.duration = start, duration
    return dict(zip([op.id for op in ops], (t + d).tolist()))


def _rounded(x: np.ndarray) -> list[float]:
    """``_printed`` of every entry, each distinct value rounded once."""
    values, inverse = np.unique(x, return_inverse=True)
    return np.array([_printed(v) for v in values.tolist()])[inverse].tolist()


@register
@dataclass(frozen=True)
class ScheduleTransfers(ModulePass):
    """Options: ``time_limit`` (s), ``seed``, ``deterministic`` (true: ``time_limit`` counts CP-SAT's
    deterministic time, see ``infra.solver_budget``), ``transition`` (``@name``; default: every
    transition)."""

    name = "schedule-transfers"
    time_limit: float = 5.0
    seed: int = 0
    deterministic: bool = False
    transition: Ref = ""

    def apply(self, module: Module) -> None:
        check_time_limit(module, self.name, self.time_limit)
        names = [self.transition] if self.transition else list(module.transitions)
        if not names:
            raise DiagnosticError(
                [
                    Diagnostic(
                        Loc(0, 0, module.filename),
                        "schedule-transfers: the module has no transition",
                        "run plan-transition{to=@plan_b} first",
                    )
                ]
            )
        for name in names:
            t = module.transitions[name]
            sched = schedule_transition(module, t, self.time_limit, self.seed, self.deterministic)
            if sched.status != "optimal":
                gap = (sched.makespan - sched.bound) / sched.makespan if sched.makespan else 0.0
                why = (
                    f"stopped at time_limit={self.time_limit:g} s"
                    if sched.searched
                    else f"ran no search (a list schedule, above {SEARCH_MAX:,} buckets)"
                )
                module.warnings.append(
                    Diagnostic(
                        t.loc,
                        f"schedule-transfers {why}: makespan within {gap:.2%} of the best possible",
                        severity="warning",
                    )
                )


def _printed(x: float) -> float:
    """Schedule times at 6 significant digits (microseconds of a seconds-long transition)."""
    return printed_precision(x, 6)
