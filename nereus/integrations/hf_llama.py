"""Hugging Face ``LlamaForCausalLM`` as a Nereus model, live under PyTorch's own parallelism.

``ir_model(config)`` is the IR ``Model`` of a ``LlamaConfig`` (``llama_config(model)`` goes
back); nothing is downloaded: configs are built locally and weights are seeded.

``build(config, layout, seed=...)`` makes this rank's live model for an IR layout, in fp32, on
the layout's mesh (dims ``(dp, pp, tp)``, process groups of the model's own: ``private_mesh``):

- pipeline parallel over ``pp``: the stage holds the layout's layer range
  (``layout.layers[stage]``), the embedding on the first stage, the norm and LM head on the
  last (``llama_stages.prune``); ``torch.distributed.pipelining.PipelineStage`` runs it, with
  ``Schedule1F1B`` over ``layout.micro_batches`` micro-batches to train and ``ScheduleGPipe``
  forward-only to generate and score;
- tensor parallel over ``tp`` with ``parallelize_module`` (``llama_stages.tp_plan``: the IR's
  column / row / vocab / replicated rules wherever ``state.check_layout`` accepts the layout);
- data parallel over ``dp`` with ``DistributedDataParallel`` on the dp sub-mesh (weights and
  optimizer state whole on every replica: the IR's ``zero = 0``). Under TP, DDP first turns the
  DTensor parameters into their local shards (PyTorch's ``_pre_dp_module_transform``), so the
  box each parameter holds is recorded before (``LiveLlama.boxes``);
- or, for the IR's ``zero = 3``, FSDP2 (``fully_shard`` on the dp sub-mesh, per decoder layer and
  then the stage; ``reshard_after_forward``: ZeRO-3), composed with TP on 2-D (dp, tp): a
  TP-sharded tensor's DP shard is FSDP2's ``_StridedShard`` (dim 0 of each TP shard split over
  DP, TP first: exactly the IR's ZeRO box wherever the splits are even, which ``check_layout``
  requires). The box each parameter holds is torch's own (``compute_local_shape_and_global_offset``);
  AdamW's moments are DTensors of the same placements.

Training is ``torch.optim.AdamW`` on the fp32 parameters, so the parameter *is* the master
weight: the IR's ``master`` state of an fp32 model maps to the parameter (``state.py``).

``forward(live, ids)`` gives the logits on every rank of a replica; ``optimize(live, ids,
target, loss_fn)`` runs one AdamW step (``loss_fn(logits, target)``: a mean over the rows it is
given, one micro-batch's under PP) and returns the loss averaged over DP; ``train_step`` is
``optimize`` with the language-model loss on a global batch (``batch``; DP replica ``d`` takes
its rows). What is exact: two models of the same layout that hold the same state and see the
same batches compute bit-identical losses and states (every reduction has a fixed order on
gloo; checked by the tests on 2 and 4 processes). What is not: different layouts sum in
different orders (TP's all-reduce of partial products, DP's average of per-replica means, PP's
mean of micro-batch means), so their losses agree only to float32 rounding.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor

# torch's own box of a DTensor shard, _StridedShard (FSDP2 over TP) included; private, but the
# rule FSDP2's state dicts use
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.parallel import parallelize_module
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

from ..ir import Diagnostic, DiagnosticError, Layout, Model
from ..ir.diagnostics import NOWHERE, plural
from ..runtime.dtensor import MESH_DIMS
from .llama_stages import LlamaStage, prune, tp_plan

PREFIX = "model."  # HF's parameter names are the IR's with this prefix (except ``lm_head.weight``)


def ir_model(config: LlamaConfig, name: str = "actor", trained: bool = True, head: str = "lm") -> Model:
    """The IR model of a Llama config, in fp32 (the dtype this adapter trains in). ``head``:
    ``lm`` (``LlamaForCausalLM``) or ``value`` (a scalar per position: ``score.weight``, as
    ``LlamaForSequenceClassification`` with one label names it: a critic or a reward model).

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
    return Model(
        name=name,
        layers=config.num_hidden_layers,
        hidden=config.hidden_size,
        heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads,
        ffn=config.intermediate_size,
        vocab=config.vocab_size,
        head_dim=None if hd == config.hidden_size // config.num_attention_heads else hd,
        dtype="fp32",
        tied_embeddings=bool(config.tie_word_embeddings),
        attention_dropout=float(config.attention_dropout),
        head=head,
        trained=trained,
    )


