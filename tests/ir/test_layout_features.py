"""Sequence parallelism, virtual pipeline stages and gradient dtype: they round-trip, the cost
model sees them, and combinations real systems do not run are diagnostics at their line."""

import pytest

import nereus
from nereus.ir import DiagnosticError, print_ir
from nereus.passes.cost.estimate import estimate_plan

from ..support import ROOT
from ..support.probe import TP8_PP8, probe_text

_plan = probe_text


CP_BASE = "tp = 8, pp = 8, layers = [0..11, 12..23, 24..35, 36..47, 48..59, 60..71, 72..83, 84..95], micro_batches = 32"
GOOD = TP8_PP8


def _error(layout: str) -> tuple[str, str]:
    text = _plan(layout)
    with pytest.raises(DiagnosticError) as e:
        nereus.verify(nereus.parse(text))
    (d,) = e.value.diagnostics
    return d.message, text.splitlines()[d.loc.line - 1]


def test_features_round_trip_and_change_the_estimate():
    text = _plan(GOOD + ", micro_batches = 64, sp = true, vpp = 3, grad_dtype = fp32")
    m = nereus.parse(text)
    lay = m.plans["probe"].layouts["gpt175b.train"]
    assert (lay.sp, lay.vpp, lay.grad_dtype) == (True, 3, "fp32")
    again = nereus.parse(print_ir(m)).plans["probe"].layouts["gpt175b.train"]
    assert (again.sp, again.vpp, again.grad_dtype) == (True, 3, "fp32")
    plain = nereus.parse(_plan(GOOD + ", micro_batches = 64"))
    assert estimate_plan(m, m.plans["probe"]) == [] and estimate_plan(plain, plain.plans["probe"]) == []
    a, b = m.plans["probe"].layouts["gpt175b.train"], plain.plans["probe"].layouts["gpt175b.train"]
    assert a.time_breakdown.bubble == pytest.approx(
        b.time_breakdown.bubble / 3, rel=1e-4
    )  # interleaving: a third of the bubble
    assert a.memory_breakdown.grads == pytest.approx(
        2 * b.memory_breakdown.grads, rel=1e-3
    )  # fp32 main grads (printed in MiB)
    assert a.memory_breakdown.activations < b.memory_breakdown.activations  # SP, despite interleaving's extra in flight


@pytest.mark.parametrize(
    "layout,message",
    [
        (
            "tp = 1, pp = 1, dp = 8, layers = [0..95], mesh = [0..7], sp = true",
            "sequence parallelism shards activations over TP, but tp = 1",
        ),
        (
            "tp = 8, pp = 1, dp = 1, layers = [0..95], mesh = [0..7], vpp = 2",
            "vpp = 2 interleaves pipeline stages, but pp = 1",
        ),
        (
            GOOD + ", micro_batches = 64, vpp = 5",
            "vpp = 5 virtual stages do not divide the layers of every pipeline stage",
        ),
        (
            GOOD + ", micro_batches = 12, vpp = 3",
            "the interleaved schedule needs micro_batches = 12 to be a multiple of pp = 8",
        ),
        (
            CP_BASE + ", dp = 1, cp = 3, mesh = [0..191]",
            "cp = 3 splits each sequence into 6 causal chunks, which do not divide the sequence prompt_len_max + "
            "response_len_max = 2048",
        ),
        (
            CP_BASE + ", dp = 1, cp = 2, mesh = [0..63]",
            "mesh has 64 GPUs but dp x cp x pp x tp = 1 x 2 x 8 x 8 = 128",
        ),
    ],
)
def test_unsupported_combinations_are_diagnostics_at_the_layout(layout, message):
    got, line = _error(layout)
    assert message in got
    assert "layout gpt175b.train" in line


