"""Pipeline sends and data-parallel communication beside compute, as layout attributes.

``pp_overlap``: a rank posts its pipeline sends and computes on (Megatron's ``overlap_p2p_comm``,
on for the interleaved schedule by default, and torch's schedules, which always post); otherwise
it waits for each send (Megatron's 1F1B, whose steady state leaves a posted send no slack). ``dp_overlap``:
gradient buckets reduce during the backward and ZeRO-3's gathers run ahead of their layers (on by
default, as FSDP2 and the exported Megatron flags run); otherwise both wait. Each round-trips, is
refused where it means nothing at the line that sets it, changes the cost model's charge by what
the mechanism hides and nothing else, and moves the event truth the same way."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import nereus
from nereus.ir import DiagnosticError, print_ir
from nereus.passes.cost.cost_model import Candidates, CostModel
from nereus.sim.truth.pipeline import play

from ..support import ROOT
from ..support.probe import BASE, GOOD, STAGES
from ..support.probe import probe_cost as _cost
from ..support.probe import probe_text as _text
from ..support.probe import probe_truth as _truth

# and on 4 copies of it (DP over the NIC), for the data-parallel traffic
WIDE = f"tp = 8, pp = 8, dp = 4, layers = [{STAGES}], mesh = [0..255], micro_batches = 16"


def test_both_round_trip_and_the_schedule_decides_pipeline_overlap_by_default():
    m = nereus.parse(_text(GOOD + ", vpp = 2, pp_overlap = false, dp_overlap = false"))
    nereus.verify(m)
    text = print_ir(m)
    assert "pp_overlap = false" in text and "dp_overlap = false" in text
    lay = nereus.parse(text).plans["probe"].layouts["gpt175b.train"]
    assert (lay.pp_overlap, lay.pp_overlapped, lay.dp_overlap) == (False, False, False)
    plain = nereus.parse(_text(GOOD)).plans["probe"].layouts["gpt175b.train"]
    assert (plain.pp_overlap, plain.pp_overlapped, plain.dp_overlap) == (None, False, True)
    assert "overlap" not in print_ir(nereus.parse(_text(GOOD))).split("layout gpt175b.train")[1]
    interleaved = nereus.parse(_text(GOOD + ", vpp = 2")).plans["probe"].layouts["gpt175b.train"]
    assert interleaved.pp_overlapped
    for schedule, posted in (("one_f_one_b", False), ("gpipe", True), ("zero_bubble", True)):
        lay = nereus.parse(_text(GOOD + f", schedule = {schedule}")).plans["probe"].layouts["gpt175b.train"]
        assert lay.pp_overlapped == posted, schedule  # torch's schedules post their sends


@pytest.mark.parametrize(
    "extra,words",
    [
        (", pp_overlap = true", "1F1B's steady state leaves a posted send no slack"),
        (", schedule = zero_bubble, pp_overlap = false", "posts its pipeline sends"),
        (", vpp = 2, schedule = zbv, pp_overlap = false", "posts its pipeline sends"),
    ],
)
def test_a_setting_the_schedule_cannot_run_is_refused_at_its_line(extra, words):
    text = _text(GOOD + extra)
    with pytest.raises(DiagnosticError) as e:
        nereus.verify(nereus.parse(text))
    (d,) = e.value.diagnostics
    assert words in d.message and "pp_overlap" in text.splitlines()[d.loc.line - 1]


def test_each_is_refused_where_it_means_nothing_at_its_line():
    """A vLLM engine's pipeline is its own; an inference stage reduces no gradients."""
    text = (ROOT / "examples" / "ppo_8b_16gpu.nir").read_text()
    m = nereus.parse(text)
    plan = next(iter(m.plans.values()))
    gen = next(ms for ms in plan.layouts if ms.endswith(".generate"))
    infer = next(ms for ms in plan.layouts if ms.endswith(".infer"))
    for ms, attr, value, words in (
        (gen, "pp_overlap", "false", "a generation engine's pipeline is its own"),
        (infer, "dp_overlap", "false", "dp_overlap is a training setting"),
    ):
        lines = text.splitlines()
        at = next(i for i, line in enumerate(lines) if f"layout {ms} {{" in line)
        lines.insert(at + 1, f"    {attr} = {value}")
        with pytest.raises(DiagnosticError) as e:
            nereus.verify(nereus.parse("\n".join(lines) + "\n"))
        (d,) = [d for d in e.value.diagnostics if attr in d.message]
        assert words in d.message
        assert d.loc.line == at + 2  # the inserted line, 1-based