def llama_config(model: Model, **extra) -> LlamaConfig:
    """A ``LlamaConfig`` for an IR model (``extra``: fields the IR does not hold, e.g. rope_theta)."""
    if model.mlp != "gated":
        raise DiagnosticError(
            [
                Diagnostic(
                    model.loc, f"model @{model.name}: mlp = {model.mlp} has no Hugging Face Llama (needs mlp = gated)"
                )
            ]
        )
    return LlamaConfig(
        vocab_size=model.vocab,
        hidden_size=model.hidden,
        intermediate_size=model.ffn,
        num_hidden_layers=model.layers,
        num_attention_heads=model.heads,
        num_key_value_heads=model.kv_heads,
        head_dim=model.hd,
        hidden_act="silu",
        tie_word_embeddings=model.tied_embeddings,
        attention_dropout=model.attention_dropout,
        attention_bias=False,
        mlp_bias=False,
        use_cache=False,
        **extra,
    )


@dataclass
class LiveLlama:
    """This rank's live model and optimizer under ``layout`` (``model`` is None off the layout;
    ``optimizer`` is None for a frozen model: a reference or reward model, ``trained = false``).

    ``model`` is the (pruned, under PP) ``LlamaForCausalLM`` (``LlamaForSequenceClassification``
    with one label for ``head = value``) that owns the parameters;
    ``runner`` what computes its forward: the ``LlamaStage``, wrapped in DDP when ``dp > 1``.
    ``boxes``: per IR tensor name, the full shape and the box of it this rank's parameter holds
    (recorded from the DTensor placements before DDP turns them into local tensors).
    """

    config: LlamaConfig
    layout: Layout
    mesh: DeviceMesh | None  # dims (dp, pp, tp) over private groups; None off the layout
    model: LlamaForCausalLM | None
    optimizer: torch.optim.AdamW | None
    adamw: dict = field(default_factory=dict)  # AdamW's hyperparameters, carried to the next layout
    timeout: float = 60.0
    runner: torch.nn.Module | None = None
    boxes: dict = field(default_factory=dict)  # IR name -> (full shape, box)
    placements: dict = field(default_factory=dict)  # IR name -> DTensor placements over tp (None: whole)
    named: dict = field(default_factory=dict)  # IR name -> the parameter AdamW and DDP hold
    schedules: dict = field(default_factory=dict)  # (train, input shape) -> pipeline schedule
    loss_fn: object = None  # the loss of the running optimize step (the 1F1B schedule calls it)
    head: str = "lm"  # lm: logits over the vocabulary; value: one scalar per position
    gpu: int = -1  # this process's GPU id in the plans (its rank unless the group was re-formed: ``gpus``)

    @property
    def out_features(self) -> int:
        """The last dimension of what ``forward`` returns."""
        return self.config.vocab_size if self.head == "lm" else 1

    @property
    def coordinate(self) -> tuple[int, int, int] | None:
        """(dp, pp, tp) of this rank, or None off the layout."""
        return tuple(self.mesh.get_coordinate()) if self.mesh is not None else None

    @property
    def first(self) -> bool:
        return self.coordinate[1] == 0

    @property
    def last(self) -> bool:
        return self.coordinate[1] == self.layout.pp - 1

    def params(self) -> dict[str, torch.nn.Parameter]:
        """Parameters by IR tensor name (``layers.0.self_attn.q_proj.weight``, ``lm_head.weight``),
        as recorded at build: under TP + DDP the module's own attributes are DTensors rebuilt
        from these at every forward (PyTorch's ``_pre_dp_module_transform``), so
        ``model.named_parameters()`` is no inventory after the first forward."""
        return dict(self.named)


