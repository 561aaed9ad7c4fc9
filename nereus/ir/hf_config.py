"""A ``Model`` from a Hugging Face ``config.json`` (Llama, Qwen2, Qwen3 and Mistral families, and the
mixtures of experts Qwen3-MoE, Qwen2-MoE and Mixtral).

What is read (the IR attribute each key sets):

====================================  ==========================================================
``num_hidden_layers``                 ``layers``
``hidden_size``                       ``hidden``
``num_attention_heads``               ``heads``
``num_key_value_heads``               ``kv_heads`` (absent: ``heads``, no GQA, as Hugging Face does)
``intermediate_size``                 ``ffn`` (the four families use SwiGLU: ``mlp = gated``)
``vocab_size``                        ``vocab``
``head_dim``                          ``head_dim``, only when it differs from hidden / heads
``tie_word_embeddings``               ``tied_embeddings`` (absent: false, the families' default)
``model_type = qwen2``                ``qkv_bias = true`` (Qwen2 always has q/k/v biases)
``attention_bias``                    ``qkv_bias`` (Llama, Mistral, Qwen3; o_proj's bias is a note)
``model_type = qwen3``                ``qk_norm = true`` (per-head q/k RMSNorm weights)
``num_experts`` (Mixtral:             ``experts``; ``num_experts_per_tok`` -> ``experts_per_token``;
``num_local_experts``)                ``moe_intermediate_size`` (Mixtral: ``intermediate_size``)
                                      -> ``expert_ffn``; Qwen2-MoE's
                                      ``shared_expert_intermediate_size`` -> ``shared_expert_ffn``;
                                      Mixtral: ``moe_naming = mixtral``
``rope_theta`` (v5: ``rope_parameters``) ``rope_theta`` (an integer base)
``rms_norm_eps``                      ``norm_eps``
``attention_dropout``                 ``attention_dropout`` (absent: 0, the families' default)
``torch_dtype`` (v5: ``dtype``)       ``dtype``: bfloat16 -> bf16, float16 -> fp16, float32 -> fp32
                                      (absent or null: bf16, the IR's default, with a note)
====================================  ==========================================================

What the IR cannot express, reported as notes (``//`` comments above the printed block, and by
``nereus import-hf`` on stderr), never dropped silently:

- **biases** other than q/k/v's: o_proj's (``attention_bias`` also sets it) and ``mlp_bias``'s
  (gate/up/down). ``num_params()`` is short by that many, and their bytes are not in EMUs or
  transitions. (Qwen2's q/k/v biases are modelled: ``num_params()`` equals transformers' count.)
- **rope scaling** (``rope_scaling``, or a ``rope_parameters`` type other than ``default``).
- **sliding-window attention** (Mistral's ``sliding_window``, Qwen2's with ``use_sliding_window``):
  the cost model sizes KV caches and attention for full attention.

The context length does not change any tensor's shape and is not part of the IR. An unsupported
``model_type`` (DeepSeek's and other mixtures of experts with dense first layers or shared
experts in another form name what the IR lacks; so does a Qwen MoE config with dense layers
among its MoE layers, ``mlp_only_layers`` other than the first layers or ``decoder_sparse_step``), a
missing or non-integer shape key, or an unknown dtype raise a ``DiagnosticError`` naming the key
and the file.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from .attributes import is_probability
from .diagnostics import Diagnostic, DiagnosticError, Loc
from .model import Model

DENSE = ("llama", "qwen2", "qwen3", "mistral")
MOE = ("qwen3_moe", "qwen2_moe", "mixtral")  # mixtures of experts whose every layer is MoE
FAMILIES = DENSE + MOE
# mixture-of-experts families the IR does not model yet, refused by name
MOE_FAMILIES = ("deepseek_v2", "deepseek_v3", "olmoe", "granitemoe")
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
# IR attribute <- config key, in the order the printer writes them
SHAPE = {
    "layers": "num_hidden_layers",
    "hidden": "hidden_size",
    "heads": "num_attention_heads",
    "ffn": "intermediate_size",
    "vocab": "vocab_size",
}


def load_hf_config(config: dict | str | Path) -> tuple[dict, str]:
    """The config as a dict, and where it came from (a file name, or ``<dict>``)."""
    if isinstance(config, dict):
        return config, "<dict>"
    path = str(config)
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise _error(path, "no such file") from None
    except json.JSONDecodeError as e:
        raise DiagnosticError([Diagnostic(Loc(e.lineno, e.colno, path), f"not JSON: {e.msg}")]) from None
    except (OSError, UnicodeDecodeError) as e:
        raise _error(path, f"cannot read: {e}") from None
    if not isinstance(data, dict):
        raise _error(path, "not a Hugging Face config: the JSON is not an object")
    return data, path


def model_from_hf_config(
    config: dict | str | Path, name: str = "actor", *, trained: bool = False, head: str = "lm"
) -> Model:
    """The IR model of a Hugging Face config (a dict, or the path of its ``config.json``).

    ``name`` is the model's IR symbol (without ``@``); ``trained`` and ``head`` (``lm`` or
    ``value``) are the IR's own attributes, not in the config. The notes (module docstring) come
    back as the model's leading comments, so ``print_ir`` writes them above the block.
    """
    cfg, source = load_hf_config(config)
    check_model_name(name, source)
    if head not in ("lm", "value"):
        raise _error(source, f"head = '{head}': choose lm or value")
    family = cfg.get("model_type")
    experts = {k: cfg[k] for k in EXPERT_KEYS if isinstance(cfg.get(k), int) and cfg[k] > 1}
    if family in MOE_FAMILIES or (experts and family not in MOE):
        what = ", ".join(f"{k} = {v}" for k, v in experts.items()) or "experts"
        raise _error(
            source,
            f"model_type = {family!r} is a mixture-of-experts model ({what}) the IR does not model",
            f"mixtures of experts supported: {', '.join(MOE)} (every layer MoE, no dense first layers)",
        )
    if family not in FAMILIES:
        raise _error(
            source,
            f"model_type = {family!r} is not supported",
            f"supported: {', '.join(FAMILIES)} (Llama-style decoders the IR models)",
        )
    shape = {attr: _posint(cfg, key, source) for attr, key in SHAPE.items()}
    heads = shape["heads"]
    kv_heads = _posint(cfg, "num_key_value_heads", source) if cfg.get("num_key_value_heads") is not None else heads
    head_dim = _posint(cfg, "head_dim", source) if cfg.get("head_dim") is not None else None
    if head_dim == shape["hidden"] // heads:
        head_dim = None  # the IR's default: print nothing
    raw_dtype = cfg.get("torch_dtype", cfg.get("dtype"))
    if raw_dtype is not None and raw_dtype not in DTYPES:
        raise _error(source, f"torch_dtype = {raw_dtype!r} is not supported", f"supported: {', '.join(DTYPES)}")
    rope_theta = cfg.get("rope_theta")
    rope = cfg.get("rope_parameters")
    if rope_theta is None and isinstance(rope, dict):
        rope_theta = rope.get("rope_theta")
    if rope_theta is not None and (isinstance(rope_theta, bool) or not isinstance(rope_theta, int | float)):
        raise _error(source, f"rope_theta = {rope_theta!r} is not a number")
    eps = cfg.get("rms_norm_eps")
    if eps is not None and (isinstance(eps, bool) or not isinstance(eps, int | float) or eps <= 0):
        raise _error(source, f"rms_norm_eps = {eps!r} is not a positive number")
    dropout = cfg.get("attention_dropout", 0.0)
    if not is_probability(dropout):
        raise _error(source, f"attention_dropout = {dropout!r} is not a probability below 1")
    moe = _moe(cfg, family, source) if family in MOE else {}
    model = Model(
        name=name,
        layers=shape["layers"],
        hidden=shape["hidden"],
        heads=heads,
        kv_heads=kv_heads,
        ffn=shape["ffn"],
        vocab=shape["vocab"],
        head_dim=head_dim,
        dtype=DTYPES[raw_dtype] if raw_dtype else "bf16",
        mlp="gated",
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=family in ("qwen2", "qwen2_moe") or bool(cfg.get("attention_bias")),
        qk_norm=family in ("qwen3", "qwen3_moe"),
        **moe,
        attention_dropout=float(dropout),
        rope_theta=round(rope_theta) if rope_theta is not None and rope_theta == round(rope_theta) else None,
        norm_eps=float(eps) if eps is not None else None,
        head=head,
        trained=trained,
    )
    notes = hf_notes(cfg, model)
    origin = f", {cfg['_name_or_path']}" if cfg.get("_name_or_path") else ""
    model.comments[None] = [(f"// from {source} (model_type = {family}{origin})", False)] + [
        (f"// note: {n}", False) for n in notes
    ]
    return model


def _moe(cfg: dict, family: str, source: str) -> dict:
    """The IR's expert attributes of a Qwen3-MoE, Qwen2-MoE or Mixtral config."""
    if family == "mixtral":
        return dict(
            experts=_posint(cfg, "num_local_experts", source),
            experts_per_token=_posint(cfg, "num_experts_per_tok", source),
            expert_ffn=_posint(cfg, "intermediate_size", source),
            moe_naming="mixtral",
        )
    step, dense = cfg.get("decoder_sparse_step", 1), sorted(cfg.get("mlp_only_layers") or [])
    if step != 1 or dense != list(range(len(dense))):
        raise _error(
            source,
            f"decoder_sparse_step = {step}, mlp_only_layers = {dense}: dense MLP layers among the MoE layers "
            "are not modelled",
            "the IR's mixture of experts has its dense layers first (dense_layers), the rest MoE",
        )
    # the Hub's Qwen configs say num_experts; transformers 5 writes num_local_experts for it
    key = "num_experts" if cfg.get("num_experts") is not None else "num_local_experts"
    if cfg.get(key) is None:
        key = "num_experts"  # the error names the Hub's key
    out = dict(
        experts=_posint(cfg, key, source),
        experts_per_token=_posint(cfg, "num_experts_per_tok", source),
        expert_ffn=_posint(cfg, "moe_intermediate_size", source),
    )
    if family == "qwen2_moe":
        out["shared_expert_ffn"] = _posint(cfg, "shared_expert_intermediate_size", source)
    if dense:  # mlp_only_layers = [0, ..., k - 1]: the first k layers keep the dense MLP
        out["dense_layers"] = len(dense)
    return out


