"""Hugging Face ``LlamaForCausalLM`` as a Nereus model, live under PyTorch's own parallelism.

``ir_model(config)`` is the IR ``Model`` of a ``LlamaConfig`` (``llama_config(model)`` goes
back); nothing is downloaded: configs are built locally and weights are seeded.

``build(config, layout, seed=...)`` makes this rank's live model for an IR layout, in fp32:

- tensor parallel over the layout's ``tp`` sub-mesh (process groups of the model's own,
  ``private_mesh``) with ``parallelize_module``: q/k/v,
  gate/up ``ColwiseParallel``; o/down ``RowwiseParallel``; the embedding vocabulary-parallel
  (``RowwiseParallel(input_layouts=Replicate())``: its weight is ``Shard(0)``) and the LM head
  ``ColwiseParallel(output_layouts=Replicate())``; norms stay plain, replicated tensors. These
  are the IR's column / row / vocab / replicated rules (``nereus.ir.model``) wherever
  ``state.check_layout`` accepts the layout;
- data parallel over the ``dp`` sub-mesh by an all-reduce of every gradient (DDP's arithmetic,
  written out): weights and optimizer state stay whole on every replica, which is the IR's
  ``zero = 0`` and a DTensor placement (``Replicate`` over dp). FSDP2 (``zero = 3``) is not
  used: its shards of a TP-sharded tensor are a ``_StridedShard`` with ``torch.chunk``'s
  padding, which ``nereus.runtime.dtensor`` does not express as IR boxes;
- pipeline parallelism is not built (``check_layout`` says so for ``pp > 1``).

Training is ``torch.optim.AdamW`` on the fp32 parameters, so the parameter *is* the master
weight: the IR's ``master`` state of an fp32 model maps to the parameter (``state.py``).

``train_step`` runs one optimizer step on one global batch (``batch``: the same tokens for a
given seed and step under every layout; DP replica ``d`` takes its rows). What is exact: two
models of the same layout that hold the same state and see the same batches compute
bit-identical losses and states (every reduction has a fixed order on gloo; checked by the
tests on 2 and 4 processes). What is not:
different layouts sum in different orders (TP's all-reduce of partial products, DP's average
of per-replica means), so their losses agree only to float32 rounding.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from transformers import LlamaConfig, LlamaForCausalLM

from ..ir import Diagnostic, DiagnosticError, Layout, Model
from ..ir.diagnostics import NOWHERE
from ..runtime.dtensor import MESH_DIMS

PREFIX = "model."  # HF's parameter names are the IR's with this prefix (except ``lm_head.weight``)


def ir_model(config: LlamaConfig, name: str = "actor", trained: bool = True) -> Model:
    """The IR model of a Llama config, in fp32 (the dtype this adapter trains in).

    A config with tensors the IR inventory does not name (biases) or another MLP is a diagnostic.
    """
    problems = []
    if config.attention_bias or getattr(config, "mlp_bias", False):
        problems.append("attention_bias / mlp_bias: bias tensors are not in the IR's Llama inventory")
    if config.hidden_act != "silu":
        problems.append(f"hidden_act = {config.hidden_act!r}: the IR's gated MLP is Llama's SwiGLU (silu)")
    if problems:
        raise DiagnosticError([Diagnostic(NOWHERE, f"LlamaConfig: {p}") for p in problems])
    hd = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return Model(name=name, layers=config.num_hidden_layers, hidden=config.hidden_size,
                 heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
                 ffn=config.intermediate_size, vocab=config.vocab_size,
                 head_dim=None if hd == config.hidden_size // config.num_attention_heads else hd,
                 dtype="fp32", tied_embeddings=bool(config.tie_word_embeddings), trained=trained)


def llama_config(model: Model, **extra) -> LlamaConfig:
    """A ``LlamaConfig`` for an IR model (``extra``: fields the IR does not hold, e.g. rope_theta)."""
    if model.mlp != "gated" or model.head != "lm":
        raise DiagnosticError([Diagnostic(model.loc, f"model @{model.name}: mlp = {model.mlp}, head = {model.head} "
                                                     "has no LlamaForCausalLM (needs mlp = gated, head = lm)")])
    return LlamaConfig(vocab_size=model.vocab, hidden_size=model.hidden, intermediate_size=model.ffn,
                       num_hidden_layers=model.layers, num_attention_heads=model.heads,
                       num_key_value_heads=model.kv_heads, head_dim=model.hd, hidden_act="silu",
                       tie_word_embeddings=model.tied_embeddings, attention_bias=False, mlp_bias=False,
                       use_cache=False, **extra)


def tp_plan(layers: int) -> dict:
    """``parallelize_module``'s plan for ``LlamaForCausalLM`` (module names with the ``model.`` prefix)."""
    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(layers):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
    return plan


