"""A Llama-style transformer and its tensor inventory: every weight, its shape, how TP shards it.

Names follow Hugging Face's Llama checkpoints without the ``model.`` prefix, so that the
runtime can load them into vLLM and ``transformers`` unchanged. Per-layer tensors are one
*family* (``mlp.up_proj.weight``) with a layer axis; in text a family is written with its
layer or layer range: ``layers.0..15.mlp.up_proj.weight``.

Sharding rules (Megatron-LM's, which vLLM follows):

- ``column``: split output features (dim 0) across TP ranks, at head granularity for
  attention projections. When ``tp > kv_heads`` each K/V head is replicated on
  ``tp / kv_heads`` consecutive ranks (vLLM's rule).
- ``row``: split input features (dim 1).
- ``vocab``: split the vocabulary (dim 0) of the embedding and LM head.
- ``replicated``: every TP rank holds the whole tensor (norms, the value head).

The q/k/v biases (``qkv_bias``, Qwen2's ``self_attn.q_proj.bias``...) follow their weight's
rows: column-split at head granularity, K/V replicated as their weights are. Qwen3's per-head
query and key RMSNorm weights (``qk_norm``: ``self_attn.q_norm.weight``, ``k_norm``, one
head dimension each) are replicated.

Uneven splits: a dimension of ``n`` rows over ``t`` ranks gives rank ``r`` the rows
``[r*(n//t) + min(r, n%t), ...)`` of length ``n//t + (r < n%t)`` (``torch.tensor_split``'s
rule): the first ``n % t`` ranks hold one row more. Attention heads are never split unevenly:
the verifier requires ``tp`` to divide ``heads``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import cast

from .attributes import AttrSpec
from .diagnostics import NOWHERE, Loc
from .emu import member_states

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}

MODEL_ATTRS = [
    AttrSpec("layers", "posint", doc="transformer blocks"),
    AttrSpec("hidden", "posint", doc="hidden size"),
    AttrSpec("heads", "posint", doc="attention heads"),
    AttrSpec("kv_heads", "posint", doc="key/value heads (GQA)"),
    AttrSpec("ffn", "posint", doc="MLP intermediate size"),
    AttrSpec("vocab", "posint", doc="vocabulary size"),
    AttrSpec("head_dim", "posint", default=None, doc="defaults to hidden / heads"),
    AttrSpec("dtype", "choice", default="bf16", choices=tuple(DTYPE_BYTES)),
    AttrSpec(
        "mlp",
        "choice",
        default="gated",
        choices=("gated", "plain"),
        doc="gated: SwiGLU gate/up/down (Llama); plain: up/down with one activation (GPT)",
    ),
    AttrSpec("tied_embeddings", "bool", default=False),
    AttrSpec("qkv_bias", "bool", default=False, doc="biases on the q/k/v projections (Qwen2)"),
    AttrSpec("qk_norm", "bool", default=False, doc="RMSNorm of each head's queries and keys (Qwen3)"),
    AttrSpec("rope_theta", "posint", default=None, doc="RoPE base (Hugging Face rope_theta); no tensor depends on it"),
    AttrSpec("norm_eps", "float", default=None, doc="RMSNorm epsilon (rms_norm_eps); no tensor depends on it"),
    AttrSpec(
        "head",
        "choice",
        default="lm",
        choices=("lm", "value"),
        doc="lm: next-token logits; value: a scalar (critic, reward)",
    ),
    AttrSpec("trained", "bool", default=False, doc="true for models the job updates (actor, critic)"),
]

RULES = ("column", "row", "vocab", "replicated")
# the K/V projections (weights and biases), whose heads are replicated when tp > kv_heads
KV_FAMILIES = frozenset(f"self_attn.{p}_proj.{t}" for p in "kv" for t in ("weight", "bias"))
# the attention projections TP splits at head granularity
HEAD_FAMILIES = KV_FAMILIES | {"self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.o_proj.weight"}


@dataclass(frozen=True)
class TensorSpec:
    """One weight (or, with ``per_layer``, one per-layer family) of a model."""

    family: str
    shape: tuple[int, ...]
    rule: str  # one of RULES
    per_layer: bool
    placement: str = "layer"  # layer | first | last | first_and_last (pipeline stage holding it)

    @property
    def tp_dim(self) -> int | None:
        return {"column": 0, "vocab": 0, "row": 1}.get(self.rule)

    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def even_split(n: int, parts: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of ``rank``'s share of ``n`` rows over ``parts`` (tensor_split's rule)."""
    base, extra = divmod(n, parts)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