def private_mesh(
    layout: Layout, timeout: float, gpus: list[int] | None = None, group: dist.ProcessGroup | None = None
) -> DeviceMesh | None:
    """The layout's mesh, dims ``(dp, pp, tp)`` as ``nereus.runtime.dtensor.device_mesh``, over
    process groups of its own (``new_group`` per slice of every dim, created through the store):
    never the default group, which ``DeviceMesh`` reuses for a dim that spans the world. A
    failed transition can leave the default group's connections closed (a timed-out receive
    closes its pair on gloo); the live model's TP, PP and DP collectives must not depend on them.

    Every rank of ``group`` calls it (None: the default group); None on ranks off the layout.
    ``gpus``: the GPU id of each rank of ``group`` (``gpus[r]``; None: rank r is GPU r), as after
    ``runtime.regroup.reform``. In a caller's ``group`` only its ranks make the slices (the
    world's other ranks take no part: no barrier runs); torch names a group by a count of the
    groups each process made, so the ranks of ``group`` must enter with equal counts, as
    ``new_group``'s callers always must, and leave with equal counts among themselves.
    """
    if layout.cp > 1:
        raise ValueError(
            f"{layout.model_stage}: cp = {layout.cp}, but the live Llama stages do not run ring attention; "
            "context-parallel layouts are costed and resharded, not trained here"
        )
    rank_of = (lambda g: g) if gpus is None else gpus.index  # noqa: E731
    world_rank = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))  # noqa: E731
    ranks = torch.tensor([world_rank(rank_of(g)) for g in layout.mesh], dtype=torch.int)
    ranks = ranks.view(layout.dp, layout.pp, layout.tp)
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
    if me not in ranks.flatten().tolist():
        return None
    return DeviceMesh.from_group(groups, "cpu", ranks, mesh_dim_names=MESH_DIMS)


ADAMW = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01}


def absent(
    config: LlamaConfig, layout: Layout, gpu: int, *, adamw: dict | None = None, head: str = "lm", timeout: float = 60.0
) -> LiveLlama:
    """A live model that this GPU does not hold (``model`` None), made without any collective:
    what a process that joins a running job has under the job's plan until a move gives it state."""
    return LiveLlama(
        config, layout, None, None, None, dict(ADAMW if adamw is None else adamw), timeout, head=head, gpu=gpu
    )