@dataclass
class LiveLlama:
    """This rank's live model and optimizer under ``layout`` (``model`` is None off the layout)."""

    config: LlamaConfig
    layout: Layout
    mesh: DeviceMesh | None  # dims (dp, pp, tp) over private groups; None off the layout
    model: LlamaForCausalLM | None
    optimizer: torch.optim.AdamW | None
    adamw: dict = field(default_factory=dict)  # AdamW's hyperparameters, carried to the next layout
    timeout: float = 60.0

    @property
    def coordinate(self) -> tuple[int, int, int] | None:
        """(dp, pp, tp) of this rank, or None off the layout."""
        return tuple(self.mesh.get_coordinate()) if self.mesh is not None else None

    def params(self) -> dict[str, torch.nn.Parameter]:
        """Parameters by IR tensor name (``layers.0.self_attn.q_proj.weight``, ``lm_head.weight``)."""
        return {n.removeprefix(PREFIX): p for n, p in self.model.named_parameters()}


def private_mesh(layout: Layout, timeout: float) -> DeviceMesh | None:
    """The layout's mesh, dims ``(dp, pp, tp)`` as ``nereus.runtime.dtensor.device_mesh``, over
    process groups of its own (``new_group`` per slice of every dim, created through the store):
    never the default group, which ``DeviceMesh`` reuses for a dim that spans the world. A
    failed transition can leave the default group's connections closed (a timed-out receive
    closes its pair on gloo); the live model's TP and DP collectives must not depend on them.

    Every rank of the default group calls it; None on ranks off the layout.
    """
    ranks = torch.tensor(layout.mesh, dtype=torch.int).view(layout.dp, layout.pp, layout.tp)
    me = dist.get_rank()
    bound = datetime.timedelta(seconds=timeout)
    groups = []
    for dim in range(3):
        mine = None
        for members in ranks.movedim(dim, -1).reshape(-1, ranks.shape[dim]).tolist():
            g = dist.new_group(members, timeout=bound)
            if me in members:
                mine = g
        groups.append(mine)
    if me not in layout.mesh:
        return None
    return DeviceMesh.from_group(groups, "cpu", ranks, mesh_dim_names=MESH_DIMS)


ADAMW = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01}


def build(config: LlamaConfig, layout: Layout, *, seed: int = 0, adamw: dict | None = None,
          timeout: float = 60.0) -> LiveLlama:
    """This rank's live model and AdamW for ``layout`` (every rank of the default group calls it:
    the mesh creates process groups, ``private_mesh``). Weights are initialised from ``seed``, the
    same on every rank; AdamW's state is created up front (zeros, step 0), as its first step would.

    Call ``state.check_layout`` first: this builds what it is asked and does not re-check.
    """
    adamw = dict(ADAMW if adamw is None else adamw)
    mesh = private_mesh(layout, timeout)
    if mesh is None:
        return LiveLlama(config, layout, mesh, None, None, adamw, timeout)
    cfg = LlamaConfig.from_dict(config.to_dict())
    cfg._attn_implementation = "eager"
    cfg.use_cache = False
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.train()
    if layout.tp > 1:
        parallelize_module(model, mesh["tp"], tp_plan(cfg.num_hidden_layers))
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False, **adamw)
    for p in model.parameters():
        optimizer.state[p] = {"step": torch.tensor(0.0, dtype=torch.float32),
                              "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                              "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
    return LiveLlama(config, layout, mesh, model, optimizer, adamw, timeout)


def batch(config: LlamaConfig, step: int, *, seed: int = 0, rows: int = 4, seq: int = 16) -> torch.Tensor:
    """The global batch of ``step``: ``rows`` x ``seq`` token ids, the same under every layout."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(0, config.vocab_size, (rows, seq), generator=g)


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor of a parameter, gradient or optimizer state (a DTensor's shard), as
    a detached view: writing it writes the live tensor."""
    return (t.to_local() if isinstance(t, DTensor) else t).detach()


def train_step(live: LiveLlama, tokens: torch.Tensor) -> float:
    """One AdamW step on the global batch ``tokens``; the mean loss over the global batch.

    DP replica ``d`` of ``dp`` takes rows ``[d * n / dp, (d + 1) * n / dp)``; gradients are
    summed over the dp sub-mesh and divided by ``dp`` (an average of per-replica means, equal
    to the global mean since replicas take equal rows), as DDP does.
    """
    d, _, _ = live.coordinate
    dp = live.layout.dp
    rows = tokens.shape[0]
    if rows % dp:
        raise ValueError(f"a batch of {rows} rows does not split over DP {dp}")
    mine = tokens[d * rows // dp:(d + 1) * rows // dp]
    loss = live.model(input_ids=mine, labels=mine).loss
    loss.backward()
    total = loss.detach().clone()
    if dp > 1:
        group = live.mesh["dp"].get_group()
        for p in live.model.parameters():
            g = local(p.grad)
            dist.all_reduce(g, group=group)
            g.div_(dp)
        dist.all_reduce(total, group=group)
        total.div_(dp)
    live.optimizer.step()
    live.optimizer.zero_grad(set_to_none=True)
    return float(total)
