"""The cost model against figures that others published (measured on their hardware, not here).

Each test cites its source and states its tolerance. A time or throughput figure is only
evidence if the model predicts it better than a predictor that knows nothing about the
configuration, the constant-efficiency predictor (every GPU at ``CONSTANT_EFFICIENCY`` of its
peak). On the one such table here (Megatron's Table 1) the model does not beat it yet: that test
records both errors and claims nothing (issue 15). Memory and KV-cache figures are exact
accounting identities (no efficiency enters them), and those are evidence.
Checks of the model against itself (formulas rebuilt in the test, identities such as the 1F1B
bubble) are in ``test_cost_model_self_consistency.py``.
"""

import numpy as np
import pytest

from nereus.ir import Model
from nereus.passes import Candidates, CostModel

from ..support.gpt import A100, gpt, train_workload


CONSTANT_EFFICIENCY = 0.5  # the model's own prior compute efficiency, with no overheads at all


# Narayanan et al., SC'21, Table 1: GPT models on Selene (A100-80GB), sequence 2048, vocabulary
# 51,200, with activation recomputation: (params in B, heads, hidden, layers, TP, PP, GPUs,
# batch, achieved TFLOP/s per GPU).
MEGATRON_TABLE_1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]


def table_1_predictions() -> tuple[np.ndarray, np.ndarray]:
    """(model's TFLOP/s per GPU with the prior coefficients, published TFLOP/s per GPU) per row."""
    cm = CostModel(A100)
    predicted, published = [], []
    for params, heads, hidden, layers, tp, pp, gpus, batch, achieved in MEGATRON_TABLE_1:
        m = gpt(layers, hidden, heads)
        # the table's sizes, rounded to 0.1B, count learned position embeddings and biases too
        assert m.num_params() / 1e9 == pytest.approx(params, rel=0.035)
        dp = gpus // (tp * pp)
        c = Candidates.grid(A100, layers, tp, pp, dp, micro_batches=batch // dp, recompute=True)
        seconds = cm.stage(m, train_workload(batch), "train", c).time(cm.coeffs)[0]
        s, V = 2048, 51200
        hardware_flops = 96 * batch * s * layers * hidden**2 * (1 + s / (6 * hidden) + V / (16 * layers * hidden))
        predicted.append(hardware_flops / seconds / gpus / 1e12)
        published.append(achieved)
    return np.array(predicted), np.array(published)


def test_table_1_the_model_against_a_constant():
    """Narayanan et al., SC'21, Table 1: achieved TFLOP/s per GPU of 10 GPT models (1.7B-1T) on
    up to 3,072 A100s, predicted with the *prior* coefficients (not fitted to this table),
    beside the constant-efficiency predictor (every configuration at 0.5 x 312 TFLOP/s).

    This is a record, not evidence: today the constant wins (mean error 9.1% vs the model's
    13.4%, max 15.6% vs 23.8%; the model under-predicts the large models: one compute
    efficiency for every GEMM size, communication never overlapped, plain 1F1B where Megatron
    ran interleaved). Issue 15 is the work that must turn this around; until then no claim
    about the model's time predictions rests on this table (docs/PERFORMANCE.md says so). The
    numbers are pinned so that a change to the model shows here, and the assertion becomes
    "the model beats the constant" when it does.
    """
    predicted, published = table_1_predictions()
    constant = np.full_like(published, CONSTANT_EFFICIENCY * A100.peak_flops / 1e12, dtype=float)
    model_err = np.abs(predicted - published) / published
    const_err = np.abs(constant - published) / published
    assert const_err.mean() == pytest.approx(0.091, abs=0.001) and const_err.max() == pytest.approx(0.156, abs=0.001)
    assert model_err.mean() == pytest.approx(0.134, abs=0.001) and model_err.max() == pytest.approx(0.238, abs=0.001)


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


