"""The decision core: measurements in, decisions out, on the 8B PPO example (16 GPUs, 2 nodes).

Each test feeds StepRecords as a running job would and checks the decision and its numbers."""

import json

import pytest

import nereus
from nereus.control import ControlOptions, DecisionCore, StepRecord
from nereus.passes.transition.lower_bound import lower_bound

from ..support import EXAMPLES

PPO = next(p for p in EXAMPLES if p.name == "ppo_8b_16gpu.nir")
FAST = dict(recalibrate_every=0, search_time_limit=5.0, schedule_time_limit=1.0)


def core(text: str | None = None, **options) -> DecisionCore:
    m = nereus.parse(text or PPO.read_text())
    return DecisionCore(m, "ppo_p0", ControlOptions(**{**FAST, **options}))


def as_planned(c: DecisionCore, step: int, factor: float = 1.0, length: float = 1.0, **kw) -> StepRecord:
    """A step whose stage times are the plan's estimates times ``factor`` and whose responses
    are the planned mean length times ``length``."""
    plan = c.m.plans[c.plan]
    seconds = {ms: lay.time * factor for ms, lay in plan.layouts.items()}
    n = round(c.workload.response_len_mean * length)
    return StepRecord(step, seconds, response_lengths=(n,) * 8, **kw)


def test_a_step_as_planned_stays_without_planning():
    c = core()
    c.observe(as_planned(c, 0))
    d = c.decide()
    assert d.action == "stay" and d.triggers == [] and "step_time_new" not in d.numbers and d.module is None


def test_longer_responses_replan_and_the_move_is_admitted_with_its_numbers():
    c = core()
    for step in range(3):
        c.observe(as_planned(c, step, length=3.0))
    d = c.decide()
    assert [t.kind for t in d.triggers] == ["response_length"] and not d.forced
    n = d.numbers
    assert d.action == "transition" and n["admission"] == "accept" and n["step_time_new"] < n["step_time_now"]
    assert n["benefit"] == pytest.approx(n["saving"] * n["horizon"], rel=1e-3)
    assert n["break_even"] == pytest.approx(n["cost"] / n["saving"], rel=1e-3)
    m = nereus.verify(d.module)
    t = m.transitions[d.transition]
    assert t.bytes_moved == t.lower_bound == lower_bound(m, d.source, d.target)
    assert n["remap_bytes_after"] <= n["remap_bytes_before"]
    assert m.workloads[m.plans[d.target].workload].response_len_mean == 3 * c.workload.response_len_mean
    c.commit(d)
    assert c.plan == d.target and c.planned_response == 3 * 1024
    c.observe(as_planned(c, 3))
    assert c.decide().action == "stay"  # under plan B, as planned


def test_gpus_announced_to_leave_force_a_move_off_them_while_they_still_send():
    c = core()
    gpus = sorted(c.gpus_now)
    leaving = tuple(gpus[8:])
    c.observe(as_planned(c, 0, gpus=tuple(gpus), leaving=leaving))
    d = c.decide()
    assert d.action == "transition" and d.forced and [t.kind for t in d.triggers] == ["gpus_leaving"]
    m = d.module
    used = {g for lay in m.plans[d.target].layouts.values() for g in lay.mesh}
    assert used and not used & set(leaving)
    t = m.transitions[d.transition]
    assert t.bytes_moved == t.lower_bound == lower_bound(m, d.source, d.target, lost=set())  # nothing lost
    c.commit(d)
    assert c.gpus_planned == set(gpus[:8])
    assert c.m is m and d.module is None  # the job is the core's now; the history keeps none alive


def test_state_lost_with_gpus_that_failed_is_infeasible_without_a_checkpoint():
    """Under ZeRO-1 each DP rank holds the only copy of its optimizer shard: a GPU that fails
    without notice takes it along, and no transition can rebuild it."""
    c = core()
    c.observe(as_planned(c, 0, gpus=tuple(g for g in sorted(c.gpus_now) if g != 3)))
    d = c.decide()
    assert d.action == "infeasible" and d.forced and d.module is None
    assert "lost with GPUs [3]" in d.message and "checkpoint" in d.message


