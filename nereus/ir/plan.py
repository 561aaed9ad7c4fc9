"""A plan: the layout of every model-stage, what shares GPUs, what is offloaded."""

from __future__ import annotations

from dataclasses import dataclass, field

from .attributes import AttrSpec, RecordSpec, record
from .diagnostics import NOWHERE, Loc

OFFLOADABLE = ("weights", "grads", "optimizer")
# a training pipeline's schedules (``Layout.schedule``): Megatron's two, GPipe, and torch's zero-bubble two
PIPELINE_SCHEDULES = ("one_f_one_b", "interleaved", "gpipe", "zero_bubble", "zbv")


@dataclass(frozen=True)
class TimeBreakdown:
    """Seconds of one model-stage per step, by cause (``estimate``)."""

    compute: float = 0.0  # generation: decode while the batch is full
    prefill: float = 0.0
    tail: float = 0.0  # generation: decode while the batch drains (the longest responses)
    bubble: float = 0.0
    tp: float = 0.0
    pp: float = 0.0
    cp: float = 0.0  # context parallelism's ring-attention K/V exchange
    ep: float = 0.0  # expert parallelism's all-to-all dispatch and combine
    dp: float = 0.0
    optimizer: float = 0.0
    memory: float = 0.0  # HBM-bound decode
    offload: float = 0.0
    overhead: float = 0.0


@dataclass(frozen=True)
class MemoryBreakdown:
    """Peak bytes on the fullest GPU of one model-stage, by kind (``estimate``)."""

    weights: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0
    kv_cache: int = 0
    slack: int = 0  # held beyond what is counted (the cluster's memory_slack)
    resident: int = 0  # state of other model-stages kept on the same GPU


# what each component of ``time_breakdown`` and ``memory_breakdown`` holds (docs/IR.md, Breakdowns)
TIME_COMPONENTS = {
    "compute": "training and inference: the FLOPs of the forward (and backward, and recomputed forward) passes "
    "at the cluster's compute efficiency; generation: decode steps while the batch is full, when they are "
    "compute-bound",
    "prefill": "generation: the prompts' forward pass",
    "tail": "generation: decode steps while the batch drains, the longest responses running alone; its share of "
    "decode is (decode steps while draining) / (all decode steps), by continuous batching over "
    "response_len_dist; without response_len_dist every wave is taken to run to response_len_max, so the "
    "share is (response_len_max - response_len_mean) / response_len_max by construction",
    "bubble": "pipeline bubble: (pp - 1) / (micro_batches x vpp) of compute (1F1B, interleaved, GPipe); the "
    "zero-bubble schedules, a third of that (half with recompute): their weight gradients fill the rest",
    "tp": "tensor-parallel all-reduces (or reduce-scatter + all-gather with SP), bytes over the TP link plus "
    "their latency",
    "pp": "pipeline sends of activations (and their gradients) between stages",
    "cp": "context parallelism's ring-attention K/V exchange",
    "ep": "expert parallelism: all-to-all dispatch of each token to its top-k experts and combine back, per MoE "
    "layer and pass, over the EP group's link, plus its latency",
    "dp": "gradient reduction over the data-parallel replicas (and ZeRO-3's weight gathers), what compute does "
    "not hide",
    "optimizer": "the optimizer step, HBM-bound (Adam reads and writes 32 bytes per parameter of its shard)",
    "memory": "generation: decode steps while the batch is full, when they are HBM-bound (each step reads the "
    "weights and the KV cache)",
    "offload": "offloaded state moved to the host after the stage and back before its next use, over host_link",
    "overhead": "a fixed cost per layer and micro-batch (kernel launches, synchronisation), calibrated",
}
MEMORY_COMPONENTS = {
    "weights": "this model-stage's weights on the GPU (a ZeRO-3 shard)",
    "grads": "its gradients (ZeRO-2 and 3: a shard), in grad_dtype",
    "optimizer": "its optimizer state: fp32 master weights and Adam's two moments (ZeRO 1-3: a shard)",
    "activations": "training and inference: activations kept for the longest micro-batch a replica can see "
    "(Workload.longest_micro_batch_tokens: micro_batch x the longest sequences by response_len_dist and "
    "response_len_max, or the micro_batch_tokens budget), x the micro-batches in flight of the pipeline "
    "schedule (under full recomputation, each layer's input x the micro-batches in flight, and one layer's "
    "activations, recomputed for one micro-batch, once); generation: the logits of the running batch",
    "kv_cache": "generation: the KV cache of the sequences running at once, in vLLM's share of memory "
    "(gpu_memory_utilization 0.9, less the weights and the resident state)",
    "slack": "training and inference: what the GPU holds beyond the counted bytes above (allocator "
    "fragmentation, CUDA context, workspaces), (memory_slack - 1) x their sum; 0 until calibrate fits "
    "memory_slack to measured peaks",
    "resident": "state of other model-stages kept on the same GPU between their stages (weights; grads and "
    "optimizer state of trained ones), less what they offload",
}

