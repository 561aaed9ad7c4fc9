"""A mixture of experts in the cost model: the GEMM FLOPs a token costs equal twice the parameters
it goes through (counted from the tensor inventory, independently of the formula), and a decode
step reads the experts its batch touches."""

from __future__ import annotations

import pytest

from nereus.ir.hf_config import model_from_hf_config
from nereus.passes.cost.cost_model import CostModel, touched_share

QWEN3_30B_A3B = dict(
    model_type="qwen3_moe",
    num_hidden_layers=48,
    hidden_size=2048,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    vocab_size=151936,
)
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
MIXTRAL_8X7B = dict(
    model_type="mixtral",
    num_hidden_layers=32,
    hidden_size=4096,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=14336,
    num_local_experts=8,
    num_experts_per_tok=2,
    vocab_size=32000,
)


@pytest.mark.parametrize("cfg", [QWEN3_30B_A3B, QWEN2_57B_A14B, MIXTRAL_8X7B])
def test_gemm_flops_are_twice_the_active_matrix_parameters(cfg):
    m = model_from_hf_config(cfg, "actor")
    # every matrix a token multiplies, once: the active parameters less the embedding and the vectors
    vectors = sum(s.numel() * (m.layers if s.per_layer else 1) for s in m.tensors.values() if len(s.shape) == 1)
    embedding = m.tensors["embed_tokens.weight"].numel()
    matrices = m.num_active_params() - embedding - vectors
    assert m.layers * CostModel.gemm_flops(m) + CostModel.head_flops(m) == 2 * matrices


def test_a_decode_step_reads_the_experts_its_batch_touches():
    m = model_from_hf_config(QWEN3_30B_A3B, "actor")
    one, eight, many = touched_share(m, [1, 8, 4096])
    assert one == pytest.approx(8 / 128)  # one token: its 8 experts
    assert one < eight < many and many == pytest.approx(1.0)  # a large batch reads every expert