def test_gpus_lost_without_notice_hold_nothing():
    """Without ZeRO every DP replica holds all of its state: what the failed GPUs held comes
    from the survivors, and nothing is read from the failed ones."""
    replicated = PPO.read_text().replace(
        "pp = 2\n    dp = 1\n    layers = [0..15, 16..31]", "pp = 1\n    dp = 2\n    layers = [0..31]"
    )
    c = core(replicated.replace("zero = 1", "zero = 0"))  # actor and critic train as TP 4 x DP 2, no ZeRO
    gpus = sorted(c.gpus_now)
    gone = {3, 12}
    c.observe(as_planned(c, 0, gpus=tuple(g for g in gpus if g not in gone)))
    d = c.decide()
    assert d.action == "transition" and d.forced and d.triggers[0].kind == "gpus_lost"
    m = d.module
    t = m.transitions[d.transition]
    senders = {
        m.emus[(d.source, op.src[0].model_stage, op.src[0].dp)].shard(op.src[0].pp, op.src[0].tp).gpu
        for op in t.ops
        if op.spec.transfer
    }
    assert not senders & gone
    assert t.bytes_moved == t.lower_bound == lower_bound(m, d.source, d.target, lost=gone)


def test_a_move_that_does_not_pay_is_rejected_and_the_cooldown_holds():
    c = core(cooldown=5)
    c.total_steps = 2  # one step left: no saving repays a transition
    c.observe(as_planned(c, 0, length=3.0))
    d = c.decide()
    assert d.action == "stay" and d.triggers and d.numbers["admission"] == "reject" and d.module is None
    assert "rejected" in d.message
    c.observe(as_planned(c, 1, length=3.0))
    again = c.decide()
    assert again.action == "stay" and again.triggers == []  # within the cooldown: no re-plan


def test_a_saving_that_cannot_pay_the_fixed_costs_is_rejected_before_planning_the_transition(monkeypatch):
    # process groups dearer than the one step left can save (with a restart instead, the best plan
    # that keeps the engines is weighed: the next tests)
    c = core(pg_init=60.0, engine_restart=0.0)
    c.total_steps = 2  # one step left: the saving cannot pay even the process groups
    c.observe(as_planned(c, 0, length=3.0))
    d = c.decide()
    n = d.numbers
    assert d.action == "stay" and "before planning the transition" in d.message
    assert n["cost_lower_bound"] > 0 and n["saving"] * n["horizon"] <= n["cost_lower_bound"] * 1.1
    assert "bytes_moved" not in n and "makespan" not in n  # plan-transition and schedule-transfers never ran
    # with the shortcut off, the whole path (transition planned, scheduled, admitted) decides the same
    import nereus.control.decide as decide_mod

    monkeypatch.setattr(decide_mod, "fixed_costs", lambda *a, **k: (-1e9, 0.0))
    full = core(pg_init=60.0, engine_restart=0.0)
    full.total_steps = 2
    full.observe(as_planned(full, 0, length=3.0))
    e = full.decide()
    assert e.action == "stay" and e.numbers["admission"] == "reject" and e.numbers["bytes_moved"] > 0
    assert e.numbers["cost"] >= n["cost_lower_bound"] and e.numbers["saving"] == pytest.approx(n["saving"])


def test_a_length_drift_weighed_and_rejected_fires_again_only_when_the_lengths_drift_again():
    c = core(cooldown=0)
    c.total_steps = 2  # nothing pays: every re-plan is rejected
    c.observe(as_planned(c, 0, length=3.0))
    assert [t.kind for t in c.decide().triggers] == ["response_length"]
    assert c.planned_response == 3 * 1024  # the lengths that re-plan weighed
    c.observe(as_planned(c, 1, length=3.0))
    c.history = c.history[-1:]
    again = c.decide()
    assert again.action == "stay" and again.triggers == []  # the same lengths: nothing new to weigh
    c.observe(as_planned(c, 2, length=4.5))
    c.history = c.history[-1:]
    assert [t.kind for t in c.decide().triggers] == ["response_length"]  # +50% from what was weighed


