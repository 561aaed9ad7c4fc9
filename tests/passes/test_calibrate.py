"""calibrate: coefficients recovered from a synthetic profile made with hidden coefficients."""

import json

import pytest

import nereus
from nereus.ir.cluster import Efficiency
from nereus.passes.cost.calibrate import fit, observations, read_profile, synthetic_profile
from nereus.testing.jobs import _layout_line as _layout
from nereus.testing.jobs import ppo_8b_16gpu

COEFFS_FITTED = ("compute", "hbm", "nvlink", "nic", "pcie", "overhead")
HIDDEN = Efficiency(compute=0.41, hbm=0.62, nvlink=0.83, nic=0.52, pcie=0.64, overhead=37e-6, overlap=0.7)

# Layout variants of the 8B PPO job on 2 x 8 GPUs, chosen so that every coefficient is exercised:
# DP and PP across nodes (NIC), offload (PCIe), TP inside nodes (NVLink), decode (HBM). A DP group
# with several members a node crosses over all their NICs at once (NCCL's channel per NIC), which
# leaves little NIC time; ``v_dp_nic``'s groups have one member a node (TP 8 fills it), waited on.
VARIANTS = {
    "v_dp_nic": dict(
        gen=(8, 1, 2), infer=(4, 1, 1), train=(8, 1, 2, ", zero = 1, dp_overlap = false"), colocate=True, offload=False
    ),
    "v_dp16": dict(
        gen=(1, 1, 16), infer=(2, 1, 2), train=(1, 1, 16, ", zero = 2, recompute = true"), colocate=True, offload=True
    ),
    "v_pp_nic": dict(gen=(4, 1, 4), infer=(4, 1, 1), train=(8, 2, 1, ""), colocate=True, offload=False),
    "v_tp8": dict(
        gen=(8, 1, 2), infer=(1, 1, 4), train=(2, 1, 8, ", zero = 1, recompute = true"), colocate=True, offload=True
    ),
    "v_mixed": dict(
        gen=(2, 2, 4), infer=(2, 2, 1), train=(4, 4, 1, ", recompute = true"), colocate=True, offload=False
    ),
}


def plan_text(name, v):
    t, p, d = v["gen"]
    infer = "".join(
        _layout(f"{r}.infer", *v["infer"], 32, f"{4 * i}..{4 * i + 3}", ", offload = [weights]" if v["offload"] else "")
        for i, r in enumerate(["actor", "critic", "ref", "reward"])
    )
    tt, tpp, td, extra = v["train"]
    train = "".join(
        _layout(f"{r}.train", tt, tpp, td, 32, "0..15", f", micro_batches = 8{extra}") for r in ("actor", "critic")
    )
    return (
        f"plan @{name} {{\n  workload = @ppo\n  cluster = @h100x16\n  colocate = [[actor.train, critic.train]]\n"
        + _layout("actor.generate", t, p, d, 32, "0..15")
        + infer
        + train
        + "}\n"
    )


@pytest.fixture(scope="module")
def module():
    text = ppo_8b_16gpu() + "\n" + "\n".join(plan_text(n, v) for n, v in VARIANTS.items())
    m = nereus.verify(nereus.parse(text))
    m.emus.clear()
    return m


def test_fit_recovers_hidden_coefficients_within_2_percent(module):
    # 1% measurement noise over 100 steps of each plan, as a job would log them. Offload is a
    # few percent of a model-stage's time, so PCIe needs that many samples to be pinned to 2%.
    records = synthetic_profile(module, HIDDEN, noise=0.01, seed=1, steps=100)
    obs = observations(module, [(r["plan"], r["model_stage"], r["seconds"], None, 0) for r in records])
    result = fit(obs, Efficiency())
    assert set(result.used) == {"compute", "hbm", "nvlink", "nic", "pcie", "overhead", "overlap"}
    for field in ("compute", "hbm", "nvlink", "nic", "pcie", "overhead"):
        assert getattr(result.efficiency, field) == pytest.approx(getattr(HIDDEN, field), rel=0.02), field
    assert result.efficiency.overlap == pytest.approx(HIDDEN.overlap)  # on the 0.05 grid the fit tries
    assert result.error_before >= 5 * result.error_after
    assert result.error_after < 0.01