@dataclass(kw_only=True)
class Model:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    head_dim: int | None = None
    dtype: str = "bf16"
    mlp: str = "gated"
    tied_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_theta: int | None = None
    norm_eps: float | None = None
    head: str = "lm"
    trained: bool = False
    loc: Loc = field(default=NOWHERE, compare=False, repr=False)
    locs: dict[str, Loc] = field(default_factory=dict, compare=False, repr=False)
    comments: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def hd(self) -> int:
        """Head dimension."""
        return self.head_dim if self.head_dim is not None else self.hidden // self.heads

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @cached_property
    def tensors(self) -> dict[str, TensorSpec]:
        """The inventory, keyed by family name, in checkpoint order."""
        h, hd = self.hidden, self.hd
        q, kv = self.heads * hd, self.kv_heads * hd
        bias = (
            [
                TensorSpec("self_attn.q_proj.bias", (q,), "column", True),
                TensorSpec("self_attn.k_proj.bias", (kv,), "column", True),
                TensorSpec("self_attn.v_proj.bias", (kv,), "column", True),
            ]
            if self.qkv_bias
            else []
        )
        qk_norm = (
            [
                TensorSpec("self_attn.q_norm.weight", (hd,), "replicated", True),
                TensorSpec("self_attn.k_norm.weight", (hd,), "replicated", True),
            ]
            if self.qk_norm
            else []
        )
        specs = [
            TensorSpec(
                "embed_tokens.weight",
                (self.vocab, h),
                "vocab",
                False,
                "first_and_last" if self.tied_embeddings else "first",
            ),
            TensorSpec("input_layernorm.weight", (h,), "replicated", True),
            TensorSpec("self_attn.q_proj.weight", (q, h), "column", True),
            TensorSpec("self_attn.k_proj.weight", (kv, h), "column", True),
            TensorSpec("self_attn.v_proj.weight", (kv, h), "column", True),
            *bias,
            TensorSpec("self_attn.o_proj.weight", (h, q), "row", True),
            *qk_norm,
            TensorSpec("post_attention_layernorm.weight", (h,), "replicated", True),
            *([TensorSpec("mlp.gate_proj.weight", (self.ffn, h), "column", True)] if self.mlp == "gated" else []),
            TensorSpec("mlp.up_proj.weight", (self.ffn, h), "column", True),
            TensorSpec("mlp.down_proj.weight", (h, self.ffn), "row", True),
            TensorSpec("norm.weight", (h,), "replicated", False, "last"),
        ]
        if self.head == "value":
            specs.append(TensorSpec("score.weight", (1, h), "replicated", False, "last"))
        elif not self.tied_embeddings:
            specs.append(TensorSpec("lm_head.weight", (self.vocab, h), "vocab", False, "last"))
        return {s.family: s for s in specs}

    def num_params(self) -> int:
        total = 0
        for s in self.tensors.values():
            total += s.numel() * (self.layers if s.per_layer else 1)
        return total

    # ------------------------------------------------------------ TP sharding
    def tp_span(self, spec: TensorSpec, tp: int, rank: int) -> tuple[int, int] | None:
        """``[start, stop)`` along ``spec.tp_dim`` held by TP ``rank``; None when replicated."""
        if spec.tp_dim is None:
            return None
        n = spec.shape[spec.tp_dim]
        if spec.family in KV_FAMILIES and tp > self.kv_heads:
            head = rank * self.kv_heads // tp
            return head * self.hd, (head + 1) * self.hd
        if spec.family in HEAD_FAMILIES:
            heads = n // self.hd
            lo, hi = even_split(heads, tp, rank)
            return lo * self.hd, hi * self.hd
        return even_split(n, tp, rank)

    def tp_replication(self, spec: TensorSpec, tp: int) -> int:
        """How many TP ranks hold each element of ``spec``."""
        if spec.rule == "replicated":
            return tp
        if spec.family in KV_FAMILIES and tp > self.kv_heads:
            return tp // self.kv_heads
        return 1

    def tp_box(self, spec: TensorSpec, tp: int, rank: int) -> tuple[tuple[int, int], ...]:
        span = self.tp_span(spec, tp, rank)
        return tuple(cast("tuple[int, int]", span) if d == spec.tp_dim else (0, n) for d, n in enumerate(spec.shape))

    def stages_holding(self, spec: TensorSpec, pp: int) -> list[int]:
        """Pipeline stages that hold a non-layer tensor."""
        return {"first": [0], "last": [pp - 1], "first_and_last": sorted({0, pp - 1})}[spec.placement]


def state_dtype_bytes(model: Model, state: str) -> int:
    """Bytes per element of a state: weights in the model dtype; grads, fp32 master and Adam
    moments in fp32; a group of states (``optimizer``: master and both moments) the sum of its members'."""
    return sum(model.dtype_bytes if st == "weight" else 4 for st in member_states(state))
