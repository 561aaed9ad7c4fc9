"""Models from Hugging Face config.json files and the public presets: fields, parameter counts
against the published ones, errors, the ``nereus import-hf`` output, and (with transformers)
parameter counts against tiny models transformers instantiates from the same configs."""

import json

import pytest

import nereus
from nereus.cli import main
from nereus.ir import DiagnosticError
from nereus.ir.hf_config import model_block, model_from_hf_config
from nereus.ir.presets import PRESETS, SHAPE_KEYS, preset_attrs, preset_model

# the public config.json files (the keys the import reads, and a few it ignores)
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-05,
    "hidden_act": "silu",
}
QWEN25_14B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 5120,
    "intermediate_size": 13824,
    "num_attention_heads": 40,
    "num_hidden_layers": 48,
    "num_key_value_heads": 8,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "sliding_window": 131072,
    "use_sliding_window": False,
    "max_window_layers": 48,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-05,
    "hidden_act": "silu",
}
MISTRAL_7B = {
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "sliding_window": 4096,
    "rope_theta": 10000.0,
}
LLAMA2_7B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
    "torch_dtype": "float16",
}


def write(tmp_path, cfg, name="config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(cfg, indent=2))
    return path


# Qwen3-8B's public config.json (q/k norms, an explicit head_dim equal to hidden / heads)
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "head_dim": 128,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "max_position_embeddings": 40960,
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 151936,
}


