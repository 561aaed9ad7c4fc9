"""The five plan-search repros (shared/repros/plan-search, copied to repros/): each recorded a
plan better than plan-search's, or a plan-search objective that ``estimate`` disagreed with. The
searched plan is now never worse than the repro's hand-enumerated plans, and its objective is
``estimate``'s step time of the placed plan."""

from pathlib import Path

import pytest

import nereus

REPROS = Path(__file__).parent / "repros"

# repro -> (the step time plan-search recorded before, in s; the best plan the repro writes by hand, if any)
CASES = {
    "a_microbatches_and_rho.nir": (0.70359, "enum"),  # 16 micro-batches per flush; generation memory stepped
    # PP 3 on 6 GPUs; its @enum (2.086 s) trains DP 3 over mini_batch 16, which Megatron-LM and verl
    # reject and plan-search no longer proposes (see the next test): held to the recorded time only
    "a_pp3.nir": (2.2945, None),
    "c_generation_offload.nir": (None, "gen_offload"),  # "no plan fits" though offloading generation's weights fits
    "d_2x6.nir": (0.055753, None),  # a pipeline pair across the node boundary at GPU 6, costed as NVLink
    "d_failed_gpus.nir": (0.34863, None),  # TP 2 x DP 2 on GPUs [1, 3, 4, 5], DP costed inside a node
}


def searched(name: str):
    m = nereus.parse((REPROS / name).read_text(), name)
    for p in m.plans.values():  # the hand plans get estimate's step time (those that fit)
        try:
            nereus.run_pipeline(m, f"estimate{{plan=@{p.name}}}")
        except nereus.DiagnosticError:
            pass
    # headroom=0: the hand plans fill these toy 1 GiB GPUs, and the claim is optimality in estimate's model
    nereus.run_pipeline(m, "plan-search{headroom=0}")
    return m, m.plans["w_searched"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_searched_plan_beats_the_repro_and_its_objective_is_the_estimate(name):
    before, hand = CASES[name]
    m, plan = searched(name)
    rec = plan.search
    assert rec.status == "optimal"
    assert rec.estimate == plan.step_time
    assert abs(rec.estimate_gap) < 1e-4, rec  # the solver's objective is estimate's step time (integer units)
    if before is not None:
        assert plan.step_time <= before
    if hand is not None:
        assert m.plans[hand].step_time is not None
        assert plan.step_time <= m.plans[hand].step_time * (1 + 1e-4)
    nereus.verify(m)


def test_the_faster_hand_plan_of_a_pp3_does_not_split_its_steps_evenly():
    from nereus.ir.verifier import batch_warnings

    m = nereus.parse((REPROS / "a_pp3.nir").read_text(), "a_pp3.nir")
    (d,) = batch_warnings(nereus.verify(m))
    assert "actor.train: micro_batch x dp = 1 x 3 = 3 does not divide mini_batch = 16" in d.message


def test_failed_gpus_cost_the_cross_node_group_the_old_objective_missed():
    """d_failed_gpus: the old plan (TP 2 x DP 2 on [1, 3, 4, 5]) was costed 0.27653 s by the
    solver and 0.34863 s by estimate. Now the solver's 0.2739 s is estimate's, and no DP group of
    the trained model crosses a node boundary."""
    m, plan = searched("d_failed_gpus.nir")
    c = m.clusters[plan.cluster]
    lay = plan.layouts["actor.train"]
    groups = [[lay.gpu(d, p, t) for d in range(lay.dp)] for p in range(lay.pp) for t in range(lay.tp)]
    assert all(len({c.node_of(g) for g in grp}) == 1 for grp in groups)
    assert plan.step_time < 0.280


def test_generation_offload_makes_the_job_fit():
    m, plan = searched("c_generation_offload.nir")
    assert any("weights" in lay.offload for lay in plan.layouts.values())


def test_no_fit_together_says_each_fits_alone_with_what_each_needs():
    """repro (c) without offload: every model-stage fits on the GPUs alone, no combination does.
    The diagnostic says so and lists what each needs, each figure within the GPU's memory."""
    import re

    m = nereus.parse((REPROS / "c_generation_offload.nir").read_text(), "c.nir")
    with pytest.raises(nereus.DiagnosticError) as e:
        nereus.run_pipeline(m, "plan-search{offload=false,headroom=0}")
    (d,) = e.value.diagnostics
    assert d.message.startswith(
        "no plan fits: each model-stage fits on its own, but no placement of them together "
        "fits in 1GiB per GPU on 4 GPUs"
    )
    needs = re.findall(r"(actor\.\w+) at least ([\d.]+) GiB while it runs, ([\d.]+) GiB kept", d.message)
    assert {ms for ms, _, _ in needs} == {"actor.infer", "actor.train"}
    assert all(float(run) <= 1.0 and float(kept) <= float(run) for _, run, kept in needs)
    assert "actor.generate also needs room for the KV cache" in d.message
