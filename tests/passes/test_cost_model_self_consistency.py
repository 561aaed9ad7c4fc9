"""The cost model against itself: formulas rebuilt in the test, identities it must satisfy,
and how it annotates and rejects plans. These are self-consistency checks, not evidence that
the model agrees with real runs (``test_cost_model_published.py`` has those).
"""

import numpy as np
import pytest

import nereus
from nereus.ir import Model, Workload
from nereus.passes import Candidates, CostModel
from nereus.passes.cost.layout_costs import stage_groups

from ..support import EXAMPLES
from ..support.gpt import A100, gpt, train_workload


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("layers,hidden,heads", [(96, 12288, 96), (24, 2304, 24), (128, 25600, 160)])
def test_training_flops_equal_narayanan_formula(layers, hidden, heads, recompute):
    """Narayanan et al., SC'21, eq. (3): FLOPs of one iteration of a GPT model,
    72 B s l h^2 (1 + s/6h + V/12lh), or 96 B s l h^2 (1 + s/6h + V/16lh) with recomputation.
    Exact: our per-layer count reduces to theirs for GPT shapes (tolerance 1e-12, float rounding)."""
    B, s, V = 1536, 2048, 51200
    m = gpt(layers, hidden, heads, V)
    passes = 4 if recompute else 3
    ours = B * s * (passes * layers * CostModel.layer_flops(m, s) + 3 * CostModel.head_flops(m))
    if recompute:
        theirs = 96 * B * s * layers * hidden**2 * (1 + s / (6 * hidden) + V / (16 * layers * hidden))
    else:
        theirs = 72 * B * s * layers * hidden**2 * (1 + s / (6 * hidden) + V / (12 * layers * hidden))
    assert ours == pytest.approx(theirs, rel=1e-12)


def test_bubble_fraction_of_1f1b():
    """The 1F1B bubble is (p - 1) / (m + p - 1) of the total compute time (Narayanan et al. 2021, section 2.2)."""
    m = gpt(32, 4096, 32)
    cm = CostModel(A100)
    for pp, mb in [(2, 8), (4, 16), (8, 8)]:
        c = Candidates.grid(A100, 32, 1, pp, 1, micro_batches=mb)
        b = cm.stage(m, train_workload(64), "train", c).breakdown(cm.coeffs)
        assert b["bubble"] / (b["compute"] + b["bubble"]) == pytest.approx((pp - 1) / (mb + pp - 1))


def test_time_is_linear_in_coefficients_and_breakdown_sums_to_it():
    cm = CostModel(A100)
    m = gpt(24, 2048, 16)
    c = Candidates.grid(A100, 24, [1, 2, 4, 8], [1, 2, 2, 4], [8, 4, 2, 1], micro_batches=8)
    for kind in ("train", "infer", "generate"):
        cost = cm.stage(m, train_workload(256), kind, c)
        t = cost.time(cm.coeffs)
        assert np.allclose(t, cost.features_for(cm.coeffs) @ cm.coeffs + cost.latency)
        for i in range(len(c)):
            assert sum(cost.breakdown(cm.coeffs, i).values()) == pytest.approx(t[i])


def test_decode_is_hbm_bound_and_tp_helps_it():
    """A decode step of a small batch reads every weight from HBM: time ~ steps x weight bytes / bandwidth."""
    cm = CostModel(A100)
    m = Model(name="l", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256)
    w = Workload(
        name="w",
        algorithm="grpo",
        roles=[],
        global_batch=8,
        group_size=2,
        prompt_len_mean=128,
        prompt_len_max=128,
        response_len_mean=512,
        response_len_max=1024,
        micro_batch=1,
    )
    c = Candidates.grid(A100, 32, [1, 2], 1, 1)
    cost = cm.stage(m, w, "generate", c)
    b1, b2 = cost.breakdown(cm.coeffs, 0), cost.breakdown(cm.coeffs, 1)
    weight_read = 1024 * m.num_params() * 2 / (A100.hbm_bandwidth * 0.7)
    decode = lambda b: b["memory"] + b["tail"]  # the batch full, then draining to the longest response
    assert decode(b1) == pytest.approx(weight_read, rel=0.05)  # plus the KV cache reads
    assert decode(b2) < 0.55 * decode(b1)


def test_estimate_annotates_examples_and_step_time_follows_stages():
    for path in EXAMPLES:
        m = nereus.parse(path.read_text())
        nereus.run_pipeline(m, "estimate")
        for plan in m.plans.values():
            w = m.workloads[plan.workload]
            total = 0.0
            for st in w.stages:
                groups = stage_groups(plan, st.model_stages())
                total += max(sum(plan.layouts[ms].time for ms in g) for g in groups)
                for ms in st.model_stages():
                    lay = plan.layouts[ms]
                    assert lay.time > 0 and 0 < lay.memory <= m.clusters[plan.cluster].gpu_memory
            assert plan.step_time == pytest.approx(total, rel=1e-4)


def test_out_of_memory_is_a_diagnostic_naming_stage_gpu_and_shortfall(tmp_path):
    text = (
        next(p for p in EXAMPLES if p.name == "grpo_7b_8gpu.nir")
        .read_text()
        .replace("gpu_memory = 80GiB", "gpu_memory = 24GiB")
    )
    m = nereus.parse(text, "small.nir")
    with pytest.raises(nereus.DiagnosticError) as e:
        nereus.run_pipeline(m, "estimate")
    msgs = [d.message for d in e.value.diagnostics]
    assert any(
        msg.startswith("actor.train needs") and "on GPU" in msg and "bytes more than its 24.00 GiB" in msg
        for msg in msgs
    ), msgs
    d = next(d for d in e.value.diagnostics if d.message.startswith("actor.train"))
    assert text.splitlines()[d.loc.line - 1].strip().startswith("layout actor.train")
    short = int(d.message.split(", ")[1].split(" bytes")[0].replace(",", ""))
    assert short > 0