@pytest.mark.parametrize("vpp,micro_batches", [(2, 64), (4, 64), (2, 16)])
def test_overlapped_sends_hide_the_steady_state_and_leave_the_fill_and_drain(vpp, micro_batches):
    """Of the ``2 (n v + f (p v - 1))`` sends of a step's ``n`` micro-batches in ``f`` flushes,
    ``2 n v`` hide behind the compute (which outlasts them here) and each flush's fill and drain,
    ``2 (p v - 1)``, stay, with their latency; every other entry of the breakdown is as before."""
    layout = GOOD.replace("micro_batches = 64", f"micro_batches = {micro_batches}") + f", vpp = {vpp}"
    waited, x, m, _ = _cost(layout + ", pp_overlap = false")
    posted, _, _, _ = _cost(layout)
    a, b = waited.breakdown(x), posted.breakdown(x)
    assert {k: w for k, w in a.items() if k != "pp"} == {k: w for k, w in b.items() if k != "pp"}
    w = m.workloads["w175b"]
    n, p = w.samples / w.micro_batch, 8  # micro-batches of the step (dp = 1), pipeline stages
    traffic_a = a["pp"] - float(waited.waits["pp"][0])
    fill = n / micro_batches * (p * vpp - 1)
    per_send = traffic_a / (2 * (n * vpp + fill))
    assert b["pp"] - float(posted.waits["pp"][0]) == pytest.approx(per_send * 2 * fill, rel=1e-9)
    assert float(posted.waits["pp"][0]) == pytest.approx(float(waited.waits["pp"][0]) * fill / (n * vpp + fill))
    assert a["pp"] > b["pp"] > 0
    assert float(posted.time(x)[0]) == pytest.approx(float(waited.time(x)[0]) - (a["pp"] - b["pp"]), rel=1e-12)


def test_what_sends_hide_is_at_most_the_compute_beside_them():
    """Sends on a link so slow that they outlast the compute: what hides is the compute's time."""
    link = "inter_node = link(bandwidth = 25GB/s, latency = 5us)"
    assert link in BASE
    src = _text(GOOD + ", vpp = 2").replace(link, "inter_node = link(bandwidth = 20MB/s, latency = 5us)")
    m = nereus.parse(src)
    nereus.verify(m)
    lay, cluster = m.plans["probe"].layouts["gpt175b.train"], m.clusters["selene"]
    model, md, w = CostModel(cluster), m.models["gpt175b"], m.workloads["w175b"]
    cost = model.stage(md, w, "train", Candidates.of_layout(cluster, lay))
    off = model.stage(md, w, "train", Candidates.of_layout(cluster, replace(lay, pp_overlap=False)))
    x = model.coeffs
    a, b = off.breakdown(x), cost.breakdown(x)
    assert a["pp"] > a["compute"]  # the NIC binds
    hid = (a["pp"] - float(off.waits["pp"][0])) - (b["pp"] - float(cost.waits["pp"][0]))  # latency aside
    assert hid == pytest.approx(a["compute"], rel=1e-9)


def test_a_rank_that_waits_for_its_sends_lengthens_the_played_pipeline():
    """The event truth's pipeline: a blocking send holds its rank; without sends nothing changes."""
    f, b = [[1.0], [1.0], [1.0], [1.0]], [[2.0], [2.0], [2.0], [2.0]]
    posted = play(f, b, 8, send=0.3)
    waited = play(f, b, 8, send=0.3, blocking=True)
    assert waited.makespan > posted.makespan
    assert play(f, b, 8, send=0.0, blocking=True).makespan == play(f, b, 8, send=0.0).makespan
    # 1F1B on 4 ranks: the last rank's steady state runs a forward, then a backward, and both its
    # neighbours wait on it; a waiting send adds at most one send per operation a rank runs
    assert waited.makespan <= posted.makespan + 0.3 * 2 * 8
    assert waited.busy == posted.busy  # computation is the same; only waiting grows


