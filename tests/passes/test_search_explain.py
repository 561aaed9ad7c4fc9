"""plan-search's memory headroom, offload only where the host can take it, and ``explain``:
runner-ups equal brute force, the reasons name what the plan uses."""

import subprocess
import sys

import pytest
from hypothesis import HealthCheck, assume, given, settings

import nereus
from nereus.passes.cost.estimate import estimate_plan
from nereus.passes.search.explain import explain, without
from nereus.passes.search.plan_search import solve, to_plan
from nereus.passes.search.space import build_problem

from ..support import example
from ..support.brute_force import brute_force
from .test_plan_search import _module, small_instances

GIB = 2**30

JOB = """\
cluster @c {
  nodes = 4
  gpus_per_node = 8
  gpu_memory = 80GiB
  peak_flops = 989TFLOPs
  hbm_bandwidth = 3.35TB/s
  intra_node = link(bandwidth = 450GB/s, latency = 2us)
  inter_node = link(bandwidth = 400Gb/s, latency = 5us)
}
model @actor { layers = 48, hidden = 5120, heads = 40, kv_heads = 8, ffn = 13824, vocab = 152064, trained = true }
model @ref { layers = 48, hidden = 5120, heads = 40, kv_heads = 8, ffn = 13824, vocab = 152064 }
workload @grpo {
  algorithm = grpo
  roles = [@actor, @ref]
  global_batch = 256
  group_size = 8
  prompt_len_mean = 512
  prompt_len_max = 1024
  response_len_mean = 2048
  response_len_max = 8192
  mini_batch = 512
  micro_batch = 2
  steps = 300
  stage generate { kind = generate, models = [@actor] }
  stage infer { kind = infer, models = [@actor, @ref] }
  stage train { kind = train, models = [@actor] }
}
"""


# the job with responses up to 4,608 tokens: memory-bound enough that a search without headroom
# fills training past the controller's 5% memory trigger (at 8k the fastest plans keep more free)
TIGHT = JOB.replace("response_len_max = 8192", "response_len_max = 4608")
# responses up to 4.25k: without headroom the search fills a training GPU past the controller's
# 5% memory trigger (98.9% since NCCL's per-NIC rings moved it; TIGHT's 4.5k now stops at 93.5%)
FULL = JOB.replace("response_len_max = 8192", "response_len_max = 4352")


def _searched(text: str, pipeline: str):
    m = nereus.verify(nereus.parse(text, "job.nir"))
    nereus.run_pipeline(m, pipeline)
    return m, m.plans["grpo_searched"]


def test_headroom_keeps_training_and_inference_under_the_default_share():
    """The user's job of the report (there, with no headroom the search filled 99.9% of a GPU).
    With responses up to 4.5k, training sized for its longest micro-batch: with no headroom the
    search takes more than 90% of a GPU; by default training and inference keep 10% free, and the
    record says so."""
    c = 80 * GIB
    _, tight = _searched(TIGHT, "plan-search{headroom=0}")
    _, kept = _searched(TIGHT, "plan-search")
    assert max(lay.memory for lay in tight.layouts.values()) > 0.9 * c  # what the headroom prevents
    for lay in kept.layouts.values():
        if lay.stage != "generate":  # generation keeps vLLM's own 10%
            assert lay.memory <= 0.9 * c
    assert kept.search.headroom == 0.1 and kept.step_time >= tight.step_time


def test_headroom_out_of_range_is_a_diagnostic():
    with pytest.raises(nereus.DiagnosticError, match=r"headroom is a fraction of GPU memory in \[0, 0.5\), got 0.7"):
        _searched(JOB, "plan-search{headroom=0.7}")


def test_offload_is_not_searched_without_a_host_and_says_why():
    m, plan = _searched(JOB, "plan-search{explain=true}")
    assert not any(lay.offload for lay in plan.layouts.values())
    assert any("offload: not searched: cluster @c declares no host_link and host_memory" in x for x in m.explanations)


def test_offload_without_host_link_is_refused_at_its_line():
    text = (
        JOB
        + """plan @p {
  workload = @grpo
  cluster = @c
  layout actor.generate { tp = 4, pp = 1, dp = 8, layers = [0..47], mesh = [0..31] }
  layout actor.infer { tp = 8, pp = 1, dp = 4, layers = [0..47], mesh = [0..31] }
  layout ref.infer { tp = 8, pp = 1, dp = 4, layers = [0..47], mesh = [0..31] }
  colocate = [[actor.infer, ref.infer]]
  layout actor.train {
    tp = 8, pp = 2, dp = 2, layers = [0..23, 24..47], mesh = [0..31]
    offload = [optimizer]
  }
}
"""
    )
    with pytest.raises(nereus.DiagnosticError) as e:
        nereus.verify(nereus.parse(text, "job.nir"))
    d = e.value.diagnostics[0]
    line = text.splitlines().index("    offload = [optimizer]") + 1
    assert d.loc.line == line
    assert "offload moves state to host memory, but cluster @c declares no host_link and host_memory" in d.message


