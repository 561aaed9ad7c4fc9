"""Named shapes of public models, as the IR's model attributes.

Each preset is the model's published Hugging Face ``config.json`` read by
``nereus.ir.hf_config`` (same fields, same omissions: the context length, which changes no
tensor; Qwen2's q/k/v biases, Qwen3's q/k norms, the RoPE base and the norm epsilon are in).
Sources:

- llama2-7b:   https://huggingface.co/meta-llama/Llama-2-7b-hf/blob/main/config.json        (6.74 B parameters)
- llama3-8b:   https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json     (8.03 B)
- llama3-70b:  https://huggingface.co/meta-llama/Meta-Llama-3-70B/blob/main/config.json    (70.55 B)
- qwen2-7b:    https://huggingface.co/Qwen/Qwen2-7B/blob/main/config.json                  (7.62 B with biases)
- qwen2.5-7b:  https://huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json                (7.62 B with biases)
- qwen2.5-14b: https://huggingface.co/Qwen/Qwen2.5-14B/blob/main/config.json               (14.77 B with biases)
- qwen3-8b:    https://huggingface.co/Qwen/Qwen3-8B/blob/main/config.json                  (8.19 B)
- mistral-7b:  https://huggingface.co/mistralai/Mistral-7B-v0.1/blob/main/config.json      (7.24 B)
- qwen3-30b-a3b: https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json           (30.53 B, 3.35 B active)
- qwen3-235b-a22b: https://huggingface.co/Qwen/Qwen3-235B-A22B/blob/main/config.json       (235.09 B, 22.19 B active)
- mixtral-8x7b: https://huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json   (46.70 B, 12.88 B active)

The three mixtures of experts have every layer MoE (``ffn`` is Qwen3-MoE's dense size, which no
layer uses; Mixtral's ``expert_ffn`` is its ``intermediate_size``).

All are untied, SwiGLU (``mlp = gated``) with GQA except Llama-2-7B (``kv_heads = heads``); ``dtype`` is
the IR's default bf16 (Llama-2-7B's checkpoint is fp16: ``nereus import-hf`` on its config says so).
"""

from __future__ import annotations

from typing import Any

from .hf_config import check_model_name
from .model import Model
from .units import format_number

SHAPE_KEYS = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab")

PRESETS: dict[str, dict[str, Any]] = {
    "llama2-7b": dict(
        layers=32, hidden=4096, heads=32, kv_heads=32, ffn=11008, vocab=32000, rope_theta=10000, norm_eps=1e-5
    ),
    "llama3-8b": dict(
        layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256, rope_theta=500000, norm_eps=1e-5
    ),
    "llama3-70b": dict(
        layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256, rope_theta=500000, norm_eps=1e-5
    ),
    "qwen2-7b": dict(
        layers=28,
        hidden=3584,
        heads=28,
        kv_heads=4,
        ffn=18944,
        vocab=152064,
        qkv_bias=True,
        rope_theta=1000000,
        norm_eps=1e-6,
    ),
    "qwen2.5-7b": dict(
        layers=28,
        hidden=3584,
        heads=28,
        kv_heads=4,
        ffn=18944,
        vocab=152064,
        qkv_bias=True,
        rope_theta=1000000,
        norm_eps=1e-6,
    ),
    "qwen2.5-14b": dict(
        layers=48,
        hidden=5120,
        heads=40,
        kv_heads=8,
        ffn=13824,
        vocab=152064,
        qkv_bias=True,
        rope_theta=1000000,
        norm_eps=1e-5,
    ),
    "qwen3-8b": dict(
        layers=36,
        hidden=4096,
        heads=32,
        kv_heads=8,
        ffn=12288,
        vocab=151936,
        qk_norm=True,
        rope_theta=1000000,
        norm_eps=1e-6,
    ),
    "mistral-7b": dict(
        layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=32000, rope_theta=10000, norm_eps=1e-5
    ),
    "qwen3-30b-a3b": dict(
        layers=48,
        hidden=2048,
        heads=32,
        kv_heads=4,
        head_dim=128,
        ffn=6144,
        vocab=151936,
        qk_norm=True,
        experts=128,
        experts_per_token=8,
        expert_ffn=768,
        rope_theta=1000000,
        norm_eps=1e-6,
    ),
    "qwen3-235b-a22b": dict(
        layers=94,
        hidden=4096,
        heads=64,
        kv_heads=4,
        head_dim=128,
        ffn=12288,
        vocab=151936,
        qk_norm=True,
        experts=128,
        experts_per_token=8,
        expert_ffn=1536,
        rope_theta=1000000,
        norm_eps=1e-6,
    ),
    "mixtral-8x7b": dict(
        layers=32,
        hidden=4096,
        heads=32,
        kv_heads=8,
        ffn=14336,
        vocab=32000,
        experts=8,
        experts_per_token=2,
        expert_ffn=14336,
        moe_naming="mixtral",
        rope_theta=1000000,
        norm_eps=1e-5,
    ),
}

# What the IR leaves out of each preset (printed by ``nereus import-hf --preset``): see hf_config.
PRESET_NOTES: dict[str, list[str]] = {
    "mistral-7b": ["sliding_window = 4096 not modelled: the cost model sizes KV caches for full attention"],
    "qwen3-30b-a3b": ["the router's top-k normalisation (norm_topk_prob) changes no tensor"],
    "qwen3-235b-a22b": ["the router's top-k normalisation (norm_topk_prob) changes no tensor"],
}


def _get(name: str) -> dict[str, Any]:
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown preset '{name}'; presets: {', '.join(PRESETS)}") from None


def preset_attrs(name: str) -> str:
    """The preset's shape as IR attribute text: ``layers = 32, hidden = 4096, ...``."""
    return ", ".join(f"{k} = {v if isinstance(v, str) else format_number(v)}" for k, v in _get(name).items())


def preset_model(name: str, model_name: str = "actor", *, trained: bool = False, head: str = "lm") -> Model:
    """A ``Model`` of the preset's shape, named ``model_name``, with its source and notes as leading comments."""
    shape: dict[str, Any] = _get(name)
    check_model_name(model_name, f"preset {name}")
    model = Model(name=model_name, trained=trained, head=head, **shape)
    model.comments[None] = [(f"// preset {name} (nereus/ir/presets.py)", False)] + [
        (f"// note: {n}", False) for n in PRESET_NOTES.get(name, [])
    ]
    return model