@pytest.mark.parametrize("p,v", [(4, 2), (4, 4), (8, 2)])
def test_the_sends_left_exposed_are_those_the_played_interleaved_pipeline_waits_for(p, v):
    """The event truth plays Megatron's interleaved schedule operation by operation: with every
    operation 1 s and every send ``d`` s, posted, the step lasts ``2 (p v - 1) d`` longer than
    with free sends, the count the cost model leaves exposed per flush (its sends hide behind
    the compute as long as the compute outlasts them)."""
    m, d = 4 * p, 1e-3
    ones = [[1.0] * v for _ in range(p)]
    free = play(ones, ones, m, send=0.0).makespan
    posted = play(ones, ones, m, send=d).makespan
    assert (posted - free) / d == pytest.approx(2 * (p * v - 1), rel=1e-6)


def test_the_event_truth_and_the_cost_model_both_find_overlapped_sends_faster():
    out = {}
    for flag in ("false", "true"):
        cost, x, m, lay = _cost(GOOD + f", vpp = 2, pp_overlap = {flag}")
        out[flag] = (float(cost.time(x)[0]), _truth(m, lay))
    (model_a, truth_a), (model_b, truth_b) = out["false"], out["true"]
    assert model_b < model_a and truth_b < truth_a


@pytest.mark.parametrize("zero", [1, 3])
def test_data_parallel_traffic_waits_whole_without_dp_overlap(zero):
    """Without ``dp_overlap`` nothing of the DP traffic hides: its whole seconds are charged; with
    it, some hide. The rest of the breakdown is the same, and the event truth is slower too."""
    over, x, m, lay_over = _cost(WIDE + f", zero = {zero}")
    waited, _, _, lay_waited = _cost(WIDE + f", zero = {zero}, dp_overlap = false")
    a, b = over.breakdown(x), waited.breakdown(x)
    assert {k: w for k, w in a.items() if k != "dp"} == {k: w for k, w in b.items() if k != "dp"}
    whole = float(waited.parts["dp"][1][0] * x[int(waited.parts["dp"][0])]) + float(waited.waits["dp"][0])
    assert b["dp"] == pytest.approx(whole, rel=1e-12)
    assert a["dp"] < b["dp"]
    assert _truth(m, lay_over) < _truth(m, lay_waited)


def test_the_distributed_optimizer_scatters_gradients_and_gathers_weights_in_their_own_dtypes():
    """ZeRO-0 all-reduces the gradients (2 (r - 1) / r of them, in their dtype); ZeRO-1 (Megatron's
    distributed optimizer) reduce-scatters them and all-gathers the updated bf16 weights: with fp32
    gradients 6 bytes a parameter cross the ring instead of 8, and with bf16 ones the same 4. Its
    gathers hide behind the next step's first forward as well as the last backward, so more of
    its traffic hides; waited on, each charges its bytes whole. The event truth agrees on the order."""
    from nereus.passes.cost.cost_model import C_NIC

    feat = {}
    for zero in (0, 1):
        for grad in ("fp32", "bf16"):
            cost, x, m, lay = _cost(WIDE + f", zero = {zero}, grad_dtype = {grad}, dp_overlap = false")
            col, f = cost.parts["dp"]
            assert int(col) == C_NIC
            feat[zero, grad] = float(f[0])
    assert feat[1, "fp32"] / feat[0, "fp32"] == pytest.approx((4 + 2) / (2 * 4), rel=1e-12)
    assert feat[1, "bf16"] == pytest.approx(feat[0, "bf16"], rel=1e-12)
    assert feat[0, "fp32"] == pytest.approx(2 * feat[0, "bf16"], rel=1e-12)
    # the window: one micro-batch's backward and, under ZeRO-1, its forward, per optimizer step
    cost0, x, _, _ = _cost(WIDE + ", zero = 0, grad_dtype = fp32")
    cost1, _, _, _ = _cost(WIDE + ", zero = 1, grad_dtype = fp32")
    window0, window1 = float(cost0.overlap[1][0] @ x), float(cost1.overlap[1][0] @ x)
    assert window1 / window0 == pytest.approx(3 / 2, rel=1e-12)  # backward + forward over backward
    assert cost1.breakdown(x)["dp"] < cost0.breakdown(x)["dp"]
    truths = {z: _truth(*_cost(WIDE + f", zero = {z}, grad_dtype = fp32")[2:]) for z in (0, 1)}
    assert truths[1] < truths[0]


