"""pytest-benchmark: transitions of the 70B job at 1,024 GPUs (run: make bench).

The cases of ``nereus bench transition``: planning (target with scheduling: under 5 s), the
schedule, ``remap``, and planning with no memory to spare (staging through host memory).
"""

import copy

import pytest

from nereus.bench.transition_bench import cases
from nereus.passes.schedule.schedule_transfers import schedule_transition
from nereus.passes.transition.plan_transition import plan_transition
from nereus.passes.transition.remap import remap

CASES = {label: (m, source, target) for label, m, source, target in cases(1024)}
TP, DP, TIGHT = list(CASES)


@pytest.mark.parametrize("label", [TP, DP, TIGHT])
def test_plan_transition_1024_gpus(benchmark, label):
    m, source, target = CASES[label]
    t = benchmark.pedantic(lambda: plan_transition(m, source, target, "t", lost=set()), rounds=2, iterations=1)
    assert t.bytes_moved == t.lower_bound


@pytest.mark.parametrize("label", [TP, DP])
def test_schedule_transfers_1024_gpus(benchmark, label):
    m, source, target = CASES[label]
    m = copy.deepcopy(m)
    t = m.transitions["t"] = plan_transition(m, source, target, "t", lost=set())
    benchmark.pedantic(lambda: schedule_transition(m, t, time_limit=3.0), rounds=2, iterations=1)
    assert t.makespan <= 1.10 * t.port_bound


def test_remap_dp_shrink_1024_gpus(benchmark):
    m, source, target = CASES[DP]
    rec = benchmark.pedantic(
        lambda mod: remap(mod, source, target, lost=set()),
        setup=lambda: ((copy.deepcopy(m),), {}),
        rounds=2,
        iterations=1,
    )  # remap renames plan B
    assert rec.after < rec.before