def build(
    config: LlamaConfig,
    layout: Layout,
    *,
    seed: int = 0,
    adamw: dict | None = None,
    timeout: float = 60.0,
    trained: bool = True,
    head: str = "lm",
    weights: dict[str, torch.Tensor] | None = None,
    gpus: list[int] | None = None,
    group: dist.ProcessGroup | None = None,
) -> LiveLlama:
    """This rank's live model and AdamW for ``layout`` (every rank of ``group`` calls it:
    the mesh creates process groups, ``private_mesh``). Weights are initialised from ``seed``, the
    same on every rank and stage (the whole model is initialised, then pruned to the stage);
    AdamW's state is created up front (zeros, step 0), as its first step would.

    ``trained = False`` (a reference or reward model: the IR's ``trained = false``, an ``infer``
    stage): no optimizer, no DDP (DP replicas share nothing at run time), parameters frozen.
    ``head = "value"``: ``LlamaForSequenceClassification`` with one label, whose ``score`` gives one
    value per position (the IR's ``score.weight``, replicated over TP).
    ``weights``: the whole model's state dict (Hugging Face names, as ``state_dict()`` of the
    unsharded model gives it; a trained reward model), loaded in place of the seeded initialisation
    before the model is cut to this rank's box. ``group``: the process group the job runs on
    (None: the default group); ``gpus``: the GPU id of each of its ranks (``private_mesh``;
    None: rank r is GPU r).

    Call ``state.check_layout`` first: this builds what it is asked and does not re-check.
    """
    adamw = dict(ADAMW if adamw is None else adamw)
    mesh = private_mesh(layout, timeout, gpus, group)
    gpu = dist.get_rank(group) if gpus is None else gpus[dist.get_rank(group)]
    if mesh is None:  # off the layout: the model this GPU does not hold
        return absent(config, layout, gpu, adamw=adamw, head=head, timeout=timeout)
    cfg = LlamaConfig.from_dict(config.to_dict())
    cfg._attn_implementation = "eager"
    cfg.use_cache = False
    torch.manual_seed(seed)
    if head == "value":
        cfg.num_labels = 1
        model = LlamaForSequenceClassification(cfg).to(torch.float32)
    else:
        model = LlamaForCausalLM(cfg).to(torch.float32)
    if weights is not None:
        model.load_state_dict(weights, strict=True)
    model.train(trained)
    if not trained:
        model.requires_grad_(False)
    _, stage, _ = mesh.get_coordinate()
    first, last = stage == 0, stage == layout.pp - 1
    lo, hi = layout.layers[stage]
    prune(model, lo, hi, first, last)
    if layout.tp > 1:
        parallelize_module(model, mesh["tp"], tp_plan(lo, hi, first, last, head))
    runner = LlamaStage(model, first, last, recompute=trained and layout.recompute)
    fsdp = trained and layout.zero == 3 and layout.dp > 1
    if fsdp:  # ZeRO-3: FSDP2 on the dp sub-mesh, per decoder layer, then the stage (embedding, norm, head)
        for layer in model.model.layers.values():
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(runner, mesh=mesh["dp"])
    boxes, placed = {}, {}
    for name, p in model.named_parameters():
        name = name.removeprefix(PREFIX)
        if isinstance(p, DTensor):  # TP's Shard, FSDP2's Shard and _StridedShard: the box torch computes
            placed[name] = tuple(p.placements)
            local, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            boxes[name] = (tuple(p.shape), tuple((o, o + n) for o, n in zip(offset, local)))
        else:
            placed[name] = None
            boxes[name] = (tuple(p.shape), tuple((0, n) for n in p.shape))
    if layout.dp > 1 and trained and not fsdp:  # DDP on the dp sub-mesh; under TP it makes parameters shards
        stage_module = runner
        runner = DistributedDataParallel(
            runner, device_mesh=mesh["dp"], forward_sync_buffers=False, find_unused_parameters=layout.pp > 1
        )
    named = {n.removeprefix(PREFIX): p for n, p in model.named_parameters()}
    if layout.dp > 1 and layout.tp > 1 and trained and not fsdp:
        stage_module.register_forward_pre_hook(_dtensors_from(model, named, placed, boxes, mesh["tp"]))
    if not trained:
        return LiveLlama(
            config, layout, mesh, model, None, adamw, timeout, runner, boxes, placed, named, head=head, gpu=gpu
        )
    optimizer = torch.optim.AdamW(named.values(), foreach=False, **adamw)
    for p in named.values():
        optimizer.state[p] = {
            "step": torch.tensor(0.0, dtype=torch.float32),
            "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
        }
    return LiveLlama(
        config, layout, mesh, model, optimizer, adamw, timeout, runner, boxes, placed, named, head=head, gpu=gpu
    )


def _dtensors_from(model: LlamaForCausalLM, named: dict, placed: dict, boxes: dict, tp: DeviceMesh):
    """A forward pre-hook that sets every TP-sharded weight of ``model`` to a DTensor view of its
    local parameter (the tensor DDP reduces and AdamW steps), for this forward.

    PyTorch's TP + DDP composition (``_pre_dp_module_transform``, which DDP applies on a dp
    sub-mesh) does the same in its own pre-hook, but finds the parameters through
    ``named_parameters()``, which no longer lists them once its first forward has replaced them
    by DTensor attributes: every later forward reuses the first forward's DTensors. If that
    forward ran under ``no_grad`` (generation, scoring), no gradient ever reaches the
    parameters. This hook runs after PyTorch's and rebuilds the views every forward."""
    views = []
    for name, p in named.items():
        if placed[name] is not None:
            owner, _, leaf = (PREFIX + name if not name.startswith("lm_head") else name).rpartition(".")
            shape = boxes[name][0]
            stride = torch.empty(shape, device="meta").stride()
            views.append((model.get_submodule(owner), leaf, p, placed[name], shape, stride))

    def hook(module, args):
        for owner, leaf, p, placements, shape, stride in views:
            if leaf in owner._parameters:
                delattr(owner, leaf)
            setattr(owner, leaf, DTensor.from_local(p, tp, placements, run_check=False, shape=shape, stride=stride))

    return hook