@pytest.mark.parametrize("tp, members", [(8, 1), (4, 2), (2, 4), (1, 8)])
def test_a_ring_crosses_between_nodes_through_every_nic_its_members_on_a_node_have(tp, members):
    """NCCL builds a ring channel through each NIC of a node: a DP group with ``members`` GPUs on
    each node crosses between nodes over all of their NICs at once, ``members`` times one NIC's
    rate, bounded by NVLink (which carries every member's whole ring). The group's members on a
    node are read from the mesh, alike by ``of_layout`` and the grid's canonical placement; the
    DP seconds go as ``1 / members``. The event truth's rings run the same rate."""
    from nereus.sim.truth.network import link_of, ring_link_of

    model_text = "\nplan @probe {\n  workload = @w22b\n  cluster = @selene\n  layout gpt22b.train { "
    dp = 32 // tp * 4  # 4 nodes' worth of copies at every TP: 8 / tp members a node
    layout = f"tp = {tp}, pp = 1, dp = {dp}, layers = [0..47], mesh = [0..{tp * dp - 1}], dp_overlap = false }}\n}}\n"
    m = nereus.parse(BASE + model_text + layout)
    nereus.verify(m)
    lay, cluster = m.plans["probe"].layouts["gpt22b.train"], m.clusters["selene"]
    c = Candidates.of_layout(cluster, lay)
    grid = Candidates.grid(cluster, 48, tp, 1, dp)
    assert int(c.dp_local[0]) == int(grid.dp_local[0]) == members
    cost = CostModel(cluster)
    sc = cost.stage(m.models["gpt22b"], m.workloads["w22b"], "train", c)
    single = replace(c, dp_local=np.ones(1, dtype=np.int64))
    alone = cost.stage(m.models["gpt22b"], m.workloads["w22b"], "train", single)
    nic, nvlink = cluster.inter_node.bandwidth, cluster.intra_node.bandwidth
    assert alone.parts["dp"][1][0] / sc.parts["dp"][1][0] == pytest.approx(min(members * nic, nvlink) / nic)
    ring = lay.mesh[:: lay.tp][: lay.dp]
    assert ring_link_of(cluster, ring)[1] / link_of(cluster, ring)[1] == pytest.approx(members)


def test_what_runs_the_same_and_what_verl_runs_read_the_resolved_setting():
    """The decision core's ``same_layout`` and the truth's cache key see a layout's pipeline sends
    as they run (an explicit default is the default); verl's inference passes, on the actor's
    Megatron engine, send as the actor's training does."""
    from nereus.control.decide import same_layout
    from nereus.passes.search.targets import as_run_by
    from nereus.sim.truth.step import layout_of

    lay = nereus.parse(_text(GOOD + ", vpp = 2")).plans["probe"].layouts["gpt175b.train"]
    default, waited, no_dp = (
        replace(lay, pp_overlap=True),
        replace(lay, pp_overlap=False),
        replace(lay, dp_overlap=False),
    )
    assert same_layout(lay, default) and layout_of(lay) == layout_of(default)
    for other in (waited, no_dp):
        assert not same_layout(lay, other) and layout_of(lay) != layout_of(other)

    job = nereus.parse((ROOT / "examples" / "ppo_70b_1024gpu.nir").read_text())
    plan = next(iter(job.plans.values()))
    train = plan.layouts["actor.train"]
    assert train.tp > 1  # verl runs it on its Megatron workers

    def infer_sends(**kw) -> list[bool]:
        run = as_run_by(
            job, replace(plan, layouts={**plan.layouts, "actor.train": replace(train, vpp=2, **kw)}), "verl"
        )
        return [x.pp_overlapped for ms, x in run.layouts.items() if ms.endswith(".infer") and x.pp > 1]

    assert infer_sends(pp_overlap=False) and not any(infer_sends(pp_overlap=False))
    assert infer_sends() and all(infer_sends())