TIME_BREAKDOWN = RecordSpec(
    "time", tuple(AttrSpec(f, "time", 0.0) for f in TimeBreakdown.__dataclass_fields__), TimeBreakdown
)
MEMORY_BREAKDOWN = RecordSpec(
    "memory", tuple(AttrSpec(f, "size", 0) for f in MemoryBreakdown.__dataclass_fields__), MemoryBreakdown
)


@dataclass(frozen=True)
class SearchRecord:
    """What plan-search reports: solver status, objective and bound (step time), relative gap."""

    status: str
    objective: float
    bound: float
    gap: float
    candidates: int
    estimate: float | None = None  # estimate's step time of the placed plan
    estimate_gap: float | None = None  # (objective - estimate) / estimate: the solver's model against estimate
    headroom: float | None = None  # fraction of GPU memory training and inference left free
    bottleneck: str | None = None  # the model-stage taking the largest share of the step
    unbounded: float | None = (
        None  # seconds (explain): the best step if model-stages sharing GPUs did not limit each other's memory
    )


SEARCH = RecordSpec(
    "search",
    (
        AttrSpec("status", "choice", choices=("optimal", "feasible")),
        AttrSpec("objective", "time"),
        AttrSpec("bound", "time"),
        AttrSpec("gap", "float"),
        AttrSpec("candidates", "posint"),
        AttrSpec("estimate", "time", default=None),
        AttrSpec("estimate_gap", "float", default=None),
        AttrSpec("headroom", "float", default=None),
        AttrSpec("bottleneck", "dotted", default=None),
        AttrSpec("unbounded", "time", default=None),
    ),
    SearchRecord,
)


@dataclass(frozen=True)
class RunnerUp:
    """plan-search's best plan whose layout of this model-stage has other TP, PP or DP sizes
    (``plan-search{explain=true}``): those sizes and that plan's step time in seconds."""

    tp: int
    pp: int
    dp: int
    step_time: float
    zero: int = 0


RUNNER_UP = RecordSpec(
    "runner_up",
    (
        AttrSpec("tp", "posint"),
        AttrSpec("pp", "posint"),
        AttrSpec("dp", "posint"),
        AttrSpec("step_time", "time"),
        AttrSpec("zero", "int", default=0),
    ),
    RunnerUp,
)


@dataclass(frozen=True)
class RemapRecord:
    """What ``remap`` did to a plan: the bytes its GPUs lack of plan B's state (the transition's
    lower bound) with the GPUs as written and as renamed, and how many GPUs were renamed."""

    before: int
    after: int
    gpus: int


REMAP = RecordSpec(
    "remap", (AttrSpec("before", "size"), AttrSpec("after", "size"), AttrSpec("gpus", "int")), RemapRecord
)

PLAN_ATTRS = [
    AttrSpec("workload", "symbol"),
    AttrSpec("cluster", "symbol"),
    AttrSpec(
        "colocate",
        "dotted_groups",
        default=[],
        doc="groups of model-stages of one stage that share GPUs and run one after another",
    ),
    AttrSpec("step_time", "time", default=None, doc="predicted time of one RL step (from estimate)"),
    record(
        "search",
        SEARCH,
        default=None,
        doc="set by plan-search: solver status, objective, bound, gap, candidates; estimate of the placed plan and "
        "(objective - estimate) / estimate; the memory headroom kept free; with explain=true the bottleneck "
        "model-stage and the best step time if model-stages sharing GPUs did not limit each other's memory (memory "
        "binds when lower)",
    ),
    record(
        "remap",
        REMAP,
        default=None,
        doc="set by remap: bytes to move with the GPUs as written and as renamed, GPUs renamed",
    ),
]

