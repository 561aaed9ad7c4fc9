"""The simulator on a small job (PPO, Llama-3-8B-class models, 16 GPUs) and a hand-made trace,
under the event truth (the default): every policy runs every step, the oracle runs what the truth
says is faster, the decision core's calibration brings its estimates near the event truth, and
bad runs are refused before they start. Under the formula truth, the oracle's plan is
plan-search's optimum, never slower than another policy's."""

import copy

import pytest

import nereus
from nereus.ir import DiagnosticError
from nereus.passes.cost.estimate import estimate_plan
from nereus.sim.generate import length_shares
from nereus.sim.simulate import simulate
from nereus.sim.simulated_cluster import SimCluster, conditions
from nereus.sim.trace import Trace, TraceStep
from nereus.testing.jobs import ppo_8b_16gpu

STEPS = 36


def _job():
    return nereus.parse(ppo_8b_16gpu())


def _trace(gpus: int = 16) -> Trace:
    """8 GPUs, then 16 from step 8 (a grant), GPUs 12-15 announced to leave at step 20 and gone
    from 21; responses grow 1,000 -> 2,000 tokens (mean) in four steps of the distribution."""
    steps = []
    for i in range(STEPS):
        down = set(range(8, 16)) if i < 8 else set(range(12, 16)) if i > 20 else set()
        dist = length_shares(1000 + 1000 * min(i // 9, 3) / 3, 4096)
        steps.append(TraceStep(i, dist, frozenset(down), frozenset(range(12, 16)) if i == 20 else frozenset()))
    return Trace("small", "ppo_8b_16gpu", gpus, steps)


@pytest.fixture(scope="module")
def result():
    return simulate(_job(), _trace(), progress=False)


@pytest.fixture(scope="module")
def formula():
    return simulate(
        _job(), _trace(), ["fixed", "verl", "openrlhf", "nereus", "oracle"], progress=False, truth="formula"
    )


def test_every_policy_runs_every_step_and_the_numbers_add_up(result):
    for name, run in result["runs"].items():
        s = run.summary()
        assert len(run.latency) == STEPS, name
        done = sum(1 for x in run.step if x > 0)  # steps that ran; a lost one yields no samples
        assert s["completed"] == done
        assert s["mean_s"] == pytest.approx(sum(run.latency) / done)
        assert s["throughput_samples_per_s"] == pytest.approx(512 * done / sum(run.latency))
        # latency = the step + the weight push + moves + lost time + checkpoint saves, nothing else
        assert sum(run.latency) == pytest.approx(
            sum(run.step) + sum(run.sync) + run.move_s + run.lost_s + run.save_s, rel=1e-9
        )
    # the GPUs changed three times: every restarting policy moved, and so did Nereus (a GPU it used left)
    for name in ("fixed", "fixed-dp", "verl", "openrlhf", "nereus"):
        assert result["runs"][name].moves, name
    assert result["runs"]["oracle"].move_s == 0


def test_under_the_formula_truth_the_oracle_is_never_slower_than_a_plan_in_the_same_truth(formula):
    """There the oracle's plan is plan-search's optimum under the true coefficients, so at each step
    its time (before noise, which every policy shares) is at most any other policy's."""
    oracle = formula["runs"]["oracle"]
    for name in ("fixed", "verl", "openrlhf", "nereus"):
        run = formula["runs"][name]
        for i in range(STEPS):
            if run.step[i] > 0 and oracle.step[i] > 0:
                assert oracle.step[i] <= run.step[i] * (1 + 1e-3), (name, i, oracle.step[i], run.step[i])


def test_under_the_event_truth_the_oracle_runs_what_the_truth_says_is_faster(result):
    """The event truth has no coefficients to search with: at each change of conditions the oracle
    searches with the cost model fitted to the truth's times of its plan, and keeps whichever of
    the found plan and its incumbent runs faster in truth. So no step runs a plan the truth puts
    behind the one it ran before; and over the run it is the fastest policy (it moves for free)."""
    sim = SimCluster(_job(), _trace())
    oracle = result["policies"]["oracle"]
    plans = [oracle.cache[conditions(s)] for s in sim.trace.steps]
    changed = 0
    for i in range(1, STEPS):
        if plans[i] is not plans[i - 1]:
            changed += 1
            before = sim.evaluate(plans[i - 1], i)
            if not before.failure:
                assert sim.evaluate(plans[i], i).step_time <= before.step_time, i
    assert changed >= 2  # the GPUs changed twice
    mean = {n: r.summary()["mean_s"] for n, r in result["runs"].items()}
    assert mean["oracle"] == min(mean.values()), mean


def test_policies_run_in_worker_processes_give_the_same_runs(result):
    """``jobs=2``: each policy in a spawned process, with the noise drawn once in the parent. The
    same plans at every step and the same moves; only what a move costs may differ, for Nereus,
    whose transfer schedules are solved under a wall-clock limit (a loaded CI machine showed it)."""
    par = simulate(_job(), _trace(), progress=False, jobs=2)
    assert list(par["runs"]) == list(result["runs"])
    for name, run in result["runs"].items():
        other = par["runs"][name]
        assert (other.step, other.sync, other.moves, other.failures, other.lost_s) == (
            run.step,
            run.sync,
            run.moves,
            run.failures,
            run.lost_s,
        ), name
        if name != "nereus":
            assert other.latency == run.latency, name
    assert [d.action for d in par["policies"]["nereus"].core.decisions] == [
        d.action for d in result["policies"]["nereus"].core.decisions
    ]
    # a worker's run reports its CPU seconds (the JSON's ``cpu_s``), at least its decisions'
    # share where it decided on one CPU; the in-process run has none to report
    for name, run in par["runs"].items():
        assert run.cpu_s is not None and run.cpu_s > 0, name
        assert run.summary()["cpu_s"] == run.cpu_s
    assert all(run.cpu_s is None for run in result["runs"].values())


def test_calibrating_online_brings_the_estimate_near_the_event_truth(result):
    """After calibrating online on noisy measurements (per rank, the slowest taken), the core's
    estimate of the plan it runs, at the last step's lengths, is within 8% of the event truth's
    step time, and at most half the priors' error. The event truth is no formula of the cost
    model: the bound is measured, not reached by construction. Measured
    (``simulate(_job(), _trace(), ["nereus"], seed=s)``, the last step): 4.7%, 1.1% and 1.9%
    after calibration at seeds 0, 1 and 2, against 20%, 16% and 15% with the priors."""
    core = result["policies"]["nereus"].core
    plan = core.m.plans[core.plan]
    assert core.m.clusters[plan.cluster].efficiency is not None
    sim = SimCluster(_job(), _trace())
    last = STEPS - 1
    truth = sim.evaluate(copy.deepcopy(plan), last).step_time

    def predicted(efficiency):  # the plan at the last step's conditions, costed with ``efficiency``
        m = copy.deepcopy(sim.module_at(last))
        m.clusters[sim.cluster.name].efficiency = efficiency
        p = copy.deepcopy(plan)
        p.name, p.workload, p.cluster = "_p", sim.workload.name, sim.cluster.name
        m.plans["_p"] = p
        assert estimate_plan(m, p) == []
        return p.step_time

    learned, prior = predicted(core.m.clusters[plan.cluster].efficiency), predicted(None)
    assert abs(learned / truth - 1) <= 0.08
    assert abs(prior / truth - 1) >= 2 * abs(learned / truth - 1)


def test_a_plan_that_does_not_fit_fails_its_step():
    sim = SimCluster(_job(), _trace())
    plan = copy.deepcopy(nereus.parse(ppo_8b_16gpu()).plans["ppo_p0"])
    assert sim.evaluate(plan, 10).failure == ""  # 16 GPUs, short responses
    long = Trace("long", "ppo_8b_16gpu", 16, [TraceStep(0, length_shares(60000, 200000), frozenset())])
    assert SimCluster(_job(), long).evaluate(plan, 0).failure == "out of memory"
    assert sim.evaluate(plan, 0).failure == "GPUs gone"  # only GPUs 0-7 at step 0


def test_a_trace_beyond_the_cluster_or_an_unknown_policy_is_refused_before_the_run():
    with pytest.raises(DiagnosticError, match="ranges over 32 GPUs, but cluster @h100x16 of job ppo_8b_16gpu has 16"):
        simulate(_job(), _trace(gpus=32), progress=False)
    with pytest.raises(DiagnosticError, match=r"unknown policies \['slurm'\]"):
        simulate(_job(), _trace(), policies=["nereus", "slurm"], progress=False)


def test_the_papers_baseline_keeps_tp_pp_and_virtual_stages_and_scales_dp(result):
    """``fixed-dp`` keeps each model-stage's step-0 TP, PP and virtual stages through the trace's
    GPU changes; its DP follows the GPUs (its memory knobs are re-tuned at each restart, as its
    user would)."""
    from nereus.sim.policies import search

    sim = SimCluster(_job(), _trace())
    start = search(copy.deepcopy(sim.module_at(0)), None, "p0")
    p = result["policies"]["fixed-dp"]
    moves = result["runs"]["fixed-dp"].moves
    # it restarts when the GPUs change: onto the grant of step 8 after that step (it learns of it
    # then, as Nereus's core does), off the GPUs announced at step 20 before step 21
    assert {9, 21} <= set(moves)
    kept = lambda lay: (lay.tp, lay.pp, lay.vpp)
    assert all(kept(lay) == kept(start.layouts[ms]) for ms, lay in p.plan.layouts.items())
    # on the 16 GPUs granted at step 8 (before the leave, after which 12 may fit no more than 8
    # do): some model-stage's DP grew with them, on more GPUs, its TP, PP and virtual stages kept
    trace = _trace()
    granted = simulate(_job(), Trace(trace.name, trace.job, trace.gpus, trace.steps[:20]), ["fixed-dp"], progress=False)
    assert granted["runs"]["fixed-dp"].moves == [9]
    wide = granted["policies"]["fixed-dp"].plan.layouts
    assert all(kept(lay) == kept(start.layouts[ms]) for ms, lay in wide.items())
    grew = [ms for ms, lay in wide.items() if lay.dp > start.layouts[ms].dp]
    assert grew and all(len(wide[ms].mesh) > len(start.layouts[ms].mesh) for ms in grew)


def test_a_restarting_policy_whose_tp_pp_no_longer_fit_restarts_with_new_ones():
    """Responses grow 1k -> 4k tokens at step 2 on 8 GPUs (the longest 6k): the OpenRLHF-like pools'
    step-0 TP/PP no longer fit. It used to fail every later step; like a user, it now restarts with
    new TP/PP. (With responses up to 8k, training sized for its longest micro-batch, no TP/PP of its
    pools fits 8 GPUs at all.)"""
    steps = [
        TraceStep(i, length_shares(1000 if i < 2 else 4000, 6000), frozenset(range(8, 16)), frozenset())
        for i in range(4)
    ]
    r = simulate(
        _job(), Trace("grow", "ppo_8b_16gpu", 16, steps), policies=["fixed", "verl", "openrlhf"], progress=False
    )
    for name, run in r["runs"].items():
        assert run.summary()["completed"] == 4 and run.moves == [2], name


def test_the_command_line_runs_the_policies_in_processes_and_prints_each(tmp_path, capsys):
    """``nereus simulate TRACE --jobs 2 --json``, end to end on a file: every policy's row, the
    latency cut against both fixed baselines, and a trace line that is wrong is a diagnostic."""
    import json

    from nereus.cli import main
    from nereus.sim.trace import write_trace

    t = _trace()
    path = tmp_path / "small.jsonl"
    write_trace(Trace(t.name, t.job, t.gpus, t.steps[:10]), path)
    assert main(["simulate", str(path), "--jobs", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["policy"]: r for r in out["policies"]}
    assert list(rows) == ["fixed", "fixed-dp", "verl", "openrlhf", "nereus", "oracle"] and out["steps"] == 10
    assert all(r["completed"] == 10 for r in rows.values())
    assert {"latency_cut_vs_fixed", "latency_cut_vs_fixed-dp"} <= set(rows["nereus"])
    path.write_text(path.read_text() + '{"step": 10, "response_len_dist": [9, 5]}\n')
    assert main(["simulate", str(path), "--jobs", "2"]) == 1
    assert f"{path}:12:" in capsys.readouterr().err


def test_several_traces_share_one_pool_and_each_runs_as_alone(tmp_path, capsys):
    """``nereus simulate A B --jobs 2 --json``: the (trace, policy) runs of both traces in one pool
    of two processes, one JSON document with a document per trace, each trace's runs the same
    steps as that trace simulated alone (the restarting policies and the oracle: deterministic)."""
    import json
    from dataclasses import replace

    from nereus.cli import main
    from nereus.sim.trace import write_trace

    t = _trace()
    paths = [tmp_path / "first.jsonl", tmp_path / "grant.jsonl"]
    write_trace(Trace("first", t.job, t.gpus, t.steps[:6]), paths[0])
    grant = [replace(s, step=i) for i, s in enumerate(t.steps[5:12])]  # 8 GPUs, then 16 from step 3
    write_trace(Trace("grant", t.job, t.gpus, grant), paths[1])
    policies = "fixed,verl,oracle"
    assert main(["simulate", *map(str, paths), "--jobs", "2", "--json", "--policies", policies]) == 0
    both = json.loads(capsys.readouterr().out)
    assert [d["trace"] for d in both["traces"]] == ["first", "grant"] and both["wall_s"] > 0
    for path, doc in zip(paths, both["traces"]):
        assert main(["simulate", str(path), "--jobs", "1", "--json", "--policies", policies]) == 0
        alone = json.loads(capsys.readouterr().out)
        assert doc["steps"] == alone["steps"] and doc["step"] == alone["step"] and doc["moves"] == alone["moves"]
    assert both["traces"][1]["moves"]["fixed"] == [4]  # the grant at step 3: a restart onto 16 GPUs after it
    # each trace under each truth named, in one pool; a truth the simulator lacks is refused
    argv = ["simulate", str(paths[1]), "--jobs", "2", "--json", "--policies", "fixed", "--truth", "event,hidden"]
    assert main(argv) == 0
    two = json.loads(capsys.readouterr().out)["traces"]
    assert [(d["trace"], d["truth"]) for d in two] == [("grant", "event"), ("grant", "hidden")]
    assert two[0]["step"]["fixed"] == both["traces"][1]["step"]["fixed"]
    assert all(a != b for a, b in zip(two[0]["step"]["fixed"], two[1]["step"]["fixed"]))  # its own hidden factors
    with pytest.raises(SystemExit):
        main(["simulate", str(paths[0]), "--truth", "event,exact"])
    assert "unknown truth 'exact'" in capsys.readouterr().err


def test_the_gantt_chart_finds_every_operation_on_its_gpu_in_the_plan_it_names():
    """A load writes plan A's shard (its state offloaded between steps, brought back before it is
    read): its row is on that shard's GPU, though plan B has no such shard (PP 2 x TP 2 -> PP 4
    x TP 1). Seen on length_growth, where Nereus's first move loaded offloaded state back."""
    from pathlib import Path

    from nereus.sim.policies import gantt_rows

    text = (Path(__file__).parents[1] / "golden" / "plan-transition" / "pp2_to_pp4.nir").read_text()
    old = "layout actor.train { tp = 2, pp = 2, dp = 1, layers = [0..1, 2..3], mesh = [0..3] }"
    assert old in text
    text = text.replace(old, old[:-2] + ", offload = [optimizer] }")
    link = next(line for line in text.splitlines() if line.strip().startswith("inter_node"))
    m = nereus.parse(
        text.replace(link, link + "\n  host_link = link(bandwidth = 55GB/s, latency = 10us)\n  host_memory = 2TiB")
    )
    nereus.run_pipeline(m, "plan-transition{to=@b},schedule-transfers")
    (t,) = m.transitions.values()
    loads = [op for op in t.ops if op.kind == "load"]
    assert loads and any((op.dst[0].pp, op.dst[0].tp) == (1, 1) for op in loads)  # a shard plan B lacks
    rows = gantt_rows(m, t)
    scheduled = [op for op in t.ops if op.start is not None and op.duration is not None]
    assert len(rows) == sum(len(op.dst or op.src) for op in scheduled)
    for op in loads:  # host[g] back onto plan A's shard on GPU g
        assert (op.src[0].gpu, op.start, op.duration, "load") in rows


def test_a_policy_that_fails_in_a_worker_ends_the_run_at_once_with_its_diagnostic(tmp_path):
    """Responses no plan fits from step 0: the first worker to fail ends the run with its
    diagnostic, and the command exits while the other policies' work is still queued (it used to
    hang at exit, a queue's feeder thread blocked on a pipe to a terminated worker)."""
    import subprocess
    import sys

    from nereus.sim.trace import write_trace

    # the 1,024-GPU job: its pickled module (150 KB) is more than a pipe holds, as a queued call
    steps = [TraceStep(i, length_shares(400000, 1000000), frozenset()) for i in range(3)]
    path = tmp_path / "too_long.jsonl"
    write_trace(Trace("too_long", "ppo_70b_1024gpu", 1024, steps), path)
    run = subprocess.run(
        [sys.executable, "-m", "nereus", "simulate", str(path), "--jobs", "2", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1
    assert "cannot run on the trace's first step" in run.stderr and "Traceback" not in run.stderr


def test_the_collector_collects_rarely_while_policies_run_and_as_before_after(monkeypatch):
    """``collecting_rarely``: the policies run under ``COLLECT_EVERY``; the caller's thresholds
    are back after the run, and after a run that failed."""
    import gc

    import nereus.sim.simulate as sim_mod

    seen = []
    step = sim_mod._step
    monkeypatch.setattr(sim_mod, "_step", lambda *a: (seen.append(gc.get_threshold()), step(*a))[1])
    before = gc.get_threshold()
    steps = [TraceStep(i, length_shares(1000, 8000), frozenset(range(8, 16)), frozenset()) for i in range(2)]
    simulate(_job(), Trace("two", "ppo_8b_16gpu", 16, steps), policies=["fixed"], progress=False)
    assert seen and set(seen) == {sim_mod.COLLECT_EVERY} and gc.get_threshold() == before
    monkeypatch.setattr(sim_mod, "_step", lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        simulate(_job(), Trace("two", "ppo_8b_16gpu", 16, steps), policies=["fixed"], progress=False)
    assert gc.get_threshold() == before


def test_a_failure_without_notice_is_found_by_failing_for_every_policy():
    """GPUs 8-15 fail at step 3 without notice. No policy knows before that step runs: every one
    that used them pays the failed attempt (a restarting policy too, which used to re-plan
    before the step, seeing the trace's future), and moves after it. A restarting policy's job
    crashed: it also redoes the three steps since its last checkpoint (none saved yet); Nereus
    moves the live state and redoes only the failed step."""
    steps = [
        TraceStep(i, length_shares(1000, 4096), frozenset(range(8, 16)) if i >= 3 else frozenset(), frozenset())
        for i in range(6)
    ]
    result = simulate(_job(), Trace("fail", "ppo_8b_16gpu", 16, steps), ["fixed", "verl", "nereus"], progress=False)
    from nereus.sim.simulate import FAILED_ATTEMPT

    for name in ("fixed", "verl", "nereus"):
        run = result["runs"][name]
        assert run.failures >= 1 and run.lost_s > 0, name
        assert 3 in run.moves, (name, run.moves)
    for name in ("fixed", "verl"):
        run = result["runs"][name]
        assert run.lost_s == pytest.approx(FAILED_ATTEMPT + sum(run.step[:3]) + sum(run.sync[:3]))
    assert result["runs"]["nereus"].lost_s == pytest.approx(FAILED_ATTEMPT)
