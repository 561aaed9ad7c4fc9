"""calibrate's memory slack: measured peaks against the bytes the cost model counts.

A job's peaks include what the model does not count (the caching allocator's fragmentation, the
CUDA context, the libraries' workspaces). ``calibrate`` fits ``memory_slack`` to them, and
``estimate`` and ``plan-search`` then weigh training and inference at it."""

import pytest

import nereus
from nereus.passes.cost.calibrate import calibrate_records
from nereus.passes.cost.layout_costs import layout_costs

from ..support import EXAMPLES

PPO = next(p for p in EXAMPLES if p.name == "ppo_8b_16gpu.nir")


@pytest.fixture()
def job():
    m = nereus.parse(PPO.read_text())
    nereus.run_pipeline(m, "estimate")
    return m


def peaks(m, factor_of):
    """Records of one step of ``ppo_p0`` whose peaks are ``factor_of(model_stage)`` times the
    count, plus what the other model-stages keep on the fullest GPU (None: no peak)."""
    plan = m.plans["ppo_p0"]
    out = []
    for ms, lc in layout_costs(m, plan).items():
        f = factor_of(ms)
        peak = None if f is None else int(f * lc.cost.counted()[0] + max(lc.others.values(), default=0.0))
        out.append(("ppo_p0", ms, plan.layouts[ms].time, peak, 1))
    return out


def test_the_slack_is_the_largest_peak_over_the_count_and_estimate_charges_it(job):
    plan = job.plans["ppo_p0"]
    before = {ms: lay.memory for ms, lay in plan.layouts.items()}
    factors = {"actor.train": 1.2, "critic.train": 1.1}
    calibrate_records(job, peaks(job, lambda ms: factors.get(ms, 1.05)))
    eff = job.clusters[plan.cluster].efficiency
    assert eff.memory_slack == pytest.approx(1.2, abs=1e-4)
    nereus.run_pipeline(job, "estimate")
    for ms, lay in plan.layouts.items():
        if job.workloads[plan.workload].stage_of(ms).kind == "generate":
            assert lay.memory == before[ms] and not lay.memory_breakdown.slack  # the engine fills its share by design
        else:
            counted = before[ms] - lay.memory_breakdown.resident
            assert lay.memory_breakdown.slack == pytest.approx(0.2 * counted, abs=2**21)
            assert lay.memory == pytest.approx(before[ms] + 0.2 * counted, abs=2**21)
    assert "memory_slack = 1.2" in nereus.print_ir(job)


def test_generation_peaks_do_not_set_the_slack(job):
    kinds = {ms: job.workloads["ppo"].stage_of(ms).kind for ms in job.plans["ppo_p0"].layouts}
    calibrate_records(job, peaks(job, lambda ms: 1.5 if kinds[ms] == "generate" else 1.02))
    assert job.clusters["h100x16"].efficiency.memory_slack == pytest.approx(1.02, abs=1e-4)


def test_peaks_under_the_count_keep_the_slack_at_one_and_no_peaks_keep_the_prior(job):
    calibrate_records(job, peaks(job, lambda ms: 0.8))
    assert job.clusters["h100x16"].efficiency.memory_slack == 1.0
    calibrate_records(job, peaks(job, lambda ms: 1.3))
    calibrate_records(job, peaks(job, lambda ms: None))  # times only: the slack stays what peaks set
    assert job.clusters["h100x16"].efficiency.memory_slack == pytest.approx(1.3, abs=1e-4)


def test_plan_search_weighs_memory_at_the_slack(job):
    """On 40 GiB GPUs ``ppo_p0`` fits by the count (36 GiB at most) and not at a slack of 1.3:
    every layout plan-search picks then fits at the slack."""
    cluster = job.clusters["h100x16"]
    cluster.gpu_memory = 40 * 2**30
    nereus.run_pipeline(job, "estimate")  # no out-of-memory: it would raise
    calibrate_records(job, peaks(job, lambda ms: 1.3))
    nereus.run_pipeline(job, "estimate{oom=warn}")
    unfit = {w.message.split()[0]: w.hint for w in job.warnings if "needs" in w.message}
    assert set(unfit) == {"actor.train", "critic.train"} and all("slack" in h for h in unfit.values()), unfit
    job.warnings.clear()
    nereus.run_pipeline(job, "plan-search{into=@slacked,time_limit=5},estimate{plan=@slacked}")
    b = job.plans["slacked"]
    kinds = {ms: job.workloads[b.workload].stage_of(ms).kind for ms in b.layouts}
    for ms, lay in b.layouts.items():
        assert lay.memory <= cluster.gpu_memory, ms
        if kinds[ms] != "generate":
            assert lay.memory_breakdown.slack > 0