def test_measurements_sharing_a_cost_fit_as_measurements_with_costs_of_their_own(module, monkeypatch):
    """``observations`` gives the steps of one plan one cost per model-stage and the fit reads
    each cost once per round: the same fit, to the bit, as on copies of the costs, one per
    measurement, and as reading every measurement's cost for itself."""
    import copy

    from nereus.passes.cost import calibrate
    from nereus.passes.cost.calibrate import Observation

    records = synthetic_profile(module, HIDDEN, noise=0.01, seed=2, steps=5)
    obs = observations(module, [(r["plan"], r["model_stage"], r["seconds"], None, 0) for r in records])
    assert len({id(o.cost) for o in obs}) < len(obs) / 4
    alone = [Observation(o.plan, o.model_stage, o.seconds, copy.deepcopy(o.cost)) for o in obs]

    def summary(r):
        return r.efficiency, r.error_before, r.error_after, r.used, r.iterations

    shared, own = summary(fit(obs, Efficiency())), summary(fit(alone, Efficiency()))

    def every_measurement(measured, f):  # each measurement's cost read for itself
        values = [(id(o.cost), f(o.cost)) for o in measured]
        out = dict(values)
        assert all(repr(v) == repr(out[k]) for k, v in values)  # a cost reads the same for every measurement of it
        return out

    monkeypatch.setattr(calibrate, "_per_cost", every_measurement)
    assert shared == own == summary(fit(obs, Efficiency()))


def test_calibrate_pass_writes_efficiency_and_report(module, tmp_path):
    profile = tmp_path / "profile.jsonl"
    records = synthetic_profile(module, HIDDEN, noise=0.0)
    # one record per step with every model-stage of the plan, as a running job would log
    by_plan = {}
    for r in records:
        by_plan.setdefault(r["plan"], {})[r["model_stage"]] = {"seconds": r["seconds"]}
    profile.write_text(
        "\n".join(json.dumps({"plan": p, "step": i, "stages": st}) for i, (p, st) in enumerate(by_plan.items()))
    )
    m = nereus.parse(nereus.print_ir(module))
    nereus.run_pipeline(m, f"calibrate{{profile={profile}}},estimate")
    c = m.clusters["h100x16"]
    assert c.calibration.records == len(records)
    assert c.calibration.error_before > 0.05 and c.calibration.error_after < 1e-3
    assert c.efficiency.compute == pytest.approx(HIDDEN.compute, rel=1e-3)
    text = nereus.print_ir(m)
    assert "efficiency = efficiency(compute = 0.41" in text and "calibration = calibration(records = " in text
    assert nereus.parse(text) == m
    # estimate now uses the fitted coefficients: predictions match the hidden truth
    truth = {(r["plan"], r["model_stage"]): r["seconds"] for r in records}
    for (plan, ms), seconds in truth.items():
        assert m.plans[plan].layouts[ms].time == pytest.approx(seconds, rel=1e-3)


def test_bad_profiles_are_diagnostics(module, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"plan": "ppo_p0", "model_stage": "actor.train"}\nnot json\n{"plan": "nope", "model_stage": "x", "seconds": '
        "1}\n"
    )
    with pytest.raises(nereus.DiagnosticError) as e:
        read_profile(bad)
    assert [d.loc.line for d in e.value.diagnostics] == [1, 2]
    with pytest.raises(nereus.DiagnosticError, match="profile names plan @nope"):
        observations(module, [("nope", "x", 1.0, None, 3)])
    m = nereus.parse(nereus.print_ir(module))
    with pytest.raises(nereus.DiagnosticError, match="calibrate needs profile=FILE"):
        nereus.run_pipeline(m, "calibrate")