@pytest.mark.parametrize(
    "cfg, preset, published, biases",
    [
        (LLAMA3_8B, "llama3-8b", 8_030_261_248, 0),
        (QWEN25_14B, "qwen2.5-14b", 14_770_033_664, 48 * (5120 + 1024 + 1024)),
        (MISTRAL_7B, "mistral-7b", 7_241_732_096, 0),
        (LLAMA2_7B, "llama2-7b", 6_738_415_616, 0),
    ],
)
def test_public_configs(tmp_path, cfg, preset, published, biases):
    m = model_from_hf_config(write(tmp_path, cfg), "actor", trained=True)
    assert (m.layers, m.hidden, m.heads, m.kv_heads, m.ffn, m.vocab) == (
        cfg["num_hidden_layers"],
        cfg["hidden_size"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["intermediate_size"],
        cfg["vocab_size"],
    )
    assert m.head_dim is None and m.mlp == "gated" and not m.tied_embeddings and m.trained and m.head == "lm"
    assert m.dtype == {"bfloat16": "bf16", "float16": "fp16"}[cfg["torch_dtype"]]
    # the published count, Qwen2's q/k/v biases included (they are part of the spec)
    assert m.num_params() == published and m.qkv_bias == bool(biases)
    shape = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab")
    assert [getattr(m, k) for k in shape] == [PRESETS[preset][k] for k in shape]
    assert m.rope_theta == cfg.get("rope_theta") and m.norm_eps == cfg.get("rms_norm_eps")
    text = model_block(m)
    assert nereus.parse(text).models["actor"] == m
    notes = [line for line in text.splitlines() if line.startswith("// note:")]
    assert not any("q/k/v biases" in n for n in notes)
    assert (cfg["model_type"] == "mistral") == any("sliding_window = 4096" in n for n in notes)


def test_defaults_head_dim_and_tied(tmp_path):
    cfg = {k: v for k, v in LLAMA3_8B.items() if k not in ("num_key_value_heads", "torch_dtype")}
    m = model_from_hf_config(
        cfg | {"tie_word_embeddings": True, "head_dim": 256, "num_attention_heads": 8}, "critic", head="value"
    )
    assert m.kv_heads == 8 and m.head_dim == 256 and m.hd == 256 and m.tied_embeddings and m.dtype == "bf16"
    assert m.head == "value" and "score.weight" in m.tensors and "lm_head.weight" not in m.tensors
    assert "no torch_dtype" in model_block(m)
    assert model_from_hf_config(cfg, "x").kv_heads == cfg["num_attention_heads"]  # no GQA key: MHA
    assert model_from_hf_config(cfg | {"dtype": "float32"}, "x").dtype == "fp32"  # transformers v5 writes dtype
    assert model_from_hf_config(cfg | {"head_dim": 128}, "x").head_dim is None  # = hidden / heads: not printed


def test_attention_dropout_is_read_printed_and_written_back():
    """The dropout a config trains with (Llama's ``attention_dropout``; 0 where absent) reaches
    the IR, prints, and goes back into the ``LlamaConfig`` the live loops build."""
    from nereus.integrations.hf_llama import llama_config

    m = model_from_hf_config(LLAMA3_8B | {"attention_dropout": 0.1}, "actor")
    assert m.attention_dropout == 0.1 and "attention_dropout = 0.1" in model_block(m)
    assert llama_config(m).attention_dropout == 0.1
    plain = model_from_hf_config(LLAMA3_8B, "actor")
    assert plain.attention_dropout == 0.0 and "attention_dropout" not in model_block(plain)


@pytest.mark.parametrize(
    "change, words",
    [
        ({"model_type": "gemma"}, ["model_type = 'gemma' is not supported"]),
        ({"intermediate_size": None}, ["no 'intermediate_size'"]),
        ({"num_hidden_layers": "32"}, ["'num_hidden_layers'", "not a positive integer"]),
        ({"torch_dtype": "int8"}, ["torch_dtype = 'int8'"]),
        ({"attention_dropout": 1.0}, ["attention_dropout = 1.0 is not a probability below 1"]),
    ],
)
def test_errors_name_the_key_and_file(tmp_path, change, words):
    cfg = {k: v for k, v in (LLAMA3_8B | change).items() if v is not None}
    path = write(tmp_path, cfg)
    with pytest.raises(DiagnosticError) as e:
        model_from_hf_config(path, "actor")
    text = str(e.value)
    assert str(path) in text and all(w in text for w in words), text


def test_bad_files_and_names(tmp_path, capsys):
    with pytest.raises(DiagnosticError, match="no such file"):
        model_from_hf_config(tmp_path / "missing.json", "actor")
    bad = tmp_path / "bad.json"
    bad.write_text('{"model_type": "llama",\n  oops}')
    with pytest.raises(DiagnosticError, match=r"bad.json:2:\d+: error: not JSON"):
        model_from_hf_config(bad, "actor")
    with pytest.raises(DiagnosticError, match="not an IR identifier"):
        model_from_hf_config(LLAMA3_8B, "my-actor")
    assert main(["import-hf", str(bad)]) == 1
    assert "not JSON" in capsys.readouterr().err


def test_cli_output_reparses(tmp_path, capsys):
    path = write(tmp_path, QWEN25_14B)
    assert main(["import-hf", str(path), "--name", "critic", "--trained", "--head", "value"]) == 0
    out, err = capsys.readouterr()
    assert "q/k/v biases" not in err and "qkv_bias = true" in out
    assert out.startswith(f"// from {path} (model_type = qwen2)")
    m = nereus.verify(nereus.parse(out)).models["critic"]
    assert (m.layers, m.hidden, m.kv_heads, m.trained, m.head) == (48, 5120, 8, True, "value")
    assert main(["import-hf", "--preset", "qwen2.5-14b"]) == 0
    out, err = capsys.readouterr()
    assert (
        nereus.parse(out).models["actor"]
        == nereus.parse(model_block(model_from_hf_config(QWEN25_14B, "actor"))).models["actor"]
    )
    assert "// preset qwen2.5-14b" in out
    assert main(["import-hf", "--list-presets"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in PRESETS) and "8.03 B" in listed
    assert main(["import-hf", "--preset", "llama-9b"]) == 1
    assert "presets: llama2-7b" in capsys.readouterr().err


def test_presets():
    text = f"model @m {{ {preset_attrs('llama3-70b')} }}"
    assert nereus.parse(text).models["m"].num_params() == 70_553_706_496
    qwen = preset_model("qwen2-7b", "ref")
    assert qwen.name == "ref" and qwen.num_params() == 7_615_616_512  # published, with biases
    assert nereus.parse(model_block(qwen)).models["ref"] == qwen
    assert preset_model("qwen2.5-7b").num_params() == 7_615_616_512


def test_qwen3_imports(tmp_path, capsys):
    path = write(tmp_path, QWEN3_8B)
    m = model_from_hf_config(path, "actor", trained=True)
    assert m.qk_norm and not m.qkv_bias and m.head_dim is None and m.hd == 128
    assert (m.rope_theta, m.norm_eps) == (1000000, 1e-06)
    assert {"self_attn.q_norm.weight", "self_attn.k_norm.weight"} <= set(m.tensors)
    assert m.tensors["self_attn.q_norm.weight"].shape == (128,)
    assert m.num_params() == 8_190_735_360  # Qwen3-8B as published (8.19 B)
    assert main(["import-hf", str(path), "--name", "actor"]) == 0
    out = capsys.readouterr().out
    assert "qk_norm = true" in out and nereus.verify(nereus.parse(out)).models["actor"].qk_norm
    preset = preset_model("qwen3-8b")
    assert [getattr(preset, k) for k in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "qk_norm")] == [
        getattr(m, k) for k in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "qk_norm")
    ]


