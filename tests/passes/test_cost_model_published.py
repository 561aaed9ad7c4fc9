"""The cost model against figures that others published (measured on their hardware, not here).

Time figures: ``validation/*.nir`` (34 figures from 6 sources, each configuration written as IR,
each figure with its source), through ``nereus bench validate``. They are evidence only where
the model predicts them better than constant-efficiency predictors, which know a
configuration's FLOPs and nothing else (``test_validation_set_*``). Two priors were set with
this set in view (compute 0.6, overlap 0.9), so the errors with the priors are in-sample; the
hold-out errors (leave one source out, calibration transfer: ``nereus.bench.holdout``) are
recorded in ``validation/holdout.json`` and recomputed here (``test_holdout_*``). Memory and KV-cache figures
below are accounting identities (no efficiency enters them). Generation figures:
``validation/generation/*.nir`` (56 decode and serving figures from 4 sources, 6 of them of a
mixture of experts), predicted by the cost model and by the simulator's event truth
(``test_generation_*``). Checks of the model against itself are in
``test_cost_model_self_consistency.py``.
"""

from dataclasses import replace

import numpy as np
import pytest

from nereus.bench.validate_bench import (
    CONSTANT_EFFICIENCY,
    VALIDATION,
    cases,
    errors,
    generation_cases,
    generation_errors,
)
from nereus.ir import Model
from nereus.passes import Candidates, CostModel

from ..support.gpt import A100, gpt, train_workload


@pytest.fixture(scope="module")
def validation():
    rows = cases()
    return rows, errors(rows)


@pytest.fixture(scope="module")
def held():
    from nereus.bench.holdout import figures, holdout

    figs = figures(VALIDATION)
    return figs, holdout(figs)


def test_validation_set_is_at_least_15_figures_from_6_sources_and_every_run_fits(validation):
    rows, _ = validation
    assert len(rows) >= 15 and len({c.source for c in rows}) >= 6
    # every published configuration really ran: estimate must not call it out of memory
    assert [c.plan for c in rows if not c.fits] == []


def test_validation_set_the_model_beats_constant_efficiency(validation):
    """The model (prior coefficients; compute and overlap were set with this set in view) against
    every GPU at the model's prior compute efficiency, and at the efficiency that best fits the
    set in hindsight. Printed per figure (``pytest -s``); the targets: median at most 10%, worst
    25% (in sample: the hold-out errors are ``test_holdout_*``'s)."""
    rows, err = validation
    for c, e, k in zip(rows, err["model"], err["constant"]):
        print(
            f"{c.source:18} {c.plan:14} published {c.published_s:9.3f} s  model {c.model_s:9.3f} s ({e:6.1%})  "
            f"constant {CONSTANT_EFFICIENCY} {c.constant_s(CONSTANT_EFFICIENCY):9.3f} s ({k:6.1%})"
        )
    for other in ("constant", "best_constant"):
        assert np.median(err["model"]) < np.median(err[other])
        assert np.mean(err["model"]) < np.mean(err[other])
        assert np.max(err["model"]) < np.max(err[other])
    assert np.median(err["model"]) <= 0.10 and np.max(err["model"]) <= 0.25


def test_holdout_errors_are_restated_whenever_a_prior_moves_past_its_uncertainty(validation, held):
    """``validation/holdout.json`` states each prior with its uncertainty and the hold-out errors
    measured with them. A prior moved by more than its uncertainty fails here until the record is
    restated, and the restated numbers must be what ``nereus bench validate`` measures: the
    errors with the priors, in sample, leaving each source out, and after calibrating on one
    figure of the held-out source (to 0.1 percentage point)."""
    import json
    from dataclasses import asdict

    from nereus.bench.holdout import MODEL_ERRORS, NEUTRAL, summaries
    from nereus.ir.cluster import PRIOR_UNCERTAINTY, Efficiency

    record = json.loads((VALIDATION / "holdout.json").read_text())
    for name, value in asdict(Efficiency()).items():
        stated = record["priors"][name]
        assert abs(value - stated["value"]) <= stated["uncertainty"], (
            f"prior {name} moved from {stated['value']} to {value}: restate validation/holdout.json"
        )
        # the fits weigh each prior by the uncertainty stated here
        assert PRIOR_UNCERTAINTY[name] == stated["uncertainty"], name
    assert record["fits_start_from"] == asdict(NEUTRAL)
    rows, err = validation
    _, h = held
    measured = {
        "with_priors": {"median": float(np.median(err["model"])), "worst": float(np.max(err["model"]))},
        **summaries(h),
    }
    for k, got in measured.items():
        for stat in ("median", "worst"):
            assert got[stat] == pytest.approx(record[k][stat], abs=1e-3), (k, stat)
    chosen = record["model_error"]
    assert chosen["candidates"] == list(MODEL_ERRORS)
    assert (chosen["in_sample"], chosen["without"]) == (h["model_error"], h["model_errors"])