def test_a_rank_that_follows_the_leaders_rejected_replan_checks_as_the_leader_does():
    """The live Controller re-plans on one rank and broadcasts; the others ``follow``. After a
    rejected length re-plan every rank must re-base its trigger, or the others fire alone next."""
    leader, other = core(cooldown=0), core(cooldown=0)
    for c in (leader, other):
        c.total_steps = 2  # nothing pays: every re-plan is rejected
        c.observe(as_planned(c, 0, length=3.0))
    d = leader.decide()
    assert d.action == "stay" and other.check() is None  # the same trigger fired on both
    other.follow(d)
    assert other.planned_response == leader.planned_response == 3 * 1024
    assert other.last_replan == leader.last_replan and other.gpus_considered == leader.gpus_considered
    for c in (leader, other):
        c.observe(as_planned(c, 1, length=3.0))
        c.history = c.history[-1:]
    quiet = [c.check() for c in (leader, other)]  # None would mean a trigger fired: a re-plan on that rank
    assert all(q is not None and q.action == "stay" and q.triggers == [] for q in quiet), quiet


def test_memory_without_headroom_is_a_trigger_and_over_the_gpu_is_forced():
    c = core()
    cap = c.m.clusters[c.m.plans[c.plan].cluster].gpu_memory
    rec = as_planned(c, 0)
    c.observe(
        StepRecord(0, rec.seconds, memory={"actor.train": int(cap * 0.97)}, response_lengths=rec.response_lengths)
    )
    d = c.decide()
    assert [t.kind for t in d.triggers] == ["memory"] and not d.forced


def test_memory_weighed_and_kept_fires_again_only_as_it_closes_in_on_the_gpu():
    """A plan that runs close to full and that a re-plan found still best is not weighed again at
    every check: the trigger counts from the peak weighed, and fires past half the way from there
    to the GPU's memory (over it, always, and forced)."""
    c = core(cooldown=0)
    c.total_steps = 2  # nothing pays: every re-plan keeps plan A
    cap = c.m.clusters[c.m.plans[c.plan].cluster].gpu_memory
    rec = as_planned(c, 0)

    def at(step, fraction):
        c.observe(
            StepRecord(
                step, rec.seconds, memory={"actor.train": int(cap * fraction)}, response_lengths=rec.response_lengths
            )
        )
        c.history = c.history[-1:]
        return c.decide()

    first = at(0, 0.96)
    assert [t.kind for t in first.triggers] == ["memory"] and first.action == "stay"
    assert first.numbers["weighed_memory"]["actor.train"] == int(cap * 0.96)
    assert at(1, 0.96).triggers == [] and at(2, 0.975).triggers == []  # short of 0.98: nothing new to weigh
    again = at(3, 0.985)
    assert [t.kind for t in again.triggers] == ["memory"] and not again.forced
    assert c.weighed_memory["actor.train"] == int(cap * 0.985)
    over = at(4, 1.01)
    assert [t.kind for t in over.triggers] == ["memory"] and over.forced


def test_a_follower_takes_the_weighed_memory_peaks_from_the_leader():
    leader, other = core(cooldown=0), core(cooldown=0)
    for c in (leader, other):
        c.total_steps = 2
        cap = c.m.clusters[c.m.plans[c.plan].cluster].gpu_memory
        rec = as_planned(c, 0)
        c.observe(
            StepRecord(0, rec.seconds, memory={"actor.train": int(cap * 0.96)}, response_lengths=rec.response_lengths)
        )
    d = leader.decide()
    assert other.check() is None
    other.follow(d)
    assert other.weighed_memory == leader.weighed_memory == {"actor.train": int(cap * 0.96)}


def test_recalibration_fits_the_measured_times():
    c = core(recalibrate_every=4, slowdown=10.0)
    before = c.m.plans[c.plan].step_time
    for step in range(4):
        c.observe(as_planned(c, step, factor=1.5))
    d = c.decide()
    assert d.numbers["recalibrated"] and d.numbers["fit_error_after"] < d.numbers["fit_error_before"]
    assert c.m.plans[c.plan].step_time == pytest.approx(1.5 * before, rel=0.1)


def test_decisions_are_logged_as_json_lines(tmp_path):
    log = tmp_path / "decisions.jsonl"
    m = nereus.parse(PPO.read_text())
    c = DecisionCore(m, "ppo_p0", ControlOptions(**FAST), log=log)
    c.observe(as_planned(c, 0))
    c.decide()
    c.observe(as_planned(c, 1, length=3.0))
    c.decide()
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [x["action"] for x in lines] == ["stay", "transition"]
    assert lines[1]["triggers"][0]["kind"] == "response_length" and lines[1]["numbers"]["bytes_moved"] > 0


