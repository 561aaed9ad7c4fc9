"""The tensor inventory and TP sharding rules against published parameter counts and vLLM's rules."""

import pytest

from nereus.ir.model import Model, even_split

# Parameter counts as reported by Hugging Face model cards / `sum(p.numel())` of the checkpoints.
PUBLISHED = [
    # Llama-2-7B: 6,738,415,616 parameters (meta-llama/Llama-2-7b-hf)
    (dict(layers=32, hidden=4096, heads=32, kv_heads=32, ffn=11008, vocab=32000), 6_738_415_616),
    # Llama-3-8B: 8,030,261,248 parameters (meta-llama/Meta-Llama-3-8B)
    (dict(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256), 8_030_261_248),
    # Llama-3-70B: 70,553,706,496 parameters (meta-llama/Meta-Llama-3-70B)
    (dict(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256), 70_553_706_496),
]


@pytest.mark.parametrize("spec,params", PUBLISHED)
def test_parameter_count_matches_published(spec, params):
    assert Model(name="m", **spec).num_params() == params


def test_tied_embeddings_drop_lm_head_and_value_head_adds_score():
    spec = dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=100)
    assert "lm_head.weight" not in Model(name="m", tied_embeddings=True, **spec).tensors
    value = Model(name="m", head="value", **spec).tensors
    assert value["score.weight"].shape == (1, 64) and "lm_head.weight" not in value


def test_uneven_split_is_tensor_split_rule():
    assert [even_split(10, 3, r) for r in range(3)] == [(0, 4), (4, 7), (7, 10)]
    import torch

    parts = torch.tensor_split(torch.arange(10), 3)
    assert [(int(p[0]), int(p[-1]) + 1) for p in parts] == [even_split(10, 3, r) for r in range(3)]


def test_tp_boxes_tile_and_follow_rules():
    m = Model(name="m", layers=2, hidden=64, heads=8, kv_heads=2, ffn=96, vocab=101)
    t = m.tensors
    # column: dim 0 split at head granularity
    assert [m.tp_box(t["self_attn.q_proj.weight"], 4, r) for r in range(4)] == [
        ((16 * r, 16 * r + 16), (0, 64)) for r in range(4)
    ]
    # row: dim 1
    assert m.tp_box(t["mlp.down_proj.weight"], 4, 1) == ((0, 64), (24, 48))
    # vocab with an uneven split: the first 101 % 4 = 1 rank holds one row more
    assert [m.tp_span(t["embed_tokens.weight"], 4, r) for r in range(4)] == [(0, 26), (26, 51), (51, 76), (76, 101)]
    # K/V heads replicated when tp > kv_heads (vLLM): ranks 0,1 hold head 0; ranks 2,3 head 1
    assert [m.tp_span(t["self_attn.k_proj.weight"], 4, r) for r in range(4)] == [(0, 8), (0, 8), (8, 16), (8, 16)]
    assert m.tp_replication(t["self_attn.k_proj.weight"], 4) == 2
    # replicated norms
    assert m.tp_box(t["input_layernorm.weight"], 4, 3) == ((0, 64),)
    assert m.tp_replication(t["input_layernorm.weight"], 4) == 4