@pytest.mark.parametrize("model_error", [0.0005, 0.2])
def test_the_pull_toward_the_prior_is_the_least_squares_of_a_gaussian_prior(model_error):
    """Where no bound binds, the bounded solve is the closed-form least squares of the
    measurements' relative errors plus each coefficient's relative deviation from its prior
    weighed by ``model_error`` over the prior's stated relative uncertainty."""
    import numpy as np
    from scipy.optimize import lsq_linear

    from nereus.ir.cluster import PRIOR_UNCERTAINTY
    from nereus.passes.cost.calibrate import _bounded_fit, prior_weights
    from nereus.passes.cost.cost_model import COEFFS, coefficient_vector

    prior = Efficiency()
    p = coefficient_vector(prior)
    w = prior_weights(prior, model_error)
    assert w == pytest.approx([model_error * getattr(prior, c) / PRIOR_UNCERTAINTY[c] for c in COEFFS])
    rng = np.random.default_rng(3)
    A = rng.uniform(0.1, 1.0, (12, 6)) / p  # each coefficient's share of a time near 1
    truth = p * rng.uniform(1.05, 1.4, 6)
    b = A @ truth * (1 + rng.normal(0, 0.05, 12))
    closed = np.linalg.lstsq(np.vstack([A, np.diag(w / p)]), np.concatenate([b, w]), rcond=None)[0]
    assert np.all(closed[:5] > 1) and closed[5] > 0  # inside the bounds
    scale = np.linalg.norm(A, axis=0)
    got = _bounded_fit(A / scale, b, np.arange(6), scale, p, w, lsq_linear)
    assert got == pytest.approx(closed, rel=1e-6)


def test_a_larger_model_error_keeps_the_fit_nearer_its_prior(module, tmp_path):
    """The same measurements fitted with the default pull (a job's own steps) and with
    ``model_error`` 0.2 (figures from another stack): the second stays nearer the prior, its coefficients'
    deviations counted in stated uncertainties (a ridge's shrinkage: one coefficient may move
    further while the others hold it less), and the calibrate pass takes the option."""
    from nereus.ir.cluster import PRIOR_UNCERTAINTY

    records = synthetic_profile(module, HIDDEN, noise=0.01, seed=1, steps=3)
    obs = observations(module, [(r["plan"], r["model_stage"], r["seconds"], None, 0) for r in records])
    prior = Efficiency()

    def away(eff):
        return sum(((getattr(eff, c) - getattr(prior, c)) / PRIOR_UNCERTAINTY[c]) ** 2 for c in COEFFS_FITTED)

    near, loose = fit(obs, prior, model_error=0.2).efficiency, fit(obs, prior).efficiency
    assert away(near) < 0.5 * away(loose)
    profile = tmp_path / "profile.jsonl"
    profile.write_text("\n".join(json.dumps(r) for r in records))
    m = nereus.parse(nereus.print_ir(module))
    nereus.run_pipeline(m, f"calibrate{{profile={profile},model_error=0.2}}")
    assert m.clusters["h100x16"].efficiency.compute == pytest.approx(near.compute, rel=1e-3)


def test_fit_knee_recovers_a_hidden_gemm_knee_from_layouts_of_several_shapes(module, tmp_path):
    """The four variants train and infer at TP 1 to 8: their GEMMs differ in shape, so
    ``calibrate{fit_knee=true}`` finds the knee the records were made with (on its grid) and
    the compute level beside it; without ``fit_knee`` the knee stays the prior's and the fit
    is worse."""
    from dataclasses import replace

    from nereus.passes.cost.calibrate import KNEE_GRID

    hidden = replace(HIDDEN, gemm_knee=2.5)
    assert hidden.gemm_knee in KNEE_GRID
    records = synthetic_profile(module, hidden, noise=0.0)
    obs = observations(module, [(r["plan"], r["model_stage"], r["seconds"], None, 0) for r in records])
    kneed = fit(obs, Efficiency(), knees=KNEE_GRID)
    assert "gemm_knee" in kneed.used and kneed.efficiency.gemm_knee == 2.5
    assert kneed.efficiency.compute == pytest.approx(HIDDEN.compute, rel=1e-3)
    assert kneed.error_after < 1e-4
    flat = fit(obs, Efficiency())
    assert flat.efficiency.gemm_knee == 0.0 and flat.error_after > 10 * kneed.error_after
    # the pass, from a profile file
    profile = tmp_path / "profile.jsonl"
    profile.write_text("\n".join(json.dumps(r) for r in records))
    m = nereus.parse(nereus.print_ir(module))
    nereus.run_pipeline(m, f"calibrate{{profile={profile}, fit_knee=true}}")
    assert m.clusters["h100x16"].efficiency.gemm_knee == 2.5
    assert "gemm_knee = 2.5" in nereus.print_ir(m)