@pytest.mark.parametrize(
    "options, error",
    [
        (dict(window="5"), TypeError),
        (dict(cooldown=1.5), TypeError),
        (dict(margin=True), TypeError),
        (dict(slowdown=-1.0), ValueError),
        (dict(memory_headroom=1.0), ValueError),
        (dict(window=0), ValueError),
        (dict(verify="always"), ValueError),
        (dict(verify=1), ValueError),
    ],
)
def test_options_of_the_wrong_type_or_range_fail_at_construction(options, error):
    with pytest.raises(error, match="ControlOptions"):
        ControlOptions(**options)


def test_bad_input_is_refused():
    m = nereus.parse(PPO.read_text())
    with pytest.raises(ValueError, match="no plan @nope"):
        DecisionCore(m, "nope")
    with pytest.raises(TypeError):
        DecisionCore(m, "ppo_p0", options={"window": 3})
    with pytest.raises(ValueError, match="seconds of actor.train must be positive"):
        StepRecord(0, {"actor.train": 0.0})


def test_the_search_proposes_only_layouts_the_job_can_take():
    """A live model without pipeline stages, ZeRO or offload (``max_pp=1, max_zero=0,
    offload=false``): plan B has none of them, where the unconstrained search uses them."""
    free, held = core(), core(max_pp=1, max_zero=0, offload=False)
    for c in (free, held):
        c.observe(as_planned(c, 0, length=3.0))
    d_free, d_held = free.decide(), held.decide()
    assert d_free.action == d_held.action == "transition"
    lays_free = d_free.module.plans[d_free.target].layouts.values()
    lays_held = d_held.module.plans[d_held.target].layouts.values()
    assert any(lay.pp > 1 or lay.zero or lay.offload for lay in lays_free)
    assert all(lay.pp == 1 and lay.zero == 0 and not lay.offload for lay in lays_held)


def test_plan_b_never_takes_the_name_of_a_plan_the_module_has():
    """A job whose plan is called @p0 re-planned at step 0: plan B must not overwrite it."""
    m = nereus.parse(PPO.read_text().replace("ppo_p0", "p0"))
    c = DecisionCore(m, "p0", ControlOptions(**FAST))
    c.observe(
        StepRecord(0, {ms: lay.time for ms, lay in c.m.plans["p0"].layouts.items()}, response_lengths=(3072,) * 8)
    )
    d = c.decide()
    assert d.target not in (None, "p0") and d.transition != "p0_to_p0"
    assert d.action == "transition" and d.numbers["saving"] > 0


def test_recalibrating_at_responses_too_long_for_plan_a_replans_instead_of_raising():
    """The core costs measured steps at the lengths they generated; when those no longer fit
    plan A, recalibration must not stop the loop: the re-plan sees plan A does not fit (forced)."""
    c = core(recalibrate_every=1)
    for step in range(2):
        c.observe(as_planned(c, step, length=64.0))  # 64k-token responses: plan A runs out of memory
    d = c.decide()
    assert d.numbers["recalibrated"]
    assert d.forced and d.action in ("transition", "infeasible")


def test_the_search_after_a_move_starts_from_the_running_plan_as_searched(monkeypatch):
    """remap renames plan B's GPUs, so the running plan's meshes are not runs of the search's GPU
    order and plan-search could not start from it: the core keeps plan B as plan-search gave it
    (the same shapes, time and memory) and the next search starts from that."""
    import nereus.passes.search.plan_search as ps

    c = core()
    for step in range(3):
        c.observe(as_planned(c, step, length=3.0))
    d = c.decide()
    assert d.action == "transition"
    c.commit(d)
    running, searched = c.m.plans[c.plan], c.searched
    assert d.searched is None and searched.name == running.name
    assert searched.step_time == running.step_time
    real, seen = ps.placed, []

    def spy(problem, plan):
        seen.append((plan.name, real(problem, plan), real(problem, running)))
        return seen[-1][1]

    monkeypatch.setattr(ps, "placed", spy)
    for step in range(3, 9):  # past the cooldown
        c.observe(as_planned(c, step, length=0.6))  # shorter: a re-plan on the same GPUs
    d = c.decide()
    assert "step_time_new" in d.numbers  # it searched
    ((name, from_searched, from_running),) = seen
    assert name != c.plan and (d.module is None or name not in d.module.plans)  # searched from, not kept
    assert from_searched is not None  # the search started from the running plan...
    assert from_running is None  # ...which, as remap left it, no search could start from


