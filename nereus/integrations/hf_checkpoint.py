"""A Hugging Face model's parameters under their checkpoint names: the IR's tensor inventory.

transformers 5 keeps a mixture of experts' experts fused in memory (``mlp.experts.gate_up_proj``,
``[experts, 2 x expert_ffn, hidden]``, and ``mlp.experts.down_proj``, ``[experts, hidden,
expert_ffn]``) and writes them per expert in its checkpoints (``mlp.experts.N.gate_proj.weight``
...; Mixtral's ``block_sparse_moe.experts.N.w1/w3/w2.weight``), which is what vLLM loads and
what the IR names. ``checkpoint_params`` gives every parameter under its IR name (the checkpoint
name without ``model.``), each expert's projections as views into the fused tensors (no copy:
a push reads the live parameters)."""

from __future__ import annotations

import torch

from ..ir import Model

PREFIX = "model."  # Hugging Face's names are the IR's with this prefix (``lm_head.weight`` aside)


def ir_name(hf: str) -> str:
    """The IR tensor name of a Hugging Face parameter or checkpoint name (``model.layers.0...`` -> ``layers.0...``)."""
    return hf.removeprefix(PREFIX)


def checkpoint_params(model: torch.nn.Module, ir: Model) -> dict[str, torch.Tensor]:
    """IR tensor name -> the live parameter (or a view of it) that holds it."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        key = ir_name(name)
        if ".mlp.experts." not in key:
            if ir.moe and ir.moe_naming == "mixtral" and ".mlp.gate." in key:
                key = key.replace(".mlp.gate.", ".block_sparse_moe.gate.")
            out[key] = p
            continue
        layer, _, what = key.partition(".mlp.experts.")
        f = ir.expert_ffn
        for e in range(p.shape[0]):
            gate, up, down = ir.expert_families(e)
            if what == "gate_up_proj":
                out[f"{layer}.{gate}"] = p[e, :f]
                out[f"{layer}.{up}"] = p[e, f:]
            elif what == "down_proj":
                out[f"{layer}.{down}"] = p[e]
            else:
                raise KeyError(f"{name}: an expert parameter the IR does not name")
    return out