def test_offload_beyond_host_memory_is_an_estimate_diagnostic():
    text = example("grpo_7b_8gpu.nir").read_text().replace("host_memory = 2TiB", "host_memory = 8GiB")
    m = nereus.verify(nereus.parse(text, "grpo.nir"))
    plan = next(iter(m.plans.values()))
    lay = plan.layouts["actor.train"]
    lay.offload = ["optimizer"]
    problems = estimate_plan(m, plan)
    assert any("to the host memory of node 0, which has 8.00 GiB" in d.message for d in problems)
    # with the datasheet's 2 TiB it fits
    m2 = nereus.verify(nereus.parse(example("grpo_7b_8gpu.nir").read_text(), "grpo.nir"))
    p2 = next(iter(m2.plans.values()))
    p2.layouts["actor.train"].offload = ["optimizer"]
    assert not any("host memory" in d.message for d in estimate_plan(m2, p2))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(small_instances())
def test_runner_ups_equal_brute_force(inst):
    """Each runner-up's step time is the brute-force optimum over the plans whose layout of that
    model-stage has other TP/PP/DP sizes."""
    cluster, w, models = inst
    problem = build_problem(cluster, w, models, max_tp=2, max_pp=2, max_zero=2, offload=False)
    try:
        exact, _, _, _ = brute_force(problem, limit=100_000)
    except ValueError:
        assume(False)
    assume(exact is not None)
    sol = solve(problem, time_limit=30)
    m = _module(cluster, w, models)
    plan = to_plan(problem, sol, "p", w.name, cluster.name)
    m.plans["p"] = plan
    assert estimate_plan(m, plan) == []
    why = explain(
        m, plan, problem, sol.choice, sol.objective * problem.unit_s, lambda p, t: solve(p, 30), time_limit=120
    )
    for ms, c in sol.choice.items():
        o = problem.spaces[ms].options[c]
        sizes = (o.tp, o.pp, o.dp)
        other = without(problem, lambda n, x: n != ms or (x.tp, x.pp, x.dp) != sizes)
        best = brute_force(other, limit=100_000)[0]
        r = why.runner_ups[ms]
        if best is None:
            assert r is None
        else:
            assert round(best * problem.unit_s, 6) == r.step_time and (r.tp, r.pp, r.dp) != sizes
    assert why.bottleneck in plan.layouts and why.shares[why.bottleneck] == max(why.shares.values())


def test_explain_is_recorded_in_the_ir_and_printed_by_opt(tmp_path):
    src = tmp_path / "job.nir"
    src.write_text(JOB)
    out = tmp_path / "searched.nir"
    r = subprocess.run(
        [sys.executable, "-m", "nereus", "opt", str(src), "-p", "plan-search", "--explain", "-o", str(out)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "bottleneck" in r.stderr and "runner-up TP" in r.stderr and "headroom kept free" in r.stderr
    m = nereus.verify(nereus.parse(out.read_text(), str(out)))  # the record round-trips
    plan = m.plans["grpo_searched"]
    assert plan.search.bottleneck in plan.layouts
    assert all(lay.runner_up is not None for lay in plan.layouts.values())
    assert nereus.print_ir(m) == out.read_text()


@pytest.mark.parametrize("headroom, fires", [(0, True), (0.1, False)])
def test_the_controllers_memory_trigger_agrees_with_the_search(headroom, fires):
    """Issue 17's mismatch: plan-search filled training memory past the controller's 5% trigger,
    so the core re-planned its own plans. With the default headroom a searched plan, measured as
    predicted, trips no memory trigger."""
    from nereus.control.measurements import StepRecord
    from nereus.control.options import ControlOptions
    from nereus.control.triggers import measured_triggers

    m, plan = _searched(FULL, f"plan-search{{headroom={headroom}}}")
    fullest = max(lay.memory for lay in plan.layouts.values() if lay.stage != "generate")
    assert (fullest > 0.95 * m.clusters[plan.cluster].gpu_memory) is fires  # the case each stands for
    record = StepRecord(
        step=0,
        seconds={ms: lay.time for ms, lay in plan.layouts.items()},
        memory={ms: lay.memory for ms, lay in plan.layouts.items()},
    )
    memory = [t for t in measured_triggers(m, plan, [record], 0.0, ControlOptions()) if t.kind == "memory"]
    assert bool(memory) is fires


@pytest.mark.parametrize("repro", ["a_pp3.nir", "d_2x6.nir"])
def test_searched_training_layouts_split_an_optimizer_step_evenly(repro):
    """Megatron-LM and verl reject micro_batch x dp not dividing mini_batch; plan-search proposed
    DP 3 and 6 on these six-GPU repros. Now it offers training only DP degrees that split a step."""
    from pathlib import Path

    from nereus.ir.verifier import batch_warnings

    m = nereus.parse((Path(__file__).parent / "repros" / repro).read_text(), repro)
    nereus.run_pipeline(m, "plan-search{headroom=0}")
    searched = [p for p in m.plans if p.endswith("_searched")]
    w = next(iter(m.workloads.values()))
    for name in searched:
        for lay in m.plans[name].layouts.values():
            if lay.stage == "train":
                assert (w.mini_batch or w.samples) % (w.micro_batch * lay.dp) == 0, (name, lay.dp)
    for name in [p for p in m.plans if p not in searched]:  # the repro's own plans may warn (a_pp3's DP 3 does)
        del m.plans[name]
    assert batch_warnings(m) == []