def _longer_responses(verify: str):
    c = core(verify=verify)
    for step in range(3):
        c.observe(as_planned(c, step, length=3.0))
    return c.decide()


def test_the_core_runs_its_passes_through_the_pass_manager_verified_as_its_policy_says(monkeypatch):
    """The re-plan's passes run through ``run_pipeline``: with ``verify="each"`` after every pass,
    with ``end`` once after the move's last pipeline, with ``off`` never (the job the core is
    given is verified once, under every policy); the decision is the same under all three."""
    from nereus.ir import verifier
    from nereus.passes.infra import pass_manager

    ran, verified = [], []
    real_run, real_verify = pass_manager.run_pipeline, verifier.verify
    monkeypatch.setattr(
        pass_manager,
        "run_pipeline",
        lambda m, spec, *a, **kw: (ran.append([p.name for p in spec]), real_run(m, spec, *a, **kw))[1],
    )
    import nereus.control.decide as decide

    monkeypatch.setattr(decide, "run_pipeline", pass_manager.run_pipeline)
    monkeypatch.setattr(
        pass_manager, "verify_module", lambda m: (verified.append(len(m.transitions)), real_verify(m))[1]
    )
    decisions = {}
    for policy in ("each", "end", "off"):
        ran.clear(), verified.clear()
        decisions[policy] = _longer_responses(policy)
        names = [n for spec in ran for n in spec]
        assert {"plan-search", "remap", "plan-transition", "schedule-transfers", "admit"} <= set(names)
        assert verified[0] == 0  # the input, before any pass
        if policy == "each":
            assert len(verified) >= len(names) and verified[-1] == 1  # the last: the job with the transition
        elif policy == "end":
            assert verified == [0, 1]
        else:
            assert verified == [0]
    assert (
        len({(d.action, d.target, d.numbers["bytes_moved"], d.numbers["step_time_new"]) for d in decisions.values()})
        == 1
    )


def test_a_pass_that_leaves_invalid_ir_in_the_core_is_reported_by_the_verifier(monkeypatch):
    """With verification on, a broken pass is caught before the runtime could run its output."""
    from nereus.passes.transition.admit import Admit

    real = Admit.apply

    def breaks(self, m):
        real(self, m)
        import dataclasses

        t = m.transitions[self.transition.lstrip("@")]
        t.ops[-1] = dataclasses.replace(
            t.ops[-1], deps=[*t.ops[-1].deps, "%no_such_op"]
        )  # after an operation that does not exist

    monkeypatch.setattr(Admit, "apply", breaks)
    with pytest.raises(nereus.DiagnosticError, match="IR is invalid after pass admit"):
        _longer_responses("end")
    assert _longer_responses("off").action == "transition"  # unverified, the broken IR goes through


def grpo_engine_job():
    """The live GRPO example's IR job with vLLM engines (``actor.generate`` TP 4 on GPUs 0..3),
    planned for responses of 1 token."""
    import sys

    from ..support import ROOT

    sys.path.insert(0, str(ROOT / "examples"))
    import grpo_tiny

    return grpo_tiny.job(grpo_tiny.parse(["--engine", "vllm", "--gen-tp", "4"]), 4)[1]


def engine_core(restart: float) -> DecisionCore:
    opts = dict(FAST, pg_init=0.0, margin=0.0, engine_restart=restart, max_pp=1, max_zero=0, offload=False)
    c = DecisionCore(grpo_engine_job(), "a", ControlOptions(**opts), total_steps=100)
    plan = c.m.plans["a"]
    c.observe(StepRecord(0, {ms: lay.time for ms, lay in plan.layouts.items()}, response_lengths=(4,) * 8))
    return c