def test_the_hold_out_with_gemms_by_shape_is_restated_as_measured(held):
    """``validation/holdout.json``'s ``gemm_shape``: the same hold-out with every fit starting
    from the GEMM knee of H100's published cuBLAS curve (``SHAPED``), held. It moves the errors
    both ways (leaving a source out: median down, worst up), which is why the prior stays 0."""
    import json

    from nereus.bench.holdout import NEUTRAL, SHAPED, holdout, summaries
    from nereus.ir.cluster import GEMM_KNEE_H100

    record = json.loads((VALIDATION / "holdout.json").read_text())["gemm_shape"]
    assert SHAPED == replace(NEUTRAL, gemm_knee=GEMM_KNEE_H100) and record["gemm_knee"] == GEMM_KNEE_H100
    figs, _ = held
    h = holdout(figs, SHAPED)
    for k, got in summaries(h).items():
        for stat in ("median", "worst"):
            assert got[stat] == pytest.approx(record[k][stat], abs=1e-3), (k, stat)


def test_leaving_a_source_out_chooses_and_fits_without_looking_at_it(held):
    """The held-out source's published seconds can be anything: its fold's ``model_error`` and
    fit are the same, to the bit, and only its own predictions' errors change. Run on torchtitan
    with its figures tripled, as far from the model as the worst fold once was."""
    from dataclasses import replace

    from nereus.bench.holdout import holdout

    figs, h = held
    moved = [replace(f, published_s=3 * f.published_s) if f.source == "torchtitan_2024" else f for f in figs]
    h2 = holdout(moved)
    assert h2["model_errors"]["torchtitan_2024"] == h["model_errors"]["torchtitan_2024"]
    assert h2["loso_fits"]["torchtitan_2024"] == h["loso_fits"]["torchtitan_2024"]
    for i, f in enumerate(figs):
        if f.source == "torchtitan_2024":
            assert 1 + h2["loso"][i] == pytest.approx((1 + h["loso"][i]) / 3, rel=1e-9)
    # the folds that fit torchtitan do see it: tripling its figures moves at least one of them
    assert any(h2["loso_fits"][s] != h["loso_fits"][s] for s in h["loso_fits"] if s != "torchtitan_2024")


def test_holdout_meets_the_leave_one_source_out_targets_and_beats_the_constant_left_out_alike(validation, held):
    """Issue 46's targets on figures no fit saw: leaving each source out, median |error| at most
    10% and worst at most 25%; and better than the best constant compute fraction chosen the same
    way, on the other five sources. (Calibration transfer's median target, 5%, is not met: 5.7%.)"""
    from nereus.bench.holdout import constant_holdout, summary

    figs, h = held
    rows = {(c.source, c.plan): c for c in validation[0]}
    constant = summary(
        constant_holdout(
            [f.source for f in figs],
            np.array([rows[f.source, f.plan].ideal_s for f in figs]),
            np.array([f.published_s for f in figs]),
        )
    )
    s = summary(h["loso"])
    assert s["median"] <= 0.10 and s["worst"] <= 0.25, s
    assert s["median"] < constant["median"] and s["worst"] < constant["worst"], (s, constant)


@pytest.mark.parametrize("sp,tp", [(False, 1), (False, 8), (True, 8)])
def test_activation_memory_per_layer_is_korthikanti_table_2_without_dropout(sp, tp):
    """Korthikanti et al. 2022, Table 2: activations per layer (16-bit) are sbh(34 + 5as/h) bytes,
    sbh(10 + 24/t + 5as/(ht)) with TP and sbh(34/t + 5as/(ht)) with TP and SP. With flash attention
    (no 5as/h scores) and no dropout masks (2 of the 10 and of the 34; RL fine-tuning runs without
    dropout) that is 32, 8 + 24/t and 32/t. Two models differing by one layer isolate a layer."""
    s, b, h = 2048, 1, 4096
    cost = CostModel(A100)

    def activations(layers):
        m = gpt(layers, h, 32)
        c = Candidates.grid(A100, layers, tp, 1, 1, sp=sp)
        return float(cost.stage(m, train_workload(1, seq=s), "train", c).activations[0])

    per_layer = activations(9) - activations(8)
    expected = s * b * h * ((32 / tp) if sp or tp == 1 else (8 + 24 / tp))
    assert per_layer == pytest.approx(expected, rel=1e-12)