@pytest.mark.parametrize(
    "cfg, words",
    [
        (
            {"model_type": "deepseek_v3", "n_routed_experts": 256},
            ["'deepseek_v3' is a mixture-of-experts model", "n_routed_experts = 256", "qwen3_moe, qwen2_moe, mixtral"],
        ),
        ({"model_type": "llama", "num_experts": 8}, ["'llama'", "num_experts = 8"]),
        (
            {
                "model_type": "qwen3_moe",
                "num_experts": 128,
                "num_experts_per_tok": 8,
                "moe_intermediate_size": 768,
                "mlp_only_layers": [1, 3],
            },
            ["mlp_only_layers = [1, 3]", "dense MLP layers among the MoE layers"],
        ),
        ({"model_type": "qwen3_moe", "num_experts": 128}, ["no 'num_experts_per_tok'"]),
    ],
)
def test_unmodelled_moe_is_a_clear_error(tmp_path, cfg, words):
    path = write(tmp_path, LLAMA3_8B | cfg)
    with pytest.raises(DiagnosticError) as e:
        model_from_hf_config(path, "actor")
    text = str(e.value)
    assert str(path) in text and all(w in text for w in words), text


MOE_TINY = {
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "qwen3_moe_dense_first": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[0]),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48
    ),
}


@pytest.mark.parametrize("family", list(MOE_TINY))
def test_moe_import_matches_transformers_checkpoint(family, tmp_path):
    """A tiny Qwen3-MoE, Mixtral and Qwen2-MoE from transformers: total parameters equal, active
    ones equal the non-expert parameters plus top-k experts per layer, and every IR tensor is a
    checkpoint tensor (the names ``save_pretrained`` writes, per expert) of the same shape, and
    the other way round; the printed block parses back to the same model."""
    transformers = pytest.importorskip("transformers")
    from safetensors import safe_open

    cfg = transformers.AutoConfig.for_model(family.removesuffix("_dense_first"), **(TINY | MOE_TINY[family]))
    ir = model_from_hf_config(cfg.to_dict(), "actor")
    hf = transformers.AutoModelForCausalLM.from_config(cfg)
    total = sum(p.numel() for p in hf.parameters())
    assert ir.num_params() == total
    experts = sum(p.numel() for n, p in hf.named_parameters() if ".experts." in n)
    k, e = cfg.num_experts_per_tok, ir.experts
    assert ir.num_active_params() == total - experts + experts * k // e
    assert ir.dense_layers == (len(cfg.mlp_only_layers) or None if family.endswith("dense_first") else None)
    hf.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        shapes = {n.removeprefix("model."): tuple(f.get_slice(n).get_shape()) for n in f.keys()}
    want = {}
    for fam, spec in ir.tensors.items():
        lo, hi = spec.span(ir.layers)
        for layer in range(lo, hi + 1) if spec.per_layer else [None]:
            want[fam if layer is None else f"layers.{layer}.{fam}"] = spec.shape
    assert want == shapes
    assert nereus.verify(nereus.parse(model_block(ir))).models["actor"] == ir


@pytest.mark.parametrize(
    "cfg, total, active",
    [
        (  # Qwen/Qwen3-30B-A3B's config.json
            dict(
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
                decoder_sparse_step=1,
                mlp_only_layers=[],
                torch_dtype="bfloat16",
            ),
            30_532_122_624,  # transformers 5.19 on the meta device; published: 30.5 B total, 3.3 B active
            30_532_122_624 - 48 * (128 - 8) * 3 * 768 * 2048,  # 120 idle experts a layer: 3,353,032,704
        ),
        (  # Qwen/Qwen3-235B-A22B's config.json (the simulator's MoE job)
            dict(
                model_type="qwen3_moe",
                num_hidden_layers=94,
                hidden_size=4096,
                num_attention_heads=64,
                num_key_value_heads=4,
                head_dim=128,
                intermediate_size=12288,
                moe_intermediate_size=1536,
                num_experts=128,
                num_experts_per_tok=8,
                vocab_size=151936,
                decoder_sparse_step=1,
                mlp_only_layers=[],
                tie_word_embeddings=False,
                torch_dtype="bfloat16",
            ),
            235_093_634_560,  # transformers 5.19 on the meta device; published: 235 B total, 22 B active
            235_093_634_560 - 94 * (128 - 8) * 3 * 1536 * 4096,  # 120 idle experts a layer: 22,190,763,520
        ),
        (  # mistralai/Mixtral-8x7B-v0.1's config.json
            dict(
                model_type="mixtral",
                num_hidden_layers=32,
                hidden_size=4096,
                num_attention_heads=32,
                num_key_value_heads=8,
                intermediate_size=14336,
                num_local_experts=8,
                num_experts_per_tok=2,
                vocab_size=32000,
                torch_dtype="bfloat16",
            ),
            46_702_792_704,  # transformers 5.19 on the meta device; published: 46.7 B total, 12.9 B active
            46_702_792_704 - 32 * (8 - 2) * 3 * 14336 * 4096,  # 6 idle experts a layer: 12,879,925,248
        ),
    ],
)
def test_published_moe_counts(tmp_path, cfg, total, active):
    m = model_from_hf_config(write(tmp_path, cfg), "actor")
    assert (m.num_params(), m.num_active_params()) == (total, active)
    presets = [p for p in PRESETS if all(PRESETS[p].get(k) == getattr(m, k) for k in (*SHAPE_KEYS, "experts"))]
    assert presets  # every one has its preset
    for p in presets:  # the preset of the same shape counts the same
        assert (preset_model(p).num_params(), preset_model(p).num_active_params()) == (total, active)