def test_where_restarting_the_engines_does_not_pay_the_best_plan_that_keeps_them_is_weighed():
    free = engine_core(0.0).decide()
    gen = "actor.generate"
    assert free.action == "transition" and "engines" not in free.numbers
    a = free.module.plans["a"].layouts[gen]
    assert (free.module.plans[free.target].layouts[gen].tp, a.tp) == (1, 4)  # the free search restarts them
    kept = engine_core(1e4).decide()  # a restart no saving over 99 steps pays
    n = kept.numbers
    assert kept.action == "transition" and n["engines"] == "kept" and "engines kept" in kept.message
    b = kept.module.plans[kept.target].layouts[gen]
    assert (b.tp, b.pp, b.dp, b.mesh) == (a.tp, a.pp, a.dp, a.mesh)
    assert n["step_time_restarting"] == pytest.approx(free.numbers["step_time_new"])
    assert n["step_time_restarting"] <= n["step_time_new"] < n["step_time_now"]
    assert kept.module.transitions[kept.transition].admit.engine_restart == 0  # admit agrees: no restart


def test_a_peak_over_the_gpu_sets_the_slack_and_plan_b_fits_at_it():
    """Training peaked 15% over the GPU though the count says it fits: the core refits the
    memory slack to that peak before it re-plans (between its regular refits), and every
    training and inference layout of plan B fits at it, with the headroom plan-search keeps."""
    c = core(recalibrate_every=1000)
    plan = c.m.plans[c.plan]
    cluster = c.m.clusters[plan.cluster]
    cap = cluster.gpu_memory
    rec = as_planned(c, 0)
    c.observe(as_planned(c, 0))
    assert c.decide().action == "stay"  # the first step's refit: times only, no peaks
    lay = plan.layouts["actor.train"]
    counted = lay.memory - lay.memory_breakdown.resident
    c.observe(
        StepRecord(1, rec.seconds, memory={"actor.train": int(cap * 1.15)}, response_lengths=rec.response_lengths)
    )
    d = c.decide()
    assert d.forced and d.numbers["recalibrated"] and d.action == "transition"
    slack = cluster.efficiency.memory_slack
    assert slack == pytest.approx((cap * 1.15 - lay.memory_breakdown.resident) / counted, rel=1e-3)
    b = d.module.plans[d.target]
    kinds = {ms: d.module.workloads[b.workload].stage_of(ms).kind for ms in b.layouts}
    for ms, lay_b in b.layouts.items():
        if kinds[ms] != "generate":
            assert lay_b.memory_breakdown.slack > 0, ms
            assert lay_b.memory <= cap * 0.95 + 2**21, ms


def test_a_plan_b_that_offloads_past_a_gpu_is_recognised_for_a_search_without_offload():
    """plan-transition delivers all of plan B's state onto its GPUs and offloads it at commit,
    so a plan B that fits only with its state in host memory can have no order: at 28 GiB per
    GPU, the 8B job's actor trained at TP 2 x PP 2 x DP 2 with weights and optimizer offloaded
    takes 2 GB more than GPU 0 holds. That diagnostic is what makes the core search again
    without offload (``_host_bound``; the 1,024-GPU combined trace hit it at step 823 under
    ``slow-inter``); a plan B that offloads nothing, or plan A's own state, does not."""
    from nereus.control.decide import _host_bound

    text = PPO.read_text().replace("gpu_memory = 80GiB", "gpu_memory = 28GiB")
    start = text.index("plan @ppo_p0 {")
    block = text[start : text.index("\n}\n", start) + 3].replace("plan @ppo_p0 {", "plan @b {")
    i = block.index("layout actor.train {")
    offloading = "\n    tp = 2\n    pp = 2\n    dp = 2\n    layers = [0..15, 16..31]\n    mesh = [0..7]\n"
    offloading += "    micro_batches = 16\n    zero = 1\n    recompute = true\n    offload = [weights, optimizer]\n  "
    block = block[: i + len("layout actor.train {")] + offloading + block[block.index("}", i) :]
    m = nereus.parse(text + "\n" + block)
    m.emus.clear()  # the example's hand-written EMU of actor.train holds weights only
    with pytest.raises(nereus.DiagnosticError) as e:
        nereus.run_pipeline(m, "plan-transition{source=@ppo_p0,to=@b,into=@t}")
    why = e.value.diagnostics[0].message
    assert why.startswith("no order fits on GPU 0: plan B's state alone")
    b = m.plans["b"]
    assert _host_bound(why, b)
    assert not _host_bound(why.replace("plan B's state", "plan A's state"), b)  # plan A does not fit: no plan B helps
    offload = b.layouts["actor.train"].offload
    b.layouts["actor.train"].offload = ()
    assert not _host_bound(why, b)  # nothing to stop offloading
    b.layouts["actor.train"].offload = offload