def test_fp8_gemms_run_at_the_fp8_peak_and_need_it():
    """fp8 = true: the layer GEMMs at ``FP8_KERNEL_EFFICIENCY`` of bf16's fraction of the FP8 peak
    (1.9x bf16 here), attention and the LM head at bf16, plus the casts of their operands (a few
    percent more); without the cluster's FP8 peak it is a diagnostic at the attribute."""
    from nereus.passes.cost.cost_model import FP8_KERNEL_EFFICIENCY, CostModel

    text = _plan(GOOD + ", micro_batches = 64, fp8 = true").replace(
        "  peak_flops = 312TFLOPs\n", "  peak_flops = 312TFLOPs\n  peak_flops_fp8 = 624TFLOPs\n"
    )
    m, plain = nereus.parse(text), nereus.parse(_plan(GOOD + ", micro_batches = 64"))
    assert estimate_plan(m, m.plans["probe"]) == [] and estimate_plan(plain, plain.plans["probe"]) == []
    model = m.models["gpt175b"]
    gemm, attention = CostModel.gemm_flops(model), CostModel.layer_flops(model, 2048) - CostModel.gemm_flops(model)
    gain = FP8_KERNEL_EFFICIENCY * 2
    layers, head = 96 * (gemm / gain + attention), CostModel.head_flops(model)  # per token, forward
    kernels = (layers + head) / (96 * (gemm + attention) + head)
    fast = m.plans["probe"].layouts["gpt175b.train"].time_breakdown.compute
    slow = plain.plans["probe"].layouts["gpt175b.train"].time_breakdown.compute
    assert kernels < fast / slow < kernels * 1.1
    message, line = _error(GOOD + ", micro_batches = 64, fp8 = true")
    assert "fp8 GEMMs need the FP8 peak of cluster @selene" in message and "layout gpt175b.train" in line


def test_context_parallelism_splits_the_sequence_and_replicates_the_state():
    """cp = 2 on 128 GPUs against dp = 2 on the same GPUs: the same compute per GPU, half the
    activations of a micro-batch, a ring-attention K/V exchange; weights are replicated over CP
    as over DP, and ZeRO shards over dp x cp (EMUs and the memory count agree)."""
    from nereus.ir.sharding import derive_emus

    text = _plan(CP_BASE + ", dp = 1, cp = 2, mesh = [0..127], zero = 1")
    m = nereus.parse(text)
    lay = m.plans["probe"].layouts["gpt175b.train"]
    assert (lay.cp, lay.world, lay.replicas) == (2, 128, 2)
    assert nereus.parse(print_ir(m)).plans["probe"].layouts["gpt175b.train"].cp == 2
    wide = nereus.parse(_plan(CP_BASE + ", dp = 2, mesh = [0..127], zero = 1"))
    narrow = nereus.parse(_plan(CP_BASE + ", dp = 1, mesh = [0..63], zero = 1"))
    for mod in (m, wide, narrow):
        assert estimate_plan(mod, mod.plans["probe"]) == []
    c, d, one = (x.plans["probe"].layouts["gpt175b.train"] for x in (m, wide, narrow))
    assert c.time_breakdown.compute == pytest.approx(d.time_breakdown.compute, rel=1e-4)
    assert c.time_breakdown.compute == pytest.approx(one.time_breakdown.compute / 2, rel=1e-4)
    assert c.time_breakdown.cp > 0 and d.time_breakdown.cp == 0 and c.time_breakdown.dp > 0
    assert c.memory_breakdown.activations == pytest.approx(one.memory_breakdown.activations / 2, rel=1e-3)
    assert c.memory_breakdown.optimizer == pytest.approx(d.memory_breakdown.optimizer, rel=1e-3)  # ZeRO over dp x cp
    emus = derive_emus("probe", m.models["gpt175b"], lay, ("weight", "master", "exp_avg", "exp_avg_sq"))
    assert [e.replica for e in emus] == [0, 1]
    assert {s.gpu for e in emus for s in e.shards} == set(range(128))
    weights = [[x.box for x in s.entries if x.state == "weight"] for e in emus for s in e.shards[:1]]
    assert weights[0] == weights[1]  # CP ranks hold the same weights
    master = [[x.box for x in s.entries if x.state == "master"] for e in emus for s in e.shards[:1]]
    assert master[0] != master[1]  # and ZeRO splits the optimizer state between them


def test_context_parallelism_on_generation_is_a_diagnostic():
    text = (ROOT / "examples" / "grpo_7b_8gpu.nir").read_text()
    text = text.replace("layout actor.generate {\n    tp = 2", "layout actor.generate {\n    cp = 2\n    tp = 2", 1)
    with pytest.raises(DiagnosticError) as e:
        nereus.verify(nereus.parse(text))
    hits = [d for d in e.value.diagnostics if "context parallelism splits a training or inference pass" in d.message]
    assert len(hits) == 1 and text.splitlines()[hits[0].loc.line - 1].strip() == "cp = 2"
