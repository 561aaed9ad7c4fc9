"""A mixture of experts in the cost model: the GEMM FLOPs a token costs equal twice the parameters
it goes through (counted from the tensor inventory, independently of the formula), and a decode
step reads the experts its batch touches."""

from __future__ import annotations

import pytest

from nereus.ir.hf_config import model_from_hf_config
from nereus.ir.presets import preset_model
from nereus.passes.cost.cost_model import CostModel, touched_share

QWEN2_57B_A14B = dict(
    model_type="qwen2_moe",
    num_hidden_layers=28,
    hidden_size=3584,
    num_attention_heads=28,
    num_key_value_heads=4,
    intermediate_size=18944,
    moe_intermediate_size=2560,
    shared_expert_intermediate_size=20480,
    num_experts=64,
    num_experts_per_tok=8,
    vocab_size=151936,
)


@pytest.mark.parametrize(
    "model",
    [preset_model("qwen3-30b-a3b"), model_from_hf_config(QWEN2_57B_A14B, "actor"), preset_model("mixtral-8x7b")],
    ids=["qwen3-30b-a3b", "qwen2-57b-a14b", "mixtral-8x7b"],
)
def test_gemm_flops_are_twice_the_active_matrix_parameters(model):
    m = model
    # every matrix a token multiplies, once: the active parameters less the embedding and the vectors
    vectors = sum(s.numel() * (m.layers if s.per_layer else 1) for s in m.tensors.values() if len(s.shape) == 1)
    embedding = m.tensors["embed_tokens.weight"].numel()
    matrices = m.num_active_params() - embedding - vectors
    assert m.layers * CostModel.gemm_flops(m) + CostModel.head_flops(m) == 2 * matrices


def test_a_decode_step_reads_the_experts_its_batch_touches():
    m = preset_model("qwen3-30b-a3b")
    one, eight, many = touched_share(m, [1, 8, 4096])
    assert one == pytest.approx(8 / 128)  # one token: its 8 experts
    assert one < eight < many and many == pytest.approx(1.0)  # a large batch reads every expert