# -------------------------------------------- transformers: a real model from the same config
TINY = dict(
    num_hidden_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    vocab_size=128,
)


@pytest.mark.parametrize(
    "family, extra",
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": True}),
        ("llama", {"head_dim": 32}),
        ("qwen2", {}),
        ("qwen3", {"head_dim": 16}),
        ("qwen3", {"head_dim": 32, "attention_bias": True}),
        ("mistral", {}),
        ("mistral", {"num_key_value_heads": 4}),
    ],
)
def test_param_count_matches_transformers(family, extra):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.for_model(family, **(TINY | extra))
    ir = model_from_hf_config(cfg.to_dict(), "actor")
    hf = transformers.AutoModelForCausalLM.from_config(cfg)
    params = dict(hf.named_parameters())  # tied weights appear once
    o_bias = sum(p.numel() for n, p in params.items() if n.endswith("o_proj.bias"))  # a note, not in the spec
    assert ir.num_params() == sum(p.numel() for p in params.values()) - o_bias
    assert ir.qkv_bias == any(n.endswith("q_proj.bias") for n in params)
    if o_bias:
        assert f"{o_bias:,} parameters" in model_block(ir)
    # every IR tensor has its checkpoint name and shape (model. prefix aside)
    shapes = {n.removeprefix("model."): tuple(p.shape) for n, p in hf.state_dict().items()}
    for fam, spec in ir.tensors.items():
        name = f"layers.1.{fam}" if spec.per_layer else fam
        assert shapes[name] == spec.shape, name


@pytest.mark.parametrize(
    "preset, family",
    [("qwen2.5-7b", "qwen2"), ("qwen2-7b", "qwen2"), ("qwen3-8b", "qwen3"), ("llama3-8b", "llama")],
)
def test_preset_count_matches_transformers_on_meta(preset, family):
    """The full-size preset, built by transformers on the meta device (no weights, no download)."""
    transformers = pytest.importorskip("transformers")
    import torch

    md = preset_model(preset)
    cfg = transformers.AutoConfig.for_model(
        family,
        num_hidden_layers=md.layers,
        hidden_size=md.hidden,
        num_attention_heads=md.heads,
        num_key_value_heads=md.kv_heads,
        intermediate_size=md.ffn,
        vocab_size=md.vocab,
        head_dim=md.hd,
        tie_word_embeddings=md.tied_embeddings,
    )
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(cfg)
    assert md.num_params() == sum(p.numel() for p in hf.parameters())


def test_value_head_matches_transformers():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.for_model("llama", **TINY, num_labels=1)
    hf = transformers.AutoModelForSequenceClassification.from_config(cfg)
    ir = model_from_hf_config(cfg.to_dict(), "critic", head="value")
    assert ir.num_params() == sum(p.numel() for p in hf.parameters())


def test_moe_presets_are_the_published_configs(tmp_path):
    """The presets equal ``import-hf`` of the published configs (``test_published_moe_counts``'s)."""
    qwen = preset_model("qwen3-30b-a3b")
    assert (qwen.num_params(), qwen.num_active_params()) == (30_532_122_624, 3_353_032_704)
    mixtral = preset_model("mixtral-8x7b")
    assert (mixtral.num_params(), mixtral.num_active_params()) == (46_702_792_704, 12_879_925_248)
    assert nereus.verify(nereus.parse(model_block(mixtral))).models["actor"] == mixtral
