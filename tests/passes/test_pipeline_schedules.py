"""Pipeline schedules as layouts name them (``schedule = gpipe | one_f_one_b | interleaved |
zero_bubble | zbv``): they round-trip, the verifier holds them to the rules Megatron and
torch.distributed.pipelining run them by, at their line, and the cost model's bubble and
activations in flight are those of the schedules played operation by operation (the event
truth's ``play``, on torch's own action lists for the zero-bubble two)."""

from __future__ import annotations

import pytest

import nereus
from nereus.ir import DiagnosticError, print_ir
from nereus.passes.cost.estimate import estimate_plan
from nereus.sim.truth.pipeline import play
from nereus.sim.truth.stages import TRUTH_SCHEDULES

from ..support.probe import TP8_PP8 as GOOD
from ..support.probe import probe as _layout
from ..support.probe import probe_cost
from ..support.probe import probe_text as _text

P = 8  # gpt175b over 8 stages of 12 layers


def _stage(layout: str):
    return probe_cost(layout)[0]


def test_a_schedule_round_trips_and_an_unnamed_one_is_megatrons():
    m, lay = _layout(GOOD + ", micro_batches = 16, vpp = 2, schedule = zbv")
    assert lay.schedule == "zbv" and "schedule = zbv" in print_ir(m)
    again = nereus.parse(print_ir(m)).plans["probe"].layouts["gpt175b.train"]
    assert again.schedule == "zbv"
    _, plain = _layout(GOOD + ", micro_batches = 16, vpp = 2")
    assert plain.schedule is None and plain.pipeline_schedule == "interleaved"
    _, one = _layout(GOOD + ", micro_batches = 16")
    assert one.pipeline_schedule == "one_f_one_b"


@pytest.mark.parametrize(
    "layout, message",
    [
        (", micro_batches = 16, vpp = 2, schedule = one_f_one_b", "schedule = one_f_one_b runs one stage per rank"),
        (", micro_batches = 16, vpp = 2, schedule = gpipe", "schedule = gpipe runs one stage per rank, but vpp = 2"),
        (", micro_batches = 16, schedule = interleaved", "the interleaved schedule needs vpp > 1"),
        (", micro_batches = 16, vpp = 3, schedule = zbv", "zbv runs exactly two stages per rank (a V), but vpp = 3"),
        (", micro_batches = 17, schedule = zero_bubble", "zero_bubble runs micro_batches in 2 rounds of pp = 8"),
    ],
)
def test_a_schedule_its_framework_would_not_run_is_an_error_at_its_line(layout, message):
    text = _text(GOOD + layout)
    with pytest.raises(DiagnosticError) as e:
        nereus.verify(nereus.parse(text))
    (d,) = e.value.diagnostics
    assert message in d.message
    assert "schedule =" in text.splitlines()[d.loc.line - 1]


def test_a_schedule_on_a_stage_without_pipeline_or_backward_is_an_error():
    text = _text("tp = 8, pp = 1, dp = 8, layers = [0..95], mesh = [0..63], schedule = zero_bubble")
    with pytest.raises(DiagnosticError) as e:
        nereus.verify(nereus.parse(text))
    assert "schedule = zero_bubble orders pipeline stages, but pp = 1" in e.value.diagnostics[0].message


def played(schedule: str, v: int, m: int, recompute: bool):
    """The schedule played on even stages: per stage and micro-batch a forward of 1, an input
    gradient of 1 (2 with the recomputed forward) and a weight gradient of 1, a v-th per chunk."""
    f, w = 1.0 / v, 1.0 / v
    b = (3.0 if recompute else 2.0) / v
    zero = schedule in ("zero_bubble", "zbv")
    return play(
        [[f] * v] * P, [[b] * v] * P, m, 0.0, schedule=TRUTH_SCHEDULES[schedule], weight=[[w] * v] * P if zero else None
    )


CASES = [("one_f_one_b", 1), ("gpipe", 1), ("interleaved", 2), ("interleaved", 3), ("zero_bubble", 1)]
CASES += [("zero_bubble", 2), ("zbv", 2)]