def test_interleaved_schedule_memory_and_bubble():
    """Korthikanti et al. 2022, 4.2.3: interleaving with v virtual stages multiplies the first
    stage's in-flight activations by 1 + (p - 1) / (p v); Narayanan et al. SC'21, 2.2.2: the
    bubble shrinks by v, (p - 1) / (m v) of the ideal time."""
    m = gpt(48, 4096, 32)
    cost = CostModel(A100)
    w = train_workload(64)
    plain, inter = (
        cost.stage(m, w, "train", Candidates.grid(A100, 48, 1, 4, 1, micro_batches=64, vpp=v)) for v in (1, 3)
    )
    logits = 1 * 2048 * m.vocab * 4  # fp32 logits of one micro-batch, not per layer
    assert (inter.activations[0] - logits) / (plain.activations[0] - logits) == pytest.approx(1 + 3 / 12)
    bubble = lambda sc: sc.breakdown(cost.coeffs)["bubble"] / sc.breakdown(cost.coeffs)["compute"]
    assert bubble(plain) == pytest.approx(3 / 64) and bubble(inter) == pytest.approx(3 / (64 * 3))


def test_kv_cache_per_token_matches_vllm_paper():
    """Kwon et al., SOSP'23 (vLLM), section 3: "for the 13B OPT model, the KV cache of a single token
    demands 800 KB of space, calculated as 2 (key and value vectors) x 5120 (hidden state size)
    x 40 (number of layers) x 2 (bytes per FP16)". Exact."""
    opt13b = Model(name="opt", layers=40, hidden=5120, heads=40, kv_heads=40, ffn=20480, vocab=50272, dtype="fp16")
    assert CostModel.kv_bytes_per_token(opt13b, tp=1) == 800 * 1024
    # GQA Llama-3-8B: 8 KV heads of 128 -> 128 KiB per token, split over TP up to 8 ranks
    llama = Model(name="l", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256)
    assert [float(CostModel.kv_bytes_per_token(llama, tp)) for tp in (1, 2, 8, 16)] == [131072, 65536, 16384, 16384]