def hf_notes(cfg: dict, model: Model) -> list[str]:
    """What the IR leaves out of this config (see the module docstring), one sentence each."""
    notes = []
    if cfg.get("torch_dtype", cfg.get("dtype")) is None:
        notes.append("the config gives no torch_dtype: dtype = bf16 (the IR's default)")
    if cfg.get("attention_bias"):
        n = model.layers * model.hidden
        notes.append(
            f"attention_bias = true: the q/k/v biases are modelled, o_proj's are not: {n:,} parameters "
            f"({model.layers} layers x {model.hidden})"
        )
    if cfg.get("mlp_bias"):
        n = model.layers * (2 * model.ffn + model.hidden)
        notes.append(f"mlp_bias = true not modelled: {n:,} parameters of gate/up/down biases")
    raw = cfg.get("rope_parameters")
    rope: dict = raw if isinstance(raw, dict) else {}
    scaling = cfg.get("rope_scaling")
    rope_type = (scaling.get("rope_type") or scaling.get("type") if isinstance(scaling, dict) else None) or rope.get(
        "rope_type"
    )
    if rope_type not in (None, "default"):
        notes.append(f"rope scaling ({rope_type}) not modelled: rope_theta is the base frequency only")
    theta = cfg.get("rope_theta", rope.get("rope_theta"))
    if theta is not None and model.rope_theta is None:
        notes.append(f"rope_theta = {theta} is not an integer: not kept (Megatron-LM's --rotary-base is one)")
    window = cfg.get("sliding_window")
    if window and (cfg["model_type"] == "mistral" or cfg.get("use_sliding_window")):
        notes.append(f"sliding_window = {window} not modelled: the cost model sizes KV caches for full attention")
    return notes


def model_block(model: Model) -> str:
    """``model @name { ... }`` in canonical form, with its comments: ready to paste into a .nir file."""
    from .module import Module
    from .printer import print_ir

    return print_ir(Module(models={model.name: model}))


def check_model_name(name: str, source: str) -> None:
    """A model's IR name is an identifier (``@name`` in the text); raise a diagnostic otherwise."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise _error(source, f"model name '{name}' is not an IR identifier (letters, digits and _, not first a digit)")


def _posint(cfg: dict, key: str, source: str) -> int:
    if key not in cfg or cfg[key] is None:
        raise _error(source, f"the config has no '{key}'", f"a {cfg.get('model_type')} config.json gives {key}")
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _error(source, f"'{key}' = {value!r} is not a positive integer")
    return value


def _error(source: str, message: str, hint: str | None = None) -> DiagnosticError:
    return DiagnosticError([Diagnostic(Loc(0, 0, source), message, hint)])