LAYOUT_ATTRS = [
    AttrSpec("tp", "posint"),
    AttrSpec("pp", "posint"),
    AttrSpec("dp", "posint"),
    AttrSpec("layers", "ranges", doc="layer range of each pipeline stage, e.g. [0..15, 16..31]"),
    AttrSpec("mesh", "ints", doc="GPU of each (dp, cp, pp, tp) coordinate, tp fastest"),
    AttrSpec("micro_batches", "posint", default=1, doc="micro-batches per pipeline flush"),
    AttrSpec("zero", "int", default=0, doc="ZeRO stage: shard optimizer (1), grads (2), weights (3) over DP"),
    AttrSpec(
        "recompute",
        "bool",
        default=False,
        doc="full activation recomputation (false keeps every activation but attention scores, which flash "
        "attention recomputes: what Megatron's selective recomputation keeps)",
    ),
    AttrSpec(
        "cp",
        "posint",
        default=1,
        doc="context parallelism: each sample's sequence split over cp GPUs (ring attention, load-balanced "
        "causal chunks); weights are replicated over CP as over DP, and ZeRO shards over dp x cp",
    ),
    AttrSpec(
        "sp", "bool", default=False, doc="sequence parallelism: activations outside the TP-split GEMMs sharded over TP"
    ),
    AttrSpec(
        "tp_overlap",
        "bool",
        default=False,
        doc="TP communication overlapped with the GEMMs it feeds (Megatron's --tp-comm-overlap, torchtitan's "
        "async TP): each GEMM runs in tp chunks beside the ring steps of the others, so all but one chunk's "
        "traffic hides as far as the GEMMs last; needs sp",
    ),
    AttrSpec(
        "pp_overlap",
        "bool",
        default=None,
        doc="pipeline sends beside compute: a rank posts its sends and receives and computes on, waiting only "
        "for data it needs (Megatron's overlap_p2p_comm, which Megatron-LM and verl turn on for the interleaved "
        "schedule; torch.distributed.pipelining's schedules, which wait for their sends at the step's end); "
        "false: a rank waits for each send to complete (Megatron's 1F1B). Default: off for 1F1B, on for the "
        "other schedules",
    ),
    AttrSpec(
        "dp_overlap",
        "bool",
        default=True,
        doc="data-parallel communication beside compute: gradient buckets reduce during the backward and, under "
        "ZeRO-3, each layer's weights are gathered ahead of it (FSDP2's prefetch; Megatron's --overlap-grad-reduce "
        "and --overlap-param-gather); false: the reduction after the backward, each gather before its layer runs",
    ),
    AttrSpec(
        "vpp",
        "posint",
        default=1,
        doc="virtual pipeline stages per PP rank (interleaved 1F1B); divides each rank's layers",
    ),
    AttrSpec(
        "schedule",
        "choice",
        default=None,
        choices=PIPELINE_SCHEDULES,
        doc="a training pipeline's schedule (default: one_f_one_b, or interleaved where vpp > 1, as Megatron "
        "runs them): gpipe (every forward, then every backward); one_f_one_b (1F1B, PipeDream-Flush); "
        "interleaved (interleaved 1F1B over vpp chunks); zero_bubble (torch's InterleavedZeroBubble, ZB1P: the "
        "weight gradients fill the bubble; ZB-H1 where vpp = 1); zbv (torch's ZBVZeroBubble: vpp = 2 in a V)",
    ),
    AttrSpec(
        "ep",
        "posint",
        default=1,
        doc="expert parallelism (a mixture of experts): the routed experts split over ep ranks, carved from "
        "dp x cp x tp as Megatron does (expert ranks ordered etp, ep, expert-dp; tokens reach their experts by "
        "all-to-all)",
    ),
    AttrSpec(
        "etp",
        "posint",
        default=None,
        doc="expert tensor parallelism: the TP size of each routed expert (Megatron's "
        "--expert-tensor-parallel-size; default tp); divides tp",
    ),
    AttrSpec(
        "fp8",
        "bool",
        default=False,
        doc="GEMMs in FP8 (Transformer Engine) against the cluster's peak_flops_fp8, with their casts; "
        "attention and the LM head stay bf16",
    ),
    AttrSpec(
        "attention",
        "choice",
        default="flash",
        choices=("flash", "materialized", "recomputed"),
        doc="the attention core: flash (FlashAttention: no s x s scores in HBM); materialized (each head's "
        "scores written, softmaxed and read back in HBM and kept for the backward, as Megatron-LM ran before "
        "FlashAttention); recomputed (materialized, not kept: selective recomputation redoes them in the "
        "backward); training and inference",
    ),
    AttrSpec(
        "grad_dtype",
        "choice",
        default="bf16",
        choices=("bf16", "fp32"),
        doc="gradient buffer dtype (fp32: Megatron's and DeepSpeed's main grads under bf16)",
    ),
    AttrSpec("offload", "names", default=[], choices=OFFLOADABLE, doc="state moved to host memory after the stage"),
    AttrSpec("time", "time", default=None, doc="predicted time of the model-stage (from estimate)"),
    AttrSpec("memory", "size", default=None, doc="predicted peak memory per GPU (from estimate)"),
    record("time_breakdown", TIME_BREAKDOWN, default=None, doc="estimate's time by cause"),
    record("memory_breakdown", MEMORY_BREAKDOWN, default=None, doc="estimate's memory by kind, on the fullest GPU"),
    record(
        "runner_up",
        RUNNER_UP,
        default=None,
        doc="set by plan-search{explain=true}: the best plan with other TP/PP/DP sizes for this model-stage, and its "
        "step time",
    ),
]