@pytest.mark.parametrize("zero,published_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_model_state_memory_matches_zero_paper(zero, published_gb):
    """Rajbhandari et al., SC'20 (ZeRO), Figure 1: a 7.5B-parameter model with mixed-precision
    Adam (K = 12) on 64-way DP needs 120 GB (baseline), 31.4 GB (P_os), 16.6 GB (P_os+g) and
    1.9 GB (P_os+g+p) per GPU for model states. Tolerance: the paper's rounding (0.05 GB)."""
    m = Model(name="m", layers=32, hidden=4096, heads=32, kv_heads=32, ffn=11008, vocab=32000)
    psi = m.num_params()
    c = Candidates.grid(A100, m.layers, 1, 1, 64, zero=zero)
    cost = CostModel(A100).stage(m, train_workload(512), "train", c)
    per_param = float(cost.weights[0] + cost.grads[0] + cost.optimizer[0]) / psi
    assert per_param * 7.5e9 / 1e9 == pytest.approx(published_gb, abs=0.05)
    if zero == 0:
        assert per_param == 16  # 2 (bf16 weights) + 2 (grads) + 12 (fp32 master, momentum, variance)


def test_generation_figures_the_cost_model_and_the_event_truth_beat_the_memory_bound_constant():
    """50 published decode and serving figures (TensorRT-LLM, LMDeploy, vLLM via
    LLM-Inference-Bench), each a batch at fixed input and output lengths. Neither predictor was
    fitted to them. Both beat, at the median and the worst, the constant that knows the bytes:
    every decode iteration reading the GPU's weights at the single fraction of HBM bandwidth that
    best fits the set in hindsight. Measured today (``nereus bench validate``): cost model 16.9% /
    55.4% (median / worst), event truth 17.3% / 49.4%, constant 33.1% / 123.9%; both predictors
    are mostly optimistic (mean signed -5.5% and -17.8%), most of all at large batches of long
    outputs, where neither charges enough for reading the KV cache."""
    rows = generation_cases()
    assert len(rows) >= 50 and len({c.source for c in rows}) >= 3
    err = generation_errors(rows)
    for k in ("model", "event"):
        assert np.median(np.abs(err[k])) < np.median(np.abs(err["best_constant"])), k
        assert np.max(np.abs(err[k])) < np.max(np.abs(err["best_constant"])), k
        assert np.median(np.abs(err[k])) <= 0.20, k


def test_moe_figures_are_stated_and_the_model_misses_them_as_recorded():
    """Six published MoE pre-training figures (Megatron-Bridge's H100 and B200 rows of Qwen3-30B-A3B
    and Qwen3-235B-A22B, NeMo AutoModel's H100 Qwen3-30B), none fitted. Recorded as measured
    (``nereus bench validate``, docs/PERFORMANCE.md): the cost model's median |error| 35% and worst
    49%, in both directions (the all-to-all in series over the NIC without DeepEP's per-node
    dedup is too slow; the B200 and pipelined runs too fast), better than the prior constant
    (64%) and far worse than a constant fitted to these six in hindsight. This test fails
    when a change moves the model's errors on them by more than 5 points, so that the record is
    restated, and checks that the AutoModel run, which ran, is found not to fit (a known miss)."""
    from nereus.bench.validate_bench import MOE, _moe_report

    report = _moe_report(None)
    assert report["cases"] == 6 and {r["source"] for r in report["rows"]} == {
        "megatron_bridge_h100_b200",
        "nemo_automodel_h100",
    }
    s = report["summary"]
    assert s["model"]["median"] == pytest.approx(0.349, abs=0.05)
    assert s["model"]["worst"] == pytest.approx(0.495, abs=0.05)
    assert s["model"]["median"] < s["constant"]["median"]
    assert [r["fits"] for r in report["rows"]].count(False) == 1
    assert MOE.is_dir()


def test_the_dense_set_does_not_take_the_moe_figures(validation):
    rows, _ = validation
    assert not {c.source for c in rows} & {"megatron_bridge_h100_b200", "nemo_automodel_h100"}
    assert not {c.source for c in rows} & {p.stem for p in (VALIDATION / "candidates").glob("*.nir")}


def test_candidate_figures_are_stated_and_the_model_misses_them_as_recorded():
    """31 published figures from three sources read on 2026-12-07 (NVIDIA's DGX Cloud benchmarking
    recipes, Megatron-LM's H100 weak-scaling table, Megatron-Bridge's dense rows), none fitted and
    not in the gated set: with them the hold-out misses its targets (docs/PERFORMANCE.md). Recorded
    as measured: the cost model's median |error| 9% and worst 39%. FP8 runs from 22% optimistic to
    6% pessimistic since FP8 GEMMs run as Transformer Engine measured them (8-24% optimistic
    before, at twice bf16's speed); Megatron-LM's DP-48 runs from 29% optimistic (TP 1, eight
    members of a DP ring on a node) to 39% pessimistic (TP 8, one), 45-80% pessimistic before the
    distributed optimizer and NCCL's per-NIC rings; every run fits. This test fails when a change
    moves them by more than 5 points, so that the record is restated."""
    from nereus.bench.validate_bench import _candidates_report

    report = _candidates_report(None)
    assert report["cases"] == 31 and len({r["source"] for r in report["rows"]}) == 3
    s = report["summary"]
    assert s["model"]["median"] == pytest.approx(0.092, abs=0.05)
    assert s["model"]["worst"] == pytest.approx(0.389, abs=0.05)
    dp48 = [r["model_error"] for r in report["rows"] if r["source"] == "megatron_lm_h100_2024"]
    assert len(dp48) == 4 and dp48 == sorted(dp48)  # the fewer a ring's members on a node, the slower
    assert all(r["fits"] for r in report["rows"])
    fp8 = [r["model_error"] for r in report["rows"] if "fp8" in r["plan"] or r["source"].startswith("megatron_bridge")]
    assert len(fp8) == 15 and max(abs(e) for e in fp8) == pytest.approx(0.217, abs=0.05)
    assert sum(e < 0 for e in fp8) == 14  # most still predicted faster than they ran


def test_mixture_of_experts_decode_figures_the_cost_model_beats_a_constant_fitted_to_them():
    """Six published decode figures of a mixture of experts (Mixtral-8x7B on vLLM, TP 4 on A100s,
    LLM-Inference-Bench: batches of 1 to 64 at 128 and 1,024 tokens in and out), none fitted. A
    decode step reads the experts its batch touches (2 of 8 for one token, all 8 for 64). The
    cost model beats, at the median and the worst, the constant fraction of HBM bandwidth fitted
    to these six in hindsight (every step reading every weight). Measured today (``nereus bench
    validate``): cost model 16.2% / 31.6% (median / worst), constant 22.3% / 144%; the event
    truth 25.6% / 31.0% loses to the constant at the median (recorded: it fails when a change
    moves the predictors' medians by more than 5 points)."""
    rows = [c for c in generation_cases() if c.source == "llm_inference_bench_vllm_a100_mixtral"]
    assert len(rows) == 6
    err = generation_errors(rows)
    med = {k: float(np.median(np.abs(err[k]))) for k in ("model", "event", "best_constant")}
    worst = {k: float(np.max(np.abs(err[k]))) for k in ("model", "event", "best_constant")}
    assert med["model"] < med["best_constant"] and worst["model"] < worst["best_constant"]
    assert worst["event"] < worst["best_constant"]
    assert med["model"] == pytest.approx(0.162, abs=0.05)
    assert med["event"] == pytest.approx(0.256, abs=0.05)
