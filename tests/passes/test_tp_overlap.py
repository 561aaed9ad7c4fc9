"""TP communication overlapped with the GEMMs (``tp_overlap``, Megatron's ``--tp-comm-overlap``):
it round-trips, needs sequence parallelism as Megatron-LM asks, hides at most all but one of
``tp`` chunks of the TP traffic and no more than the GEMMs last, agrees with the event truth's
own reading of the mechanism, and exports as the flag megatron-core's config takes."""

from __future__ import annotations

import numpy as np
import pytest

import nereus
from nereus.ir import DiagnosticError, print_ir
from nereus.sim.truth.stages import train_or_infer

from ..support.probe import GOOD
from ..support.probe import probe_cost as _cost
from ..support.probe import probe_text as _text


def _module(layout: str):
    return nereus.parse(_text(layout))


def test_tp_overlap_round_trips_and_needs_sequence_parallelism_at_its_line():
    m = _module(GOOD + ", sp = true, tp_overlap = true")
    nereus.verify(m)
    assert "tp_overlap = true" in print_ir(m)
    assert nereus.parse(print_ir(m)).plans["probe"].layouts["gpt175b.train"].tp_overlap
    text = _text(GOOD + ", tp_overlap = true")
    with pytest.raises(DiagnosticError) as e:
        nereus.verify(nereus.parse(text))
    (d,) = e.value.diagnostics
    assert "overlaps the GEMMs only under sequence parallelism" in d.message and d.hint == "set sp = true"
    assert "tp_overlap = true" in text.splitlines()[d.loc.line - 1]


@pytest.mark.parametrize("recompute", [False, True])
def test_what_hides_is_at_most_all_but_one_chunk_and_at_most_the_gemms(recompute):
    rc = ", recompute = true" if recompute else ""
    plain, x, _, _ = _cost(GOOD + ", sp = true" + rc)
    over, _, _, _ = _cost(GOOD + ", sp = true, tp_overlap = true" + rc)
    a, b = plain.breakdown(x), over.breakdown(x)
    traffic = a["tp"] - float(plain.waits["tp"][0])  # the bytes' seconds, latency aside
    hid = a["tp"] - b["tp"]
    assert 0 < hid <= traffic * 7 / 8 + 1e-12
    assert hid <= a["compute"] + a["bubble"]  # behind GEMMs, which are part of the compute
    assert {k: v for k, v in a.items() if k != "tp"} == {k: v for k, v in b.items() if k != "tp"}
    assert float(over.time(x)[0]) == pytest.approx(float(plain.time(x)[0]) - hid, rel=1e-12)
    # TP 8 on NVLink beside 12 layers' GEMMs: the GEMMs outlast the traffic, so the chunk bound binds
    assert hid == pytest.approx(traffic * 7 / 8, rel=1e-9)


def test_the_event_truth_hides_tp_traffic_as_the_cost_model_does():
    """Each reads the mechanism its own way (the truth per layer and pass, from its kernel times
    and collective algorithms); both find the step faster, by a similar share."""
    out = {}
    for extra in ("", ", tp_overlap = true"):
        cost, x, m, lay = _cost(GOOD + ", sp = true" + extra)
        w = m.workloads["w175b"]
        lengths = np.full(w.samples, w.prompt_len_mean + w.response_len_mean)
        truth, _ = train_or_infer(m.models["gpt175b"], lay, w, m.clusters["selene"], lengths, "train")
        out[extra] = (float(cost.time(x)[0]), truth)
    (model_a, truth_a), (model_b, truth_b) = out[""], out[", tp_overlap = true"]
    gain_model, gain_truth = 1 - model_b / model_a, 1 - truth_b / truth_a
    assert gain_model > 0.01 and gain_truth > 0.01
    assert gain_model == pytest.approx(gain_truth, rel=0.5), (gain_model, gain_truth)


def test_over_the_nic_the_gemms_bound_what_hides():
    """TP 16 spans two nodes of 8: its traffic crosses the NIC and outlasts the GEMMs beside it,
    so what hides is the GEMMs' time, less than 15/16 of the traffic."""
    wide = "tp = 16, pp = 4, dp = 1, layers = [0..23, 24..47, 48..71, 72..95], mesh = [0..63], micro_batches = 64"
    plain, x, _, _ = _cost(wide + ", sp = true")
    over, _, _, _ = _cost(wide + ", sp = true, tp_overlap = true")
    a, b = plain.breakdown(x), over.breakdown(x)
    traffic = a["tp"] - float(plain.waits["tp"][0])
    hid = a["tp"] - b["tp"]
    assert traffic > a["compute"]  # the NIC binds
    assert 0 < hid < traffic * 15 / 16
    assert hid < a["compute"] + a["bubble"]
