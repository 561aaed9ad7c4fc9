"""A Hugging Face ``LlamaForCausalLM`` cut into pipeline stages, and its tensor-parallel plan.

``prune(hf, lo, hi, first, last)`` keeps decoder layers ``lo..hi`` (inclusive), the embedding on
the first stage and the final norm and LM head on the last, and drops the rest, in place. The
layers stay under their own indices (a ``ModuleDict`` keyed ``"lo"``..``"hi"``), so parameter
names are Hugging Face's whatever the stage: ``model.layers.3.mlp.up_proj.weight`` on any stage
that holds layer 3. The IR's tensor inventory uses the same names (``PREFIX`` stripped).

``LlamaStage(hf, first, last)`` is the stage's forward: token ids (first stage) or hidden states
in, hidden states or logits (last stage) out. It is the ``LlamaModel`` forward written out for
a layer range, as a ``torch.distributed.pipelining.PipelineStage`` needs it (one tensor in,
one tensor out): rotary position embeddings from the model's own ``rotary_emb`` and the causal
mask Hugging Face's eager attention adds (0 on and below the diagonal, the dtype's minimum
above). Every layout, one stage or many, runs this forward, so two layouts differ only in how
their collectives sum. ``recompute=True`` (the IR's ``recompute``) runs each decoder layer under
``torch.utils.checkpoint`` (non-reentrant): its activations are dropped after the forward and
recomputed in the backward, the same values, as Megatron's full recompute and torchtitan's
per-layer activation checkpointing.

``tp_plan(lo, hi, first, last)`` is ``parallelize_module``'s plan for the modules a stage holds:
q/k/v and gate/up ``ColwiseParallel``; o/down ``RowwiseParallel``; the embedding vocabulary-
parallel (``RowwiseParallel(input_layouts=Replicate())``: its weight is ``Shard(0)``) and the LM
head ``ColwiseParallel(output_layouts=Replicate())``; norms stay plain, replicated tensors.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.utils.checkpoint import checkpoint
from transformers import LlamaForCausalLM

COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


def prune(hf: LlamaForCausalLM, lo: int, hi: int, first: bool, last: bool) -> LlamaForCausalLM:
    """Keep layers ``lo..hi`` and the stage's ends of ``hf``; in place, returns ``hf``."""
    hf.model.layers = nn.ModuleDict({str(i): hf.model.layers[i] for i in range(lo, hi + 1)})
    if not first:
        hf.model.embed_tokens = None
    if not last:
        hf.model.norm = None
        setattr(hf, head_name(hf), None)
    return hf


def head_name(hf) -> str:
    """The attribute that holds the output head: ``lm_head`` (causal LM) or ``score`` (one value per
    position: ``LlamaForSequenceClassification``)."""
    return "lm_head" if hasattr(hf, "lm_head") else "score"


def tp_plan(lo: int, hi: int, first: bool = True, last: bool = True, head: str = "lm") -> dict:
    """``parallelize_module``'s plan for a stage holding layers ``lo..hi`` (names with ``model.``);
    a value head (``score``, one output) stays whole on every TP rank, as the IR replicates it."""
    plan = {}
    if first:
        plan["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate())
    if last and head == "lm":
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    for i in range(lo, hi + 1):
        plan.update({f"model.layers.{i}.{name}": ColwiseParallel() for name in COLWISE})
        plan.update({f"model.layers.{i}.{name}": RowwiseParallel() for name in ROWWISE})
    return plan


def causal_mask(rows: int, seq: int, dtype: torch.dtype) -> torch.Tensor:
    """Hugging Face eager attention's additive causal mask: [rows, 1, seq, seq]."""
    mask = torch.full((seq, seq), torch.finfo(dtype).min, dtype=dtype).triu(1)
    return mask[None, None].expand(rows, 1, seq, seq)


class LlamaStage(nn.Module):
    """The forward of a pruned ``LlamaForCausalLM`` (``prune``): ids or hidden in, hidden or logits out."""

    def __init__(self, hf: LlamaForCausalLM, first: bool, last: bool, recompute: bool = False):
        super().__init__()
        self.hf, self.first, self.last, self.recompute = hf, first, last, recompute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.hf.model
        h = m.embed_tokens(x) if self.first else x
        rows, seq = h.shape[:2]
        positions = torch.arange(seq, device=h.device)[None].expand(rows, -1)
        rotary = m.rotary_emb(h, positions)
        mask = causal_mask(rows, seq, h.dtype)
        for layer in m.layers.values():
            if self.recompute and torch.is_grad_enabled():
                h = checkpoint(
                    layer,
                    h,
                    attention_mask=mask,
                    position_ids=positions,
                    position_embeddings=rotary,
                    use_reentrant=False,
                )
            else:
                h = layer(h, attention_mask=mask, position_ids=positions, position_embeddings=rotary)
            if isinstance(h, tuple):
                h = h[0]
        if self.last:
            h = getattr(self.hf, head_name(self.hf))(m.norm(h))
        return h