@pytest.mark.parametrize("schedule, v", CASES)
@pytest.mark.parametrize("recompute", [False, True])
def test_the_bubble_is_the_played_schedules_on_even_stages(schedule, v, recompute):
    """Exact where a zero-bubble schedule has a micro-batch per stage or more (ZBV: ``2 p - 1``);
    with fewer (which torch runs, its weight gradients left little to fill), 1F1B's bubble bounds it."""
    for m in (16, 24, 48, 64, 4, 6, 8, 12):
        if schedule == "interleaved" and m % P:
            continue
        if schedule == "zero_bubble" and m % max(1, m // P):
            continue
        vpp = f", vpp = {v}" if v > 1 else ""
        cost = _stage(GOOD + f", micro_batches = {m}{vpp}, schedule = {schedule}, recompute = {str(recompute).lower()}")
        share = cost.parts["bubble"][1][0] / cost.parts["compute"][1][0]
        passes = 4.0 if recompute else 3.0
        truth = played(schedule, v, m, recompute)
        bubble = truth.makespan / (passes * m) - 1
        if m >= (2 * P - 1 if schedule == "zbv" else P) or schedule not in ("zero_bubble", "zbv"):
            assert share == pytest.approx(bubble, rel=1e-9), (m, share, bubble)
        else:
            assert bubble <= share + 1e-12, (m, share, bubble)


@pytest.mark.parametrize("schedule, v", [c for c in CASES if c[0] != "one_f_one_b"])
def test_activations_in_flight_are_the_played_schedules_peak(schedule, v):
    """The fullest rank's peak of micro-batches held (chunks of a v-th of its layers), played,
    against the cost model's activations: ``A = in_flight x per micro-batch + logits``, with the
    two unknowns from 1F1B (min(p, m) in flight) and GPipe (m) at the same micro-batches."""
    for m in (16, 24, 48, 64, 4, 6, 12):
        if schedule == "interleaved" and m % P:
            continue
        if schedule == "zero_bubble" and m % max(1, m // P):
            continue
        if m <= P:  # 1F1B and GPipe hold the same: no second equation
            continue
        vpp = f", vpp = {v}" if v > 1 else ""
        one = _stage(GOOD + f", micro_batches = {m}").activations[0]
        gpipe = _stage(GOOD + f", micro_batches = {m}, schedule = gpipe").activations[0]
        per = (gpipe - one) / (m - P)
        logits = one - P * per
        cost = _stage(GOOD + f", micro_batches = {m}{vpp}, schedule = {schedule}").activations[0]
        truth = played(schedule, v, m, False)
        assert (cost - logits) / per == pytest.approx(max(truth.in_flight) / v, rel=1e-9), m


def test_the_estimate_of_a_zero_bubble_plan_is_faster_than_1f1bs_and_holds_as_much():
    """ZB-H1 (zero_bubble, one stage per rank): a third of 1F1B's bubble, every rank holding
    what 1F1B's first holds (the fullest GPU's peak unchanged)."""
    plans = []
    for extra in (", schedule = zero_bubble", ""):
        m = nereus.parse(_text(GOOD + ", micro_batches = 16" + extra))
        assert estimate_plan(m, m.plans["probe"]) == []
        plans.append(m.plans["probe"].layouts["gpt175b.train"])
    zb, one = plans
    assert zb.time_breakdown.bubble == pytest.approx(one.time_breakdown.bubble / 3, rel=1e-3)
    assert zb.time < one.time
    assert zb.memory == one.memory


def test_megatron_export_says_it_cannot_run_torchs_schedules():
    """megatron-core 0.16's ``get_forward_backward_func`` has 1F1B and interleaved 1F1B only."""
    from nereus.export import export_plan

    for extra, expressible in (("", True), (", vpp = 2", True), (", vpp = 2, schedule = zbv", False)):
        m, _ = _layout(GOOD + ", micro_batches = 16" + extra)
        text = export_plan(m, "probe", "megatron")
        said = "# not expressible in Megatron-LM: gpt175b.train schedule = zbv" in text
        assert said != expressible, extra