@dataclass(kw_only=True)
class Layout:
    """The parallel layout of one model-stage (``layout actor.train { tp = 4, ... }``): its
    GPUs are ``mesh``, dp x cp x pp x tp of them in (dp, cp, pp, tp) order with tp fastest.
    ``time`` is seconds per step and ``memory`` bytes per GPU at the peak (``estimate``)."""

    model_stage: str  # "actor.train": model, then stage
    tp: int  # tensor-parallel size
    pp: int  # pipeline stages
    dp: int  # data-parallel replicas
    layers: list[tuple[int, int]]  # inclusive layer range of each pipeline stage
    mesh: list[int]  # GPU ids, len == dp x cp x pp x tp
    micro_batches: int = 1  # per pipeline flush
    zero: int = 0  # ZeRO stage over dp x cp: 1 optimizer, 2 + grads, 3 + weights
    recompute: bool = False  # full activation recomputation
    cp: int = 1  # context-parallel size
    sp: bool = False  # sequence parallelism
    tp_overlap: bool = False  # TP communication overlapped with the GEMMs (Megatron's --tp-comm-overlap)
    pp_overlap: bool | None = None  # pipeline sends beside compute; None: by schedule (``pp_overlapped``)
    dp_overlap: bool = True  # gradient reduction and ZeRO-3 gathers beside compute
    vpp: int = 1  # virtual pipeline stages per PP rank
    schedule: str | None = None  # pipeline schedule (PIPELINE_SCHEDULES); None: Megatron's by vpp
    ep: int = 1  # expert parallelism: routed experts split over ep ranks
    etp: int | None = None  # each routed expert's TP size (None: tp)
    fp8: bool = False  # FP8 GEMMs
    attention: str = "flash"  # flash | materialized | recomputed (ATTENTION_KINDS)
    grad_dtype: str = "bf16"  # bf16 | fp32
    offload: list[str] = field(default_factory=list)  # weights | grads | optimizer, kept in host memory between stages
    time: float | None = None  # seconds per step (estimate)
    memory: int | None = None  # peak bytes on its fullest GPU (estimate)
    time_breakdown: TimeBreakdown | None = None
    memory_breakdown: MemoryBreakdown | None = None
    runner_up: RunnerUp | None = None
    loc: Loc = field(default=NOWHERE, compare=False, repr=False)
    locs: dict[str, Loc] = field(default_factory=dict, compare=False, repr=False)
    comments: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def model(self) -> str:
        return self.model_stage.rpartition(".")[0]

    @property
    def stage(self) -> str:
        return self.model_stage.rpartition(".")[2]

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.pp * self.tp

    @property
    def megatron_schedule(self) -> str:
        """The schedule Megatron runs this layout with: ``interleaved`` where ``vpp`` > 1, else ``one_f_one_b``."""
        return "interleaved" if self.vpp > 1 else "one_f_one_b"

    @property
    def pp_overlapped(self) -> bool:
        """``pp_overlap``, or where unset what the schedule's runtime does: off for 1F1B (Megatron's
        waits for each send), on for the rest (Megatron-LM overlaps the interleaved schedule's
        sends by default, and verl sets it where vpp > 1; torch's schedules post their sends and
        wait for them at the step's end)."""
        return self.pipeline_schedule != "one_f_one_b" if self.pp_overlap is None else self.pp_overlap

    @property
    def pipeline_schedule(self) -> str:
        """``schedule``, or Megatron's where unset."""
        return self.schedule or self.megatron_schedule

    @property
    def replicas(self) -> int:
        """Copies of the model's state: ``dp x cp`` (a CP rank holds what its DP replica holds,
        and ZeRO shards over all of them). State coordinates index replicas ``d x cp + c``."""
        return self.dp * self.cp

    def gpu(self, dp: int, pp: int, tp: int) -> int:
        """The GPU at state coordinate (replica, pp, tp); tp varies fastest, then pp, then the
        replica (``d x cp + c`` for DP rank d and CP rank c)."""
        return self.mesh[(dp * self.pp + pp) * self.tp + tp]

    @property
    def expert_tp(self) -> int:
        """Each routed expert's TP size: ``etp``, or ``tp`` when unset."""
        return self.etp if self.etp is not None else self.tp

    @property
    def expert_dp(self) -> int:
        """Copies of each expert slice in a pipeline stage: ``dp x cp x tp / (etp x ep)`` (ZeRO
        shards the experts' state over them)."""
        return self.replicas * self.tp // (self.expert_tp * self.ep)

    @property
    def carves_experts(self) -> bool:
        """Whether the experts are split otherwise than the dense layers (``ep > 1`` or ``etp != tp``)."""
        return self.ep > 1 or self.expert_tp != self.tp

    def expert_rank(self, replica: int, tp: int) -> tuple[int, int, int]:
        """(EP rank, ETP rank, expert-DP rank) of the GPU at (``replica``, ``tp``) of a pipeline
        stage. Megatron orders a stage's ranks tp fastest, then cp, then dp (rank ``tp + tp_size x
        replica``) and carves the expert groups from them etp fastest, then ep, then expert-dp."""
        r = tp + self.tp * replica
        etp = self.expert_tp
        return (r // etp) % self.ep, r % etp, r // (etp * self.ep)

    def coords(self):
        """Every (replica, pp, tp) coordinate, in mesh order."""
        for d in range(self.replicas):
            for p in range(self.pp):
                for t in range(self.tp):
                    yield d, p, t


@dataclass(kw_only=True)
class Plan:
    """How a workload runs on a cluster (``plan @p { ... }``): one ``Layout`` per model-stage
    (``actor.train``), and which model-stages of one stage share GPUs and run one after another
    (``colocate``). ``step_time`` is seconds (``estimate``)."""

    name: str  # without the @
    workload: str
    cluster: str
    colocate: list[list[str]] = field(default_factory=list)  # groups of model-stages of one stage
    step_time: float | None = None  # seconds per RL step (estimate): stages in order, colocated groups in series
    search: SearchRecord | None = None  # set by plan-search
    remap: RemapRecord | None = None  # set by remap
    layouts: dict[str, Layout] = field(default_factory=dict)  # model-stage -> layout
    loc: Loc = field(default=NOWHERE, compare=False, repr=False)
    locs: dict[str, Loc] = field(default_factory=dict, compare=False, repr=False)
    comments: dict = field(default_factory=dict, compare=False, repr=False)

    def shares(self, a: str, b: str) -> bool:
        return any(a in g and b in g for g in self.colocate)