def batch(config: LlamaConfig, step: int, *, seed: int = 0, rows: int = 4, seq: int = 16) -> torch.Tensor:
    """The global batch of ``step``: ``rows`` x ``seq`` token ids, the same under every layout."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(0, config.vocab_size, (rows, seq), generator=g)


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor of a parameter, gradient or optimizer state (a DTensor's shard), as
    a detached view: writing it writes the live tensor."""
    return (t.to_local() if isinstance(t, DTensor) else t).detach()


def _schedule(live: LiveLlama, inputs: torch.Tensor, train: bool):
    """The pipeline schedule of this input shape (made on first use, on every rank of the stage
    group in the same order: every rank of a replica calls with the same shapes)."""
    key = (train, tuple(inputs.shape))
    if key not in live.schedules:
        n = live.layout.micro_batches
        if inputs.shape[0] % n:
            raise ValueError(
                f"{plural(inputs.shape[0], 'row')} do not split into {plural(n, 'micro-batch', 'micro-batches')}"
            )
        stage = PipelineStage(
            live.runner, live.coordinate[1], live.layout.pp, torch.device("cpu"), group=live.mesh["pp"].get_group()
        )
        live.schedules[key] = (
            Schedule1F1B(stage, n, loss_fn=lambda out, target: live.loss_fn(out, target))
            if train
            else ScheduleGPipe(stage, n)
        )
    return live.schedules[key]


def _from_last_stage(live: LiveLlama, t: torch.Tensor | None, shape, dtype) -> torch.Tensor:
    """``t`` (held by the last pipeline stage) on every stage of the replica."""
    if live.layout.pp == 1:
        return t
    if not live.last:
        t = torch.empty(shape, dtype=dtype)
    dist.broadcast(t, group_src=live.layout.pp - 1, group=live.mesh["pp"].get_group())
    return t


@torch.no_grad()
def forward(live: LiveLlama, ids: torch.Tensor) -> torch.Tensor:
    """The logits of ``ids`` ([rows, seq] -> [rows, seq, vocab], float32; [rows, seq, 1] for a
    value head) on every rank of this replica (every rank of it passes the same ids). Under PP a
    forward-only pipeline; the last stage's logits are broadcast to the others."""
    if live.layout.pp == 1:
        return live.runner(ids)
    out = _schedule(live, ids, train=False).step(ids)
    return _from_last_stage(live, out, (*ids.shape, live.out_features), torch.float32)


def optimize(live: LiveLlama, inputs: torch.Tensor, target: torch.Tensor, loss_fn) -> float:
    """One AdamW step on this replica's ``inputs`` (every rank of the replica passes the same
    ``inputs`` and ``target``); the loss, averaged over DP.

    ``loss_fn(logits, target)`` is a mean over the rows it is given: the whole replica batch
    without PP, each micro-batch (rows of ``inputs`` and ``target`` split alike) under PP, where
    ``Schedule1F1B`` averages the micro-batches' gradients. DDP averages gradients over DP.
    """
    if live.layout.pp == 1:
        loss = loss_fn(live.runner(inputs), target)
        loss.backward()
        total = loss.detach().clone()
    else:
        live.loss_fn = loss_fn
        losses: list[torch.Tensor] = []
        _schedule(live, inputs, train=True).step(inputs, target=target, losses=losses)
        total = _from_last_stage(live, torch.stack(losses).detach().mean() if live.last else None, (), torch.float32)
    if live.layout.dp > 1:
        dist.all_reduce(total, group=live.mesh["dp"].get_group())
        total.div_(live.layout.dp)
    live.optimizer.step()
    live.optimizer.zero_grad(set_to_none=True)
    return float(total)


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, the mean over every predicted position (Hugging Face's causal LM loss)."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


def train_step(live: LiveLlama, tokens: torch.Tensor) -> float:
    """One AdamW step of the language-model loss on the global batch ``tokens``; the mean loss.

    DP replica ``d`` of ``dp`` takes rows ``[d * n / dp, (d + 1) * n / dp)``; the loss is the
    average of the replicas' means (equal to the global mean: replicas take equal rows).
    """
    d = live.coordinate[0]
    dp = live.layout.dp
    rows = tokens.shape[0]
    if rows % dp:
        raise ValueError(f"a batch of {rows} rows does not split over DP {dp}")
    mine = tokens[d * rows // dp : (d + 1) * rows // dp]
    return optimize(live, mine, mine, lm_loss)
