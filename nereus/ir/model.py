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

A mixture of experts (``experts``, ``experts_per_token``, ``expert_ffn``; Qwen3-MoE, Qwen2-MoE with
its ``shared_expert_ffn``, Mixtral with ``moe_naming = mixtral``) has every layer's MLP replaced by
a router (``mlp.gate.weight``, ``[experts, hidden]``, replicated) and one SwiGLU per expert, each a
family of its own under its checkpoint name (``mlp.experts.N.gate_proj.weight``; Mixtral's
``block_sparse_moe.experts.N.w1.weight``): TP splits each expert as a dense MLP (Megatron's
expert tensor parallelism equal to TP) by default, and every DP replica holds every expert. A
layout's expert parallelism (``ep``: experts split over EP ranks; ``etp``: each expert's TP size)
carves expert ranks from dp x cp x tp as Megatron does (``Layout.expert_rank``).
``dense_layers = 3`` keeps a dense MLP (``mlp.gate_proj.weight`` ..., of size ``ffn``) in the
first three layers (DeepSeek-V3's); those families, and the MoE ones, exist only in their layers
(``TensorSpec.layer_range``).

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
    AttrSpec(
        "experts",
        "posint",
        default=None,
        doc="routed experts per layer (mixture of experts: every layer's MLP is experts and a router)",
    ),
    AttrSpec("experts_per_token", "posint", default=None, doc="experts each token is routed to (top-k)"),
    AttrSpec("expert_ffn", "posint", default=None, doc="each expert's SwiGLU intermediate size"),
    AttrSpec(
        "shared_expert_ffn",
        "posint",
        default=None,
        doc="a shared expert every token goes through, with its sigmoid gate (Qwen2-MoE), of this size",
    ),
    AttrSpec(
        "dense_layers",
        "posint",
        default=None,
        doc="a mixture of experts whose first N layers keep a dense MLP of size ffn (DeepSeek-V3's "
        "first_k_dense_replace; Qwen3-MoE's mlp_only_layers when they are the first); the others are MoE",
    ),
    AttrSpec(
        "moe_naming",
        "choice",
        default="qwen",
        choices=("qwen", "mixtral"),
        doc="checkpoint names of the experts: qwen (mlp.experts.N.*_proj, mlp.gate) or mixtral "
        "(block_sparse_moe.experts.N.w1/w2/w3, block_sparse_moe.gate)",
    ),
    AttrSpec(
        "attention_dropout",
        "probability",
        default=0.0,
        doc="dropout probability on the attention weights in training (Hugging Face attention_dropout, "
        "Megatron --attention-dropout)",
    ),
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
    layer_range: tuple[int, int] | None = None  # inclusive layers a per-layer family exists in (None: every layer)

    def span(self, num_layers: int) -> tuple[int, int]:
        """The inclusive layers this per-layer family exists in."""
        return self.layer_range if self.layer_range is not None else (0, num_layers - 1)

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
    experts: int | None = None
    experts_per_token: int | None = None
    expert_ffn: int | None = None
    shared_expert_ffn: int | None = None
    dense_layers: int | None = None
    moe_naming: str = "qwen"
    attention_dropout: float = 0.0
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
            *(self._moe_tensors() + self._dense_first() if self.moe else self._mlp_tensors()),
            TensorSpec("norm.weight", (h,), "replicated", False, "last"),
        ]
        if self.head == "value":
            specs.append(TensorSpec("score.weight", (1, h), "replicated", False, "last"))
        elif not self.tied_embeddings:
            specs.append(TensorSpec("lm_head.weight", (self.vocab, h), "vocab", False, "last"))
        return {s.family: s for s in specs}

    def _mlp_tensors(self, layer_range: tuple[int, int] | None = None) -> list[TensorSpec]:
        h, r, f = self.hidden, layer_range, self.ffn
        gate = (
            [TensorSpec("mlp.gate_proj.weight", (f, h), "column", True, layer_range=r)] if self.mlp == "gated" else []
        )
        return [
            *gate,
            TensorSpec("mlp.up_proj.weight", (f, h), "column", True, layer_range=r),
            TensorSpec("mlp.down_proj.weight", (h, f), "row", True, layer_range=r),
        ]

    def _dense_first(self) -> list[TensorSpec]:
        """The dense MLP of the first ``dense_layers`` layers of a mixture of experts."""
        return self._mlp_tensors((0, self.dense_layers - 1)) if self.dense_layers else []

    @property
    def moe_layers(self) -> int:
        """Layers whose MLP is a mixture of experts (0 for a dense model)."""
        return self.layers - (self.dense_layers or 0) if self.moe else 0

    @property
    def moe(self) -> bool:
        """Whether every layer's MLP is a mixture of experts (``experts``, ``experts_per_token`` and
        ``expert_ffn`` set; the verifier reports a model with some of them only)."""
        return self.experts is not None and self.experts_per_token is not None and self.expert_ffn is not None

    def expert_families(self, e: int) -> tuple[str, ...]:
        """The checkpoint names of expert ``e``'s gate, up and down projections."""
        if self.moe_naming == "mixtral":
            return tuple(f"block_sparse_moe.experts.{e}.{w}.weight" for w in ("w1", "w3", "w2"))
        return tuple(f"mlp.experts.{e}.{w}_proj.weight" for w in ("gate", "up", "down"))

    @cached_property
    def expert_of(self) -> dict[str, int]:
        """The routed expert each expert family belongs to (``mlp.experts.3.up_proj.weight`` -> 3);
        the router, the shared expert and every dense tensor are absent."""
        return {f: e for e in range(self.experts or 0) for f in self.expert_families(e)} if self.moe else {}

    def _moe_tensors(self) -> list[TensorSpec]:
        """The router, every expert's SwiGLU (each expert's projections split by TP as a dense
        MLP's: Megatron's expert tensor parallelism equal to TP) and the shared expert with its
        gate, by their checkpoint names."""
        h, f = self.hidden, cast(int, self.expert_ffn)
        router = "block_sparse_moe.gate.weight" if self.moe_naming == "mixtral" else "mlp.gate.weight"
        r = (self.dense_layers, self.layers - 1) if self.dense_layers else None  # the MoE layers
        specs = [TensorSpec(router, (cast(int, self.experts), h), "replicated", True, layer_range=r)]
        for e in range(cast(int, self.experts)):
            gate, up, down = self.expert_families(e)
            specs += [
                TensorSpec(gate, (f, h), "column", True, layer_range=r),
                TensorSpec(up, (f, h), "column", True, layer_range=r),
                TensorSpec(down, (h, f), "row", True, layer_range=r),
            ]
        if self.shared_expert_ffn is not None:
            g = self.shared_expert_ffn
            specs += [
                TensorSpec("mlp.shared_expert.gate_proj.weight", (g, h), "column", True, layer_range=r),
                TensorSpec("mlp.shared_expert.up_proj.weight", (g, h), "column", True, layer_range=r),
                TensorSpec("mlp.shared_expert.down_proj.weight", (h, g), "row", True, layer_range=r),
                TensorSpec("mlp.shared_expert_gate.weight", (1, h), "replicated", True, layer_range=r),
            ]
        return specs

    @property
    def active_ffn(self) -> int:
        """The MLP intermediate size a token's GEMMs see: ``ffn`` for a dense model; for a
        mixture of experts, its experts' (top-k) and the shared expert's."""
        if not self.moe:
            return self.ffn
        return cast(int, self.experts_per_token) * cast(int, self.expert_ffn) + (self.shared_expert_ffn or 0)

    def num_params(self) -> int:
        total = 0
        for s in self.tensors.values():
            lo, hi = s.span(self.layers)
            total += s.numel() * (hi - lo + 1 if s.per_layer else 1)
        return total

    @property
    def expert_share(self) -> float:
        """The routed experts' share of the parameters (0 for a dense model)."""
        if not self.moe:
            return 0.0
        experts = self.moe_layers * cast(int, self.experts) * 3 * cast(int, self.expert_ffn) * self.hidden
        return experts / self.num_params()

    def num_active_params(self) -> int:
        """Parameters a token's forward pass reads: every one of a dense model; of a mixture of
        experts, the routed experts' only (``experts_per_token`` of ``experts``)."""
        if not self.moe:
            return self.num_params()
        per_expert = 3 * cast(int, self.expert_ffn) * self.hidden
        idle = cast(int, self.experts) - cast(int, self.experts_per_token)
        return self.num_params() - self.moe_layers * idle * per_expert

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
