"""The cost model: time and per-GPU memory of a model-stage under a layout.

Every time is a sum of *features* (seconds at 100% of a peak, or a count) times a
*coefficient* (1 / achieved fraction of that peak, or seconds per count), plus fixed link
latencies. That linear form is what ``calibrate`` fits with non-negative least squares:

    time = F[:, compute] / eff.compute + F[:, hbm] / eff.hbm + F[:, nvlink] / eff.nvlink
         + F[:, nic] / eff.nic + F[:, pcie] / eff.pcie + F[:, overhead] * eff.overhead + latency

All functions take arrays of candidate layouts of one model-stage and return arrays, so the
plan search can score thousands of layouts in one call; a single layout is an array of one.

Formulas (h hidden, L layers, V vocab, s sequence length, q = heads x head_dim, k = kv_heads x
head_dim, f ffn, t TP, p PP, d DP, m micro-batches per flush):

- FLOPs per token and layer, forward: ``2h(q + 2k) + 2qh`` (projections) ``+ 2 n h f`` (MLP,
  n = 3 gated or 2 plain) ``+ 4 q s`` (scores and weighted sum over s positions, Megatron's
  convention); LM head ``2hV``. Training is 3x forward (4x for layers with activation
  recomputation); with GPT shapes this is exactly Narayanan et al. (SC'21), eq. (3).
- Pipeline bubble of 1F1B (and GPipe): ``(p - 1) / m`` of the ideal time extra, i.e. a fraction
  ``(p - 1) / (m + p - 1)`` of the total; interleaved over ``v`` chunks, a ``v``-th of it. The
  zero-bubble schedules (torch's ``zero_bubble`` and ``zbv``) split the backward into the input
  gradient ``I`` and the weight gradient ``W`` (each as long as the forward ``F``; ``I`` holds
  the recomputed forward too) and fill the bubble with ``W``: ``(p - 1) (F + I - W) / (m v (F +
  I + W))``, a third of the interleaved bubble without recomputation and half with it (Qi et al.
  2024, ZB-H1's ``(p - 1)(F + B - W)``). With fewer micro-batches than stages (``2 p - 1`` for
  ZBV) there is little to fill: 1F1B's bubble is charged (an upper bound of torch's). Activations in flight: ``min(p,
  m)`` micro-batches (1F1B; interleaved ``1 + (p - 1) / (p v)`` times as many), ``m`` (GPipe), or
  ``((v - 1) r + min(p, r)) / v`` of ``r`` micro-batches per round (zero bubble, on every rank),
  ``min(p, m)`` on every rank (ZBV).
- TP: ring all-reduce of ``h`` activations per token, 2 per layer forward and 2 backward
  (2 more with recomputation), ``2 (t - 1) / t`` of the bytes per GPU, on NVLink when the TP
  group is inside a node. With ``tp_overlap`` (Megatron's ``--tp-comm-overlap``) each GEMM runs
  in ``t`` chunks beside the ring steps of the others: at most ``(t - 1) / t`` of the traffic
  hides, and no more than the layers' GEMMs last. PP: activations and their gradients point to point per micro-batch;
  posted beside compute (``pp_overlap``: by default under every schedule but 1F1B), training's
  steady-state sends hide as far as the compute lasts, and each flush's fill and drain (``p v -
  1`` hops each way) wait.
  DP: gradient all-reduce (ZeRO 0-2; reduce-scatter plus all-gather moves the same bytes) per
  optimizer step, and ZeRO-3's parameter all-gathers per micro-batch, hidden behind the compute
  beside them (``efficiency.overlap`` of it at most) unless ``dp_overlap`` is false.
- Generation (vLLM-like): prefill is compute-bound; each decode step reads the weights and the
  live KV cache from HBM (all pipeline stages in turn: PP saves memory, not step time), or is
  compute-bound when the batch is large; sequences run
  in waves when the KV cache cannot hold them all, and a wave lasts as long as its longest
  response. KV cache per token and GPU: ``2 x layers x kv_heads x head_dim x bytes / TP``.
- CP (training and inference): each sample's tokens split over ``c`` ranks, compute,
  activations, TP and PP traffic divided by ``c``; ring attention passes the other chunks' K/V
  (their gradients too in backward), charged in series; gradients reduce and ZeRO shards over
  ``d x c`` replicas.
- Expert parallelism (a mixture of experts, ``ep`` and ``etp``): a GPU holds ``E / ep`` experts,
  each split over ``etp`` ranks, and ZeRO shards them (and their gradients reduce) over the
  ``d x c x t / (ep x etp)`` expert-DP ranks. Each MoE layer dispatches every token to its top-k
  experts and combines them back by all-to-all over the EP group (Megatron's alltoall
  dispatcher): ``(ep - 1) / ep`` of ``k`` hidden vectors per token leave a GPU each way, per
  forward and backward pass, its replica's tokens split over TP (sequence parallel, which
  Megatron requires for MoE with TP). Uneven routing stretches the experts' GEMMs and the
  all-to-all by ``efficiency.expert_imbalance`` (the busiest EP rank's tokens per mean; 1 until
  calibrated). TP's all-reduces are charged as for a dense layer.
  A decode step reads the experts its batch touches among the GPU's own. A vLLM engine's EP over
  its own TP ranks adds no all-to-all: the TP all-reduce combines the experts' outputs.
- Memory: bf16 weights and grads plus fp32 master and Adam moments (16 bytes per parameter,
  ZeRO's count), divided over DP by the ZeRO stage; activations per micro-batch with flash
  attention and no sequence parallelism (Korthikanti et al. 2022, adapted to SwiGLU/GQA),
  ``min(p, m)`` micro-batches in flight; fp32 logits; the KV cache. Training and inference hold
  ``memory_slack`` times what is counted (allocator, context, workspaces; 1 until calibrated).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, cast

import numpy as np

from ...ir import Cluster, Layout, Model, Workload
from ...ir.cluster import Efficiency
from ...ir.plan import PIPELINE_SCHEDULES

COEFFS = ("compute", "hbm", "nvlink", "nic", "pcie", "overhead")
C_COMPUTE, C_HBM, C_NVLINK, C_NIC, C_PCIE, C_OVERHEAD = range(6)
NVLINK, NIC = 0, 1
ONE_F_ONE_B, INTERLEAVED = PIPELINE_SCHEDULES.index("one_f_one_b"), PIPELINE_SCHEDULES.index("interleaved")
GPIPE, ZERO_BUBBLE, ZBV = (PIPELINE_SCHEDULES.index(x) for x in ("gpipe", "zero_bubble", "zbv"))
assert max(ONE_F_ONE_B, INTERLEAVED) < GPIPE < ZERO_BUBBLE < ZBV  # ``_stage`` compares the codes
VLLM_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default share of GPU memory it may use
ACT_BYTES = 2  # activations in bf16
# FP8 GEMMs (Transformer Engine), from its "GEMM Speedups Across Precisions" benchmark of a 5B
# model's twelve GEMMs a layer (hidden 4096, FFN 16384, 15,872 tokens) on H200 NVL, whose FP8 peak
# is twice its bf16 one: with the operands already in FP8 they ran 1.90x as fast as in bf16, so an
# FP8 GEMM reaches 0.95 of the fraction of its peak a bf16 one reaches of its own; quantizing the
# operands as training does (delayed scaling) brought that to 1.69x. The casts are memory-bound:
# each GEMM's input activations forward and output gradients backward are read in bf16 and
# written in FP8 with a transposed copy, with their scaling; at this model's priors TE's gap
# between the two figures is 8 bytes of HBM traffic per element cast (reproduced in
# tests/passes/test_fp8_gemms.py). Neither number was chosen with a training figure in view.
FP8_KERNEL_EFFICIENCY = 0.95
FP8_CAST_BYTES = 8.0
# the attention core (``Layout.attention``): FlashAttention keeps each head's s x s scores in
# on-chip memory; without it they cross HBM in bf16, forward 7 bytes an element (QK^T writes
# them; Megatron's causal softmax kernel, scaled_upper_triang_masked_softmax, reads only the
# lower triangle and writes whole rows; the weighted sum reads them), backward 12 (the weighted
# sum's gradient reads them and writes theirs, softmax's reads both in the lower triangle and
# writes one, QK^T's two gradient GEMMs read it), each recomputed forward 7 more.
ATTENTION_KINDS = ("flash", "materialized", "recomputed")
FLASH, MATERIALIZED, RECOMPUTED = range(3)
SCORE_BYTES_FORWARD, SCORE_BYTES_BACKWARD = 7.0, 12.0
# dropout on the attention weights in training (``Model.attention_dropout``) outside FlashAttention,
# which draws its mask inside the kernel. Megatron-LM's ``torch.nn.Dropout`` reads the softmax
# output and writes a one-byte mask and the dropped weights (5 bytes an element each forward); its
# backward reads the mask and the incoming gradient and writes the gradient (5); the weighted sum
# then reads the dropped weights where it read the softmax output. The mask and the dropped weights
# are kept beside the softmax output (3 bytes an element more: Korthikanti et al. 2022's 5as^2b).
DROPOUT_BYTES_FORWARD, DROPOUT_BYTES_BACKWARD, DROPOUT_BYTES_KEPT = 5.0, 5.0, 3.0


def coefficient_vector(eff: Efficiency) -> np.ndarray:
    return np.array([1 / eff.compute, 1 / eff.hbm, 1 / eff.nvlink, 1 / eff.nic, 1 / eff.pcie, eff.overhead])


def efficiency_from_vector(x: np.ndarray, prior: Efficiency) -> Efficiency:
    inv = [
        1 / v if v > 0 else p for v, p in zip(x[:5], (prior.compute, prior.hbm, prior.nvlink, prior.nic, prior.pcie))
    ]
    # the fitted coefficients; the prior's other fields (overlap, gemm_knee, ...) kept
    return replace(
        prior,
        **dict(zip(("compute", "hbm", "nvlink", "nic", "pcie"), (float(v) for v in inv))),
        overhead=float(x[5]),
    )


def mesh_links(nodes: np.ndarray) -> tuple[int, int, int, int]:
    """The links of a layout's groups from its GPUs' nodes (``replicas x pp x tp``, as
    ``Layout.gpu`` places them): TP (the tp ranks of one replica and stage), PP (neighbouring
    stages) and DP (every replica), each ``NVLINK`` or ``NIC``, and how many members of GPU 0's DP
    group share its node (NCCL runs a ring's channels through each of their NICs)."""

    def link(crosses: np.ndarray) -> int:
        return NIC if np.any(crosses) else NVLINK

    return (
        link(nodes != nodes[:, :, :1]),
        link(nodes[:, 1:, :] != nodes[:, :-1, :]),
        link(nodes != nodes[:1]),
        int(np.sum(nodes[:, 0, 0] == nodes[0, 0, 0])),
    )


@dataclass
class Candidates:
    """Layouts of one model-stage as arrays (length n)."""

    tp: np.ndarray
    pp: np.ndarray
    dp: np.ndarray
    micro_batches: np.ndarray
    recompute: np.ndarray
    zero: np.ndarray
    first_layers: np.ndarray  # layers on pipeline stage 0
    last_layers: np.ndarray  # layers on the last stage
    max_layers: np.ndarray  # layers on the fullest stage
    tp_link: np.ndarray  # NVLINK or NIC
    pp_link: np.ndarray
    dp_link: np.ndarray
    resident: np.ndarray = field(default=cast(np.ndarray, None))  # bytes other model-stages keep on the GPU
    sp: np.ndarray = field(default=cast(np.ndarray, None))  # sequence parallelism
    vpp: np.ndarray = field(default=cast(np.ndarray, None))  # virtual pipeline stages per rank
    grad_bytes: np.ndarray = field(default=cast(np.ndarray, None))  # bytes per gradient (2: bf16, 4: fp32 main grads)
    fp8: np.ndarray = field(default=cast(np.ndarray, None))  # GEMMs in FP8
    cp: np.ndarray = field(default=cast(np.ndarray, None))  # context parallelism: ranks splitting each sequence
    cp_link: np.ndarray = field(default=cast(np.ndarray, None))
    ep: np.ndarray = field(default=cast(np.ndarray, None))  # expert parallelism: experts split over ep ranks
    etp: np.ndarray = field(default=cast(np.ndarray, None))  # each expert's TP size (default: tp)
    ep_link: np.ndarray = field(default=cast(np.ndarray, None))  # the EP group's all-to-all link
    ep_local: np.ndarray = field(default=cast(np.ndarray, None))  # EP group members on a GPU's node (itself included)
    schedule: np.ndarray = field(default=cast(np.ndarray, None))  # index into PIPELINE_SCHEDULES (default: by vpp)
    tp_overlap: np.ndarray = field(default=cast(np.ndarray, None))  # TP communication overlapped with the GEMMs
    pp_overlap: np.ndarray = field(default=cast(np.ndarray, None))  # pipeline sends beside compute (default: not 1F1B)
    dp_overlap: np.ndarray = field(default=cast(np.ndarray, None))  # DP communication beside compute (default: on)
    attention: np.ndarray = field(default=cast(np.ndarray, None))  # index into ATTENTION_KINDS (default: flash)
    dp_local: np.ndarray = field(default=cast(np.ndarray, None))  # DP group members on a GPU's node (itself included)

    def __post_init__(self):
        n = len(self.tp)
        if self.etp is None:
            self.etp = np.asarray(self.tp, dtype=np.int64)
        if self.ep_link is None:
            self.ep_link = np.asarray(self.tp_link)
        if self.ep_local is None:  # every member on one node, unless the link says otherwise
            self.ep_local = np.where(np.asarray(self.ep_link) == NVLINK, np.asarray(self.ep), 1)
        for name, value, dtype in (
            ("ep", 1, np.int64),
            ("etp", 1, np.int64),
            ("ep_link", NVLINK, np.int64),
            ("ep_local", 1, np.int64),
            ("resident", 0.0, float),
            ("sp", False, bool),
            ("tp_overlap", False, bool),
            ("dp_overlap", True, bool),
            ("attention", FLASH, np.int64),
            ("dp_local", 1, np.int64),
            ("vpp", 1, np.int64),
            ("grad_bytes", 2, float),
            ("fp8", False, bool),
            ("cp", 1, np.int64),
            ("cp_link", NVLINK, np.int64),
        ):
            v = getattr(self, name)
            setattr(
                self,
                name,
                np.full(n, value, dtype=dtype) if v is None else np.broadcast_to(np.asarray(v, dtype=dtype), (n,)),
            )

        if self.schedule is None:  # Megatron's: interleaved where vpp > 1, else 1F1B
            self.schedule = np.where(self.vpp > 1, INTERLEAVED, ONE_F_ONE_B)
        self.schedule = np.broadcast_to(np.asarray(self.schedule, dtype=np.int64), (n,))
        if self.pp_overlap is None:  # as the schedule runs: sends waited on under 1F1B alone
            self.pp_overlap = self.schedule != ONE_F_ONE_B
        self.pp_overlap = np.broadcast_to(np.asarray(self.pp_overlap, dtype=bool), (n,))

    def __len__(self) -> int:
        return len(self.tp)

    @classmethod
    def grid(
        cls,
        cluster: Cluster,
        layers: int,
        tp,
        pp,
        dp,
        micro_batches=1,
        recompute=False,
        zero=0,
        sp=False,
        vpp=1,
        grad_bytes=2,
        cp=1,
        ep=1,
        etp=None,
    ) -> "Candidates":
        """Candidates placed canonically (tp fastest on consecutive GPUs, then pp, cp, dp), layers
        split by tensor_split's rule; ``etp`` None: each expert split as TP splits a dense MLP."""
        tp, pp, dp, mb, rc, z, sp, vpp, gb, cp, ep, etp = np.broadcast_arrays(
            *(
                np.atleast_1d(v)
                for v in (
                    tp,
                    pp,
                    dp,
                    micro_batches,
                    recompute,
                    zero,
                    sp,
                    vpp,
                    grad_bytes,
                    cp,
                    ep,
                    tp if etp is None else etp,
                )
            )
        )
        tp, pp, dp, cp = tp.astype(np.int64), pp.astype(np.int64), dp.astype(np.int64), cp.astype(np.int64)
        ep, etp = ep.astype(np.int64), etp.astype(np.int64)
        g = cluster.gpus_per_node
        # an EP group: ranks etp apart in a stage's (tp fastest, then cp, dp) order; beyond one TP
        # group it spans ep x etp / tp replicas, pp x tp GPUs apart under canonical placement
        ep_span = np.where(ep * etp <= tp, tp, (ep * etp // np.maximum(tp, 1) - 1) * pp * tp + tp)
        if np.all(ep == 1):  # no expert parallelism (every dense model): nothing to carve
            ep_local = np.ones(len(tp), dtype=np.int64)
        else:  # per distinct (tp, pp, ep, etp): a few among the candidates
            combos = np.stack([tp, pp, ep, etp], axis=1)
            distinct, which = np.unique(combos, axis=0, return_inverse=True)
            local = [_ep_local(int(a), int(b), int(c), int(d), g) for a, b, c, d in distinct]
            ep_local = np.array(local, dtype=np.int64)[which.reshape(-1)]
        first = -(-layers // pp)  # tensor_split's rule: the first layers % pp stages hold one more
        last = np.where(pp == 1, layers, layers // pp)
        return cls(
            tp=tp,
            pp=pp,
            dp=dp,
            micro_batches=mb.astype(np.int64),
            recompute=rc.astype(bool),
            zero=z.astype(np.int64),
            first_layers=first,
            last_layers=last,
            max_layers=first,
            tp_link=np.where(tp <= g, NVLINK, NIC),
            pp_link=np.where(tp * pp <= g, NVLINK, NIC),
            dp_link=np.where(tp * pp * cp * dp <= g, NVLINK, NIC),
            dp_local=np.clip(g // (tp * pp), 1, dp * cp),  # replicas sit tp x pp GPUs apart
            resident=np.zeros(len(tp)),
            sp=sp,
            vpp=vpp,
            grad_bytes=gb,
            cp=cp,
            cp_link=np.where(tp * pp * cp <= g, NVLINK, NIC),
            ep=ep,
            etp=etp,
            ep_link=np.where(ep_span <= g, NVLINK, NIC),
            ep_local=ep_local,
        )

    @classmethod
    def of_layout(cls, cluster: Cluster, layout: Layout, resident: float = 0.0) -> "Candidates":
        """One explicit layout: its layer ranges, and links from where its mesh puts the GPUs."""
        lay = layout
        # every GPU's node at its state coordinate (replica, pp, tp), as ``Layout.gpu`` places it;
        # a group of GPUs spans nodes where any of its nodes differs from its first
        world = lay.replicas * lay.pp * lay.tp
        nodes = (np.asarray(lay.mesh[:world], dtype=np.int64) // cluster.gpus_per_node).reshape(
            lay.replicas, lay.pp, lay.tp
        )

        # gradients reduce over every replica, DP and CP (state coordinate d x cp + c)
        tp_link, pp_link, dp_link, dp_local = mesh_links(nodes)
        by_cp = nodes.reshape(lay.dp, lay.cp, lay.pp, lay.tp)
        cp_link = NIC if np.any(by_cp != by_cp[:, :1]) else NVLINK
        ep_link, ep_local = ep_placement(nodes, lay.ep, lay.expert_tp)
        sizes = [hi - lo + 1 for lo, hi in lay.layers]
        a = lambda v: np.array([v])
        return cls(
            tp=a(lay.tp),
            pp=a(lay.pp),
            dp=a(lay.dp),
            micro_batches=a(lay.micro_batches),
            recompute=a(lay.recompute),
            zero=a(lay.zero),
            first_layers=a(sizes[0]),
            last_layers=a(sizes[-1]),
            max_layers=a(max(sizes)),
            tp_link=a(tp_link),
            pp_link=a(pp_link),
            dp_link=a(dp_link),
            resident=a(float(resident)),
            sp=a(lay.sp),
            vpp=a(lay.vpp),
            grad_bytes=a(4.0 if lay.grad_dtype == "fp32" else 2.0),
            fp8=a(lay.fp8),
            cp=a(lay.cp),
            cp_link=a(cp_link),
            ep=a(lay.ep),
            etp=a(lay.expert_tp),
            ep_link=a(ep_link),
            ep_local=a(ep_local),
            schedule=a(PIPELINE_SCHEDULES.index(lay.pipeline_schedule)),
            tp_overlap=a(lay.tp_overlap),
            pp_overlap=a(lay.pp_overlapped),
            dp_overlap=a(lay.dp_overlap),
            attention=a(ATTENTION_KINDS.index(lay.attention)),
            dp_local=a(dp_local),
        )


def ep_placement(nodes: np.ndarray, ep: int, etp: int) -> tuple[int, int]:
    """(link code, members on the first GPU's node) of the EP groups of a layout whose GPUs sit on
    ``nodes`` (replicas x pp x tp, as ``Layout.gpu`` places them): an EP group is the GPUs of one
    pipeline stage with the same expert-DP and ETP ranks (``Layout.expert_rank``); it crosses the
    NIC when some group spans nodes. (NVLink, 1) without expert parallelism."""
    if ep <= 1:
        return NVLINK, 1
    replicas, _, tp = nodes.shape
    r = np.arange(replicas * tp)
    d, t = r // tp, r % tp
    group = (r // (etp * ep)) * etp + r % etp  # (expert-DP rank, ETP rank) as one number
    on = nodes[d, :, t]  # (ranks, pp): each rank's node at every pipeline stage
    crosses = False
    for g in np.unique(group):
        members = on[group == g]
        crosses = crosses or bool(np.any(members.max(axis=0) != members.min(axis=0)))
    local = int(np.sum((group == group[0]) & (on[:, 0] == on[0, 0])))
    return (NIC if crosses else NVLINK), local


def _ep_local(tp: int, pp: int, ep: int, etp: int, per_node: int) -> int:
    """Members of an EP group on its first GPU's node under canonical placement: a stage's ranks
    ``r = t + tp x replica`` sit on GPU ``(replica x pp) x tp + t``; the group is ranks ``0, etp,
    2 etp, ...``."""
    gpu = lambda r: (r // tp) * pp * tp + r % tp
    return sum(1 for j in range(ep) if gpu(j * etp) // per_node == 0)


def hidden(comm: np.ndarray, window: np.ndarray, share, coeffs: np.ndarray) -> np.ndarray:
    """The features of ``comm`` that a ``window`` of compute beside it hides, at most ``share`` of
    it (a number, or one per candidate): ``min(share x comm, window)`` in seconds under ``coeffs``,
    so that ``max((1 - share) x comm, comm - window)`` stays exposed."""
    c, w = comm @ coeffs, window @ coeffs
    share = np.broadcast_to(np.asarray(share, dtype=float), c.shape)
    share_bound = (1 - share) * c >= c - w
    return np.where(share_bound[:, None], share[:, None] * comm, window)


@dataclass
class StageCost:
    """Per-candidate results: features (n x 6), fixed latency (n), memory components (n each)."""

    features: np.ndarray
    latency: np.ndarray
    weights: np.ndarray
    grads: np.ndarray
    optimizer: np.ndarray
    activations: np.ndarray
    kv_cache: np.ndarray
    resident_state: np.ndarray  # what this model-stage keeps on a GPU between stages (bytes)
    parts: dict[str, tuple[Any, np.ndarray]]  # breakdown name -> (coefficient column, or one per candidate, feature)
    waits: dict[str, np.ndarray]  # breakdown name -> fixed latency (part of ``latency``)
    decode: tuple | None = None  # (compute feature, hbm feature, draining share) of generation's decode
    overlap: tuple | None = None  # (DP comm features n x 6, compute window features n x 6, hidden share)
    # the same for TP communication beside its GEMMs, the share per candidate
    tp_overlap: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    # the same for pipeline sends beside the compute (``pp_overlap``)
    pp_overlap: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    # (features n x 6 of the experts' GEMMs and all-to-all under EP, by breakdown entry; the busiest
    # EP rank's load per mean): the time adds (factor - 1) x those features
    imbalance: tuple | None = None
    # (features n x 6 of the GEMMs' shapes per unit of ``Efficiency.gemm_knee``, the knee, the knee
    # ``features`` hold): calibrate's grid sets the knee, and the time adds the difference's features
    shape: tuple[np.ndarray, float, float] | None = None
    slack: float = 1.0  # peak bytes held per byte counted (``Efficiency.memory_slack``; 1 for generation)

    def time(self, coeffs: np.ndarray) -> np.ndarray:
        return self.features_for(coeffs) @ coeffs + self.latency

    def features_for(self, coeffs: np.ndarray) -> np.ndarray:
        """Features with generation's decode assigned to its binding resource under ``coeffs``,
        and data-parallel communication less what the compute beside it hides: of ``comm``
        seconds beside a ``window`` of compute, ``max((1 - overlap) x comm, comm - window)``
        stay exposed (both linear in the coefficients once the case is chosen)."""
        reshaped = self.shape is not None and self.shape[1] != self.shape[2]
        hides = self.hides()
        if self.decode is None and self.imbalance is None and not hides and not reshaped:
            return self.features
        f = self.features.copy()
        if reshaped:
            per_knee, knee, built = cast(tuple, self.shape)
            f += (knee - built) * per_knee
        if self.imbalance is not None:
            f += (self.imbalance[1] - 1.0) * sum(self.imbalance[0].values())
        if self.decode is not None:
            comp, mem, _ = self.decode
            compute_bound = comp * coeffs[C_COMPUTE] >= mem * coeffs[C_HBM]
            f[:, C_COMPUTE] += np.where(compute_bound, comp, 0.0)
            f[:, C_HBM] += np.where(compute_bound, 0.0, mem)
        for _, (comm, window, share) in hides:
            f -= hidden(comm, window, share, coeffs)
        return f

    def hides(self) -> list[tuple[str, tuple[np.ndarray, np.ndarray, Any]]]:
        """(breakdown entry, (comm, window, share)) of each communication that compute beside it
        hides: data-parallel (``overlap``), TP (``tp_overlap``) and pipeline sends (``pp_overlap``)."""
        return [(k, o) for k, o in (("dp", self.overlap), ("tp", self.tp_overlap), ("pp", self.pp_overlap)) if o]

    def counted(self) -> np.ndarray:
        """The bytes the model counts: state, activations and logits (and generation's KV cache)."""
        return self.weights + self.grads + self.optimizer + self.activations + self.kv_cache

    def memory(self) -> np.ndarray:
        """The peak held: what is counted, training's and inference's times ``slack``."""
        return self.counted() * self.slack if self.slack != 1.0 else self.counted()

    def breakdown(self, coeffs: np.ndarray, i: int = 0) -> dict[str, float]:
        # np.isscalar narrows col to numpy's scalar types, which mypy will not take as an index
        out = {
            name: float(feat[i] @ coeffs)
            if col is None
            else float(feat[i] * coeffs[col if np.isscalar(col) else col[i]])  # type: ignore[index]
            for name, (col, feat) in self.parts.items()
        }
        for name, waited in self.waits.items():
            out[name] = out.get(name, 0.0) + float(waited[i])
        if self.shape is not None and self.shape[1] != self.shape[2]:  # calibrate's grid moved the knee
            per_knee, knee, built = self.shape
            out["compute"] = out.get("compute", 0.0) + (knee - built) * float(per_knee[i] @ coeffs)
        for name, (comm, window, share) in self.hides():
            out[name] = out.get(name, 0.0) - float(hidden(comm, window, share, coeffs)[i] @ coeffs)
        if self.imbalance is not None:
            for name, feat in self.imbalance[0].items():
                out[name] = out.get(name, 0.0) + (self.imbalance[1] - 1.0) * float(feat[i] @ coeffs)
        if self.decode is not None:
            comp, mem, tail = self.decode
            bound = "compute" if comp[i] * coeffs[C_COMPUTE] >= mem[i] * coeffs[C_HBM] else "memory"
            seconds = float(comp[i] * coeffs[C_COMPUTE]) if bound == "compute" else float(mem[i] * coeffs[C_HBM])
            out[bound] = out.get(bound, 0.0) + seconds * (1 - float(tail[i]))
            out["tail"] = out.get("tail", 0.0) + seconds * float(tail[i])
        return out


def touched_share(model: Model, batch) -> np.ndarray:
    """The share of a mixture of experts' experts a decode step of ``batch`` tokens reads:
    ``1 - (1 - k/E)^batch`` under even routing, each token to k of E experts."""
    k, e = model.experts_per_token or 1, model.experts or 1
    return 1 - (1 - k / e) ** np.maximum(np.asarray(batch, dtype=float), 1.0)


def decode_iterations(lengths: np.ndarray, samples, slots) -> tuple[np.ndarray, np.ndarray]:
    """Decode iterations of continuous batching (vLLM) until the last response of a replica
    ends, and how many of them run while the batch drains: ``samples`` responses whose lengths
    are the equal shares ``lengths``, at most ``slots`` at a time (the KV cache's), started
    first come first served in random order.

    All fit (slots >= samples): every response starts at once; the batch is full until the
    shortest ends and done when the longest does. Otherwise the queue keeps every slot busy
    until it empties, at ``total / slots`` less the mean residual of a response in service (the
    length-biased ``E[L^2] / (2 E[L])``); then the responses in service finish, the last after
    the largest residual, about ``r_max k / (k + 1)`` with ``k`` longest responses among the
    slots; at least ``ceil(samples / slots)`` shortest responses back to back, at most as many
    longest ones (exact when every response is as long). Always between
    Graham's bounds ``max(r_max, total / slots)`` and ``total / slots + r_max``."""
    lengths = np.asarray(lengths, dtype=float)
    samples = np.ceil(np.asarray(samples, dtype=float) - 1e-9)
    slots = np.maximum(np.asarray(slots, dtype=float), 1.0)
    top, m1, m2 = lengths.max(), lengths.mean(), np.mean(lengths**2)
    total = samples * m1
    k = slots * top / (len(lengths) * m1)  # longest responses in service (length-biased)
    queued = np.maximum(total / slots - m2 / (2 * m1), 0.0) + top * k / (k + 1)
    rounds = np.ceil(samples / slots) * lengths.min()  # some slot serves ceil(samples / slots) responses
    most = np.ceil(samples / slots) * top  # and at most that many longest ones
    queued = np.clip(np.clip(queued, rounds, most), np.maximum(top, total / slots), total / slots + top)
    fit = slots >= samples
    iterations = np.where(fit, top, queued)
    full = np.where(fit, lengths.min(), np.maximum(queued - top * k / (k + 1), 0.0))
    return iterations, iterations - np.minimum(full, iterations)


class CostModel:
    """Time and memory of model-stages on one cluster, with calibratable coefficients."""

    def __init__(self, cluster: Cluster, efficiency: Efficiency | None = None):
        self.cluster = cluster
        self.efficiency = efficiency or cluster.efficiency or Efficiency()

    @property
    def coeffs(self) -> np.ndarray:
        return coefficient_vector(self.efficiency)

    # ------------------------------------------------------------ model arithmetic
    @staticmethod
    def layer_flops(model: Model, ctx) -> np.ndarray:
        """Forward FLOPs per token of one transformer layer at context length ``ctx``: its GEMMs,
        then attention's scores and weighted sum over ``ctx`` positions."""
        return CostModel.gemm_flops(model) + 4 * model.heads * model.hd * np.asarray(ctx, dtype=float)

    @staticmethod
    def gemm_flops(model: Model) -> int:
        """Forward FLOPs per token of one layer's GEMMs (projections and MLP; not attention). A
        mixture of experts: the router's and the ``experts_per_token`` experts' (and the shared
        expert's) a token goes through (``Model.active_ffn``), averaged with its dense first
        layers' MLP where it has some."""
        h, q, k = model.hidden, model.heads * model.hd, model.kv_heads * model.hd
        n_mlp = 3 if model.mlp == "gated" else 2
        # the router's logits; Qwen2-MoE's shared expert also has a one-row sigmoid gate
        router = 2 * h * ((model.experts or 0) + (1 if model.shared_expert_ffn else 0)) if model.moe else 0
        attention = 2 * h * (q + 2 * k) + 2 * q * h
        if not model.dense_layers:
            return attention + 2 * n_mlp * h * model.active_ffn + router
        # dense first layers: the mean over the layers (every use multiplies it by the layers)
        moe, dense = model.moe_layers, model.dense_layers
        mlp = (moe * (2 * n_mlp * h * model.active_ffn + router) + dense * 2 * n_mlp * h * model.ffn) / model.layers
        return attention + mlp  # type: ignore[return-value]

    @staticmethod
    def fp8_cast_elements(model: Model) -> tuple[int, int]:
        """(input, output) elements per token of one layer's FP8 GEMMs, the projections' and the
        MLP's: what Transformer Engine casts to FP8 forward (their inputs) and backward (the
        gradients of their outputs). A mixture of experts: its MLP as a dense one of the active
        width (``Model.active_ffn``)."""
        h, q, k = model.hidden, model.heads * model.hd, model.kv_heads * model.hd
        n_mlp = 3 if model.mlp == "gated" else 2
        f = model.active_ffn
        return h + q + h + f, (q + 2 * k) + h + (n_mlp - 1) * f + h

    @staticmethod
    def gemm_shape_flops(model: Model, tokens, tp, ep, etp, knee: float) -> np.ndarray:
        """Forward FLOPs per token that one layer's GEMMs add for their shapes (``Efficiency.gemm_knee``):
        a GEMM of ``m x k`` by ``k x n`` on one GPU runs at ``1 / (1 + knee / size)`` of the
        largest GEMMs' efficiency, so it costs ``flops x knee / size`` more. ``size`` is
        ``3 / (1/m + 1/n + 1/k)``: its FLOPs per operand element, as the roofline counts them
        (``(m k + k n + m n) / (m n k)``), the cube root of ``m n k`` for a square GEMM and
        about three times its thinnest dimension for a thin one. ``tokens``: a micro-batch's
        tokens on one GPU, the rows of its dense GEMMs; a routed expert's rows are its share of
        the tokens its EP group dispatches to it (each of ``ep`` ranks sends the ``1 / tp`` of its
        tokens it holds, gathered over ``etp`` ranks). The router (``h x experts``) is left at
        the large GEMMs' efficiency. Per candidate."""
        h, q, kv = model.hidden, model.heads * model.hd, model.kv_heads * model.hd
        n_mlp = 3 if model.mlp == "gated" else 2
        m = np.maximum(np.asarray(tokens, dtype=float), 1.0)
        tp = np.asarray(tp, dtype=float)

        def extra(flops, n, k, rows):  # flops per token of the whole GEMM; n, k on this GPU
            inverse = 1 / np.maximum(rows, 1.0) + 1 / np.maximum(n, 1.0) + 1 / np.maximum(k, 1.0)
            return flops * knee * inverse / 3

        out = extra(2 * h * (q + 2 * kv), (q + 2 * kv) / tp, h, m) + extra(2 * q * h, h, q / tp, m)

        def mlp(ffn, rows, t):
            return extra(2 * (n_mlp - 1) * h * ffn, (n_mlp - 1) * ffn / t, h, rows) + extra(
                2 * h * ffn, h, ffn / t, rows
            )

        if not model.moe:
            return out + mlp(model.ffn, m, tp)
        e, k_e, f_e = cast(int, model.experts), cast(int, model.experts_per_token), cast(int, model.expert_ffn)
        etp = np.asarray(etp, dtype=float)
        rows = m * k_e * np.asarray(ep, dtype=float) * etp / (e * tp)  # tokens routed to one expert
        moe = k_e * mlp(f_e, rows, etp)
        if model.shared_expert_ffn:
            moe = moe + mlp(model.shared_expert_ffn, m, tp)
        dense = mlp(model.ffn, m, tp) if model.dense_layers else 0.0
        return out + (model.moe_layers * moe + (model.dense_layers or 0) * dense) / model.layers

    @staticmethod
    def head_flops(model: Model) -> int:
        return 2 * model.hidden * (model.vocab if model.head == "lm" else 1)

    @staticmethod
    def _local_params(model: Model, tp: np.ndarray):
        """Per TP rank 0: parameters of one layer, of the first stage's extras, of the last
        stage's extras, and of one of a mixture of experts' dense first layers (``dense_layers``;
        the layer's otherwise). Routed experts are apart (``expert_params_per_layer``)."""
        cache: dict[int, tuple[int, int, int, int]] = {}
        last_layer = model.layers - 1  # a MoE layer whenever the model has experts
        for t in np.unique(tp):
            t = int(t)
            layer = first = last = dense = 0
            for spec in model.tensors.values():
                if spec.family in model.expert_of:
                    continue  # expert_params_per_layer
                n = 1
                for lo, hi in model.tp_box(spec, t, 0):
                    n *= hi - lo
                if spec.per_layer:
                    a, b = spec.span(model.layers)
                    layer += n if a <= last_layer <= b else 0
                    dense += n if a <= 0 <= b else 0
                else:
                    if spec.placement in ("first", "first_and_last"):
                        first += n
                    if spec.placement in ("last", "first_and_last"):
                        last += n
            cache[t] = (layer, first, last, dense)
        per = np.array([cache[int(t)] for t in tp], dtype=float).reshape(-1, 4)
        return per[:, 0], per[:, 1], per[:, 2], per[:, 3]

    @staticmethod
    def expert_params_per_layer(model: Model, ep: np.ndarray, etp: np.ndarray) -> np.ndarray:
        """Routed-expert parameters of one layer on the fullest GPU: ``ceil(E / ep)`` experts, each
        ETP rank 0's slice (0 for a dense model)."""
        if not model.moe:
            return np.zeros(len(ep))
        gate, up, down = (model.tensors[f] for f in model.expert_families(0))
        per = {
            int(t): sum(int(np.prod([hi - lo for lo, hi in model.tp_box(s, int(t), 0)])) for s in (gate, up, down))
            for t in np.unique(etp)
        }
        return -(-cast(int, model.experts) // ep) * np.array([per[int(t)] for t in etp], dtype=float)

    @staticmethod
    def kv_bytes_per_token(model: Model, tp, layers=None) -> np.ndarray:
        """KV cache bytes per token on one GPU: 2 x layers x kv_heads x head_dim x bytes / TP
        (each rank keeps at least one K/V head when TP exceeds kv_heads)."""
        tp = np.asarray(tp, dtype=float)
        layers = model.layers if layers is None else np.asarray(layers, dtype=float)
        return 2 * layers * np.maximum(model.kv_heads / tp, 1.0) * model.hd * model.dtype_bytes

    def params_per_gpu(self, model: Model, c: Candidates) -> np.ndarray:
        """Parameters held by the fullest GPU (weights only, before ZeRO)."""
        return np.sum(self.split_params(model, c), axis=0)

    def split_params(self, model: Model, c: Candidates) -> tuple[np.ndarray, np.ndarray]:
        """(dense, routed-expert) parameters on the fullest GPU (weights only, before ZeRO): of
        the first stage, the last and (pp > 2) a middle one of ``max_layers`` MoE layers. A
        mixture of experts' dense first layers (``dense_layers``) are the first stage's first."""
        layer, first, last, dense_layer = self._local_params(model, c.tp)
        if not model.moe:  # every layer alike, no experts
            fl, ll, ml = c.first_layers, c.last_layers, c.max_layers
            staged = np.maximum(fl * layer + first, ll * layer + last)
            staged = np.where(c.pp > 2, np.maximum(staged, ml * layer), staged)
            return np.where(c.pp == 1, model.layers * layer + first + last, staged), np.zeros(len(c))
        experts = self.expert_params_per_layer(model, c.ep, c.etp)
        k = float(model.dense_layers or 0)
        L = float(model.layers)

        def stage(lo, n, extra):  # layers [lo, lo + n): (dense part, experts)
            dense = np.clip(np.minimum(lo + n, k) - lo, 0.0, None)
            return dense * dense_layer + (n - dense) * layer + extra, (n - dense) * experts

        one = stage(0.0, L, first + last)
        head = stage(0.0, c.first_layers.astype(float), first)
        tail = stage(L - c.last_layers, c.last_layers.astype(float), last)
        middle = stage(L, c.max_layers.astype(float), 0.0)  # past the dense layers: all MoE
        options = [head, tail] + [tuple(np.where(c.pp > 2, v, 0.0) for v in middle)]
        total = [d + e for d, e in options]
        pick = np.argmax(np.stack(total), axis=0)
        dense = np.choose(pick, [d for d, _ in options])
        expert = np.choose(pick, [e for _, e in options])
        return np.where(c.pp == 1, one[0], dense), np.where(c.pp == 1, one[1], expert)

    def _bw(self, link: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(bandwidth B/s, latency s, coefficient column) per candidate for NVLINK/NIC codes."""
        intra, inter = self.cluster.intra_node, self.cluster.inter_node
        bw = np.where(link == NVLINK, intra.bandwidth, inter.bandwidth)
        lat = np.where(link == NVLINK, intra.latency, inter.latency)
        return bw, lat, np.where(link == NVLINK, C_NVLINK, C_NIC)

    # ------------------------------------------------------------ per model-stage
    def state(self, model: Model, kind: str, c: Candidates) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(weights, gradients, fp32 master and Adam moments) bytes on the fullest GPU of ``c``'s
        layouts of ``model`` running a stage of ``kind``: ``stage``'s, without its time."""
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            return self._state(kind, c, *self.split_params(model, c), model.dtype_bytes)

    @staticmethod
    def expert_dp(c: Candidates) -> np.ndarray:
        """Copies of each expert slice: ``dp x cp x tp / (ep x etp)`` (ZeRO shards experts over them)."""
        return c.dp.astype(float) * c.cp.astype(float) * c.tp / (c.ep * c.etp)

    @staticmethod
    def _state(kind: str, c: Candidates, dense: np.ndarray, experts: np.ndarray, b: int):
        if kind != "train":
            zeros = np.zeros(len(c))
            return (dense + experts) * b, zeros, zeros
        replicas = c.dp.astype(float) * c.cp.astype(float)  # ZeRO shards over every copy of the weights
        edp = CostModel.expert_dp(c)

        def over(bytes_per_param, stage: int):
            return bytes_per_param * (
                dense / np.where(c.zero >= stage, replicas, 1.0) + experts / np.where(c.zero >= stage, edp, 1.0)
            )

        return over(b, 3), over(c.grad_bytes, 2), over(12, 1)

    def stage(self, model: Model, workload: Workload, kind: str, c: Candidates) -> StageCost:
        """Features and memory of ``c``'s layouts of ``model`` running a stage of ``kind``."""
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            return self._stage(model, workload, kind, c)

    def _stage(self, model: Model, workload: Workload, kind: str, c: Candidates) -> StageCost:
        n = len(c)
        tp, pp, dp = c.tp.astype(float), c.pp.astype(float), c.dp.astype(float)
        cp = c.cp.astype(float)  # each sample's tokens split over cp ranks (training and inference only)
        replicas = dp * cp  # copies of the weights: gradients reduce, and ZeRO shards, over all of them
        peak = self.cluster.peak_flops
        # FP8 GEMMs at FP8_KERNEL_EFFICIENCY of bf16's fraction of the FP8 peak: counted as
        # bf16-equivalent FLOPs; attention and the head stay bf16 (their casts are charged below)
        fp8_gain = np.where(c.fp8, max(1.0, FP8_KERNEL_EFFICIENCY * (self.cluster.peak_flops_fp8 or peak) / peak), 1.0)
        fp8_saving = (1 - 1 / fp8_gain) * self.gemm_flops(model)
        layer_flops = lambda ctx: self.layer_flops(model, ctx) - fp8_saving
        h, L, V = model.hidden, model.layers, model.vocab
        b = model.dtype_bytes
        F = np.zeros((n, len(COEFFS)))
        latency = np.zeros(n)
        parts: dict[str, tuple[Any, np.ndarray]] = {}
        waits: dict[str, np.ndarray] = {}
        uneven: dict[str, np.ndarray] = {}  # features the busiest EP rank stretches (``StageCost.imbalance``)

        def onehot(col) -> np.ndarray:
            """n x 6: a 1 in each candidate's column ``col``."""
            out = np.zeros((n, len(COEFFS)))
            out[np.arange(n), np.broadcast_to(np.asarray(col), (n,))] = 1.0
            return out

        def wait(name: str, seconds):
            """Fixed latency (not calibrated) charged to breakdown entry ``name``."""
            nonlocal latency
            seconds = np.broadcast_to(np.asarray(seconds, dtype=float), (n,))
            latency = latency + seconds
            waits[name] = waits.get(name, 0.0) + seconds

        def add(name: str, col, feat):
            feat = np.broadcast_to(np.asarray(feat, dtype=float), (n,))
            col = np.broadcast_to(np.asarray(col), (n,))
            for cc in np.unique(col):
                sel = col == cc
                F[sel, cc] += feat[sel]
            prev = parts.get(name)
            # a breakdown entry keeps one column per candidate (links differ only by candidate), or
            # its features (n x 6) where it spans several columns (EP's all-to-all over NVLink and the NIC)
            one = int(col[0]) if np.all(col == col[0]) else col
            if prev is None or (prev[0] is not None and np.array_equal(prev[0], one)):
                parts[name] = (one, (prev[1] if prev else 0) + feat)
            else:
                mat = np.zeros((n, len(COEFFS))) if prev[0] is not None else prev[1]
                if prev[0] is not None:
                    mat[np.arange(n), np.broadcast_to(np.asarray(prev[0]), (n,))] += prev[1]
                mat[np.arange(n), col] += feat
                parts[name] = (None, mat)

        samples = workload.samples / dp
        s = workload.prompt_len_mean + workload.response_len_mean
        mbs = workload.micro_batch
        # time at the mean length; memory for the longest micro-batch (its activations must fit)
        act_tokens = float(workload.longest_micro_batch_tokens())
        n_mb = np.maximum(samples / mbs, 1.0)
        m = c.micro_batches.astype(float)
        v = c.vpp.astype(float)
        # interleaving: v chunks per rank, a v-th of the bubble; zero bubble: W fills all but F + I - W of it
        named = bool(np.any(c.schedule >= GPIPE))  # some candidate runs a schedule other than Megatron's
        if named and kind == "train":
            zb = c.schedule >= ZERO_BUBBLE  # zero_bubble or zbv
            enough = m >= np.where(c.schedule == ZBV, 2 * pp - 1, pp)  # to fill the bubble with W
            filled = np.where(zb & enough, np.where(c.recompute, 2.0 / 4.0, 1.0 / 3.0), 1.0)
            v = np.where(zb & ~enough, 1.0, v)  # too few micro-batches to fill: 1F1B's bubble bounds it
            bubble = np.where(c.pp > 1, (pp - 1) / (m * v) * filled, 0.0)
            v = c.vpp.astype(float)
        else:
            bubble = np.where(c.pp > 1, (pp - 1) / (m * v), 0.0)
        sp_div = np.where(c.sp, tp, 1.0)  # sequence parallelism shards the activations outside the TP GEMMs
        stage_layers = c.max_layers.astype(float)
        dense_params, expert_params = self.split_params(model, c)
        edp = self.expert_dp(c)
        tp_bw, tp_lat, tp_col = self._bw(c.tp_link)
        ep_bw, ep_lat, ep_col = self._bw(c.ep_link)
        nv_bw, nic_bw = self.cluster.intra_node.bandwidth, self.cluster.inter_node.bandwidth
        ep = c.ep.astype(float)
        carved = bool(np.any(c.ep > 1))  # some candidate runs an all-to-all (dense models: none)
        local = np.minimum(c.ep_local.astype(float), ep)
        # MoE layers of the fullest stage (dense first layers: the model's share of MoE layers)
        moe_layers = stage_layers * model.moe_layers / L if model.moe else np.zeros(n)
        # all-to-all bytes a GPU sends per MoE layer and token of its replica, each way (dispatch or
        # combine): k hidden vectors per token (one per routed expert, as Megatron's all-to-all
        # dispatcher permutes them), its replica's tokens split over TP; of the ep destinations,
        # local - 1 are on its node (NVLink) and ep - local on others (the NIC)
        a2a_tok = (model.experts_per_token or 0) * h * ACT_BYTES / tp

        def a2a_seconds(volume):
            """(NVLink, NIC) features of ``volume`` bytes per destination share under EP."""
            return volume * (local - 1) / ep / nv_bw, volume * (ep - local) / ep / nic_bw

        pp_bw, pp_lat, pp_col = self._bw(c.pp_link)
        dp_bw, dp_lat, dp_col = self._bw(c.dp_link)
        cp_bw, cp_lat, cp_col = self._bw(c.cp_link)
        ring_tp = 2 * (tp - 1) / tp
        decode = overlap = tp_overlap = pp_overlap = shape = None
        zeros = np.zeros(n)
        weights, grads, optimizer = self._state(kind, c, dense_params, expert_params, b)
        activations = kv = zeros

        q_dim, k_dim = model.heads * model.hd, model.kv_heads * model.hd
        n_mlp = 3 if model.mlp == "gated" else 2

        heads_here = np.maximum(model.heads / tp, 1.0)  # a GPU's attention heads
        seq_max = workload.prompt_len_max + workload.response_len_max

        def act_layer(tokens):
            """Bytes of activations one layer stores for backward, per micro-batch (flash attention)."""
            replicated = 4 * tokens * h * ACT_BYTES
            sharded = (2 * q_dim + 2 * k_dim + n_mlp * model.active_ffn) * tokens * ACT_BYTES
            return replicated / sp_div + sharded / tp

        # in training, dropout on the attention weights (a forward of inference runs none)
        dropout = kind == "train" and model.attention_dropout > 0

        def scores_kept(tokens):
            """Bytes of one layer's softmax output (with dropout, its mask and the dropped weights
            too), kept for the backward where attention is materialized (each query's row of
            ``seq_max`` keys, per head on the GPU)."""
            per = ACT_BYTES + (DROPOUT_BYTES_KEPT if dropout else 0.0)
            return np.where(c.attention == MATERIALIZED, heads_here * tokens * seq_max * per, 0.0)

        if kind in ("train", "infer"):
            epochs = workload.ppo_epochs if kind == "train" else 1
            tokens = epochs * samples * s
            passes = np.where(c.recompute, 4.0, 3.0) if kind == "train" else np.ones(n)
            flops_tok = passes * L * layer_flops(s) + (3.0 if kind == "train" else 1.0) * self.head_flops(model)
            ideal = tokens * flops_tok / (tp * pp * cp * peak)
            add("compute", C_COMPUTE, ideal)
            add("bubble", C_COMPUTE, ideal * bubble)
            # the GEMMs' shapes: each micro-batch's GEMMs below the largest GEMMs' efficiency (FP8
            # ones at the FP8 peak), with the bubble they stretch; per unit of ``gemm_knee``. The
            # windows that hide TP and DP traffic, and the busiest EP rank's stretch, count the
            # GEMMs at the large GEMMs' efficiency (without this term): they hide a little less
            fp8_rate = 1 / fp8_gain
            balance = peak / self.cluster.hbm_bandwidth  # the knee in GEMM size: gemm_knee x the machine balance
            per_knee = self.gemm_shape_flops(model, mbs * s / cp, tp, ep, c.etp, balance) * fp8_rate
            per_knee = tokens * passes * L * per_knee / (tp * pp * cp * peak)
            knee = self.efficiency.gemm_knee
            if knee > 0:
                add("compute", C_COMPUTE, knee * per_knee)
                add("bubble", C_COMPUTE, knee * per_knee * bubble)
            shape = ((per_knee * (1 + bubble))[:, None] * onehot(C_COMPUTE), knee, knee)
            if np.any(c.fp8):
                # Transformer Engine's casts: each FP8 GEMM's inputs every forward (again when
                # recomputing), its output gradients every backward, split over TP as the GEMMs are
                inputs, outputs = self.fp8_cast_elements(model)
                casts = np.where(c.recompute, 2.0, 1.0) * inputs + outputs if kind == "train" else inputs
                cast_bytes = tokens / cp * L / pp * casts * FP8_CAST_BYTES / tp
                add("compute", C_HBM, np.where(c.fp8, cast_bytes / self.cluster.hbm_bandwidth, 0.0) * (1 + bubble))
            n_mb_total = epochs * n_mb
            if np.any(c.attention != FLASH):
                # the scores of every micro-batch, layer and head through HBM (ATTENTION_KINDS):
                # each forward (again when recomputing, fully or the attention core alone) and backward
                trains = kind == "train"
                forwards = np.where(c.recompute | (c.attention == RECOMPUTED), 2.0, 1.0) if trains else np.ones(n)
                per_score = forwards * SCORE_BYTES_FORWARD + (SCORE_BYTES_BACKWARD if trains else 0.0)
                if dropout:
                    per_score = per_score + forwards * DROPOUT_BYTES_FORWARD + DROPOUT_BYTES_BACKWARD
                scores = n_mb_total * mbs * s * s / cp * stage_layers * heads_here * (1 + bubble)
                add(
                    "compute",
                    C_HBM,
                    np.where(c.attention != FLASH, scores * per_score / self.cluster.hbm_bandwidth, 0.0),
                )
                # selective recomputation also redoes the attention core's FLOPs once more
                core = tokens * L * (self.layer_flops(model, s) - self.gemm_flops(model)) / (tp * pp * cp * peak)
                add("compute", C_COMPUTE, np.where(c.attention == RECOMPUTED, core * (1 + bubble), 0.0))
            # TP all-reduces: 2 per layer forward, 2 backward, 2 more when recomputing
            n_ar = np.where(c.recompute, 6.0, 4.0) if kind == "train" else np.full(n, 2.0)
            tp_bytes = tokens / cp * stage_layers * n_ar * ring_tp * h * ACT_BYTES * (1 + bubble)
            add("tp", tp_col, np.where(c.tp > 1, tp_bytes / tp_bw, 0.0))
            wait("tp", np.where(c.tp > 1, n_mb_total * (1 + bubble) * stage_layers * n_ar * 2 * (tp - 1) * tp_lat, 0.0))
            if np.any(c.tp_overlap):
                # --tp-comm-overlap: each GEMM in tp chunks beside the others' ring steps; all but one
                # chunk's traffic hides behind the layers' GEMMs (their share of the compute)
                gemm = passes * L * (self.gemm_flops(model) - fp8_saving) / flops_tok  # FP8: as flops_tok counts them
                comm_f, win_f = np.zeros((n, len(COEFFS))), np.zeros((n, len(COEFFS)))
                comm_f[np.arange(n), tp_col] = np.where(c.tp_overlap & (c.tp > 1), tp_bytes / tp_bw, 0.0)
                win_f[:, C_COMPUTE] = np.where(c.tp_overlap, ideal * gemm * (1 + bubble), 0.0)
                tp_overlap = (comm_f, win_f, np.where(c.tp_overlap, (tp - 1) / tp, 0.0))
            # PP: activations forward (and their gradients backward) per micro-batch and virtual
            # stage; each TP rank sends its 1/TP of them (Megatron's scatter-gather)
            # on the critical path: each flush's fill, the p v - 1 hops its first micro-batch crosses
            # (every hop between virtual stages changes rank), and its drain backward
            directions = 2.0 if kind == "train" else 1.0
            fill = np.maximum(n_mb_total / m, 1.0) * (pp * v - 1)
            sends = directions * (n_mb_total * v + fill)
            per_send = np.where(c.pp > 1, mbs * s / cp * h * ACT_BYTES / tp / pp_bw, 0.0)
            add("pp", pp_col, sends * per_send)
            # pp_overlap: a rank posts its sends and computes on; in training those of the steady
            # state (every micro-batch's, per virtual stage) hide as far as its compute lasts, and
            # each flush's fill and drain stay with their latency. A forward-only pass hides none:
            # its chain of chunks leaves a send no slack (the event truth hides about half at vpp 2)
            steady = np.where(c.pp_overlap & (kind == "train"), directions * n_mb_total * v, 0.0)
            wait("pp", np.where(c.pp > 1, (sends - steady) * pp_lat, 0.0))
            if np.any((steady > 0) & (c.pp > 1)):
                comm_f, win_f = np.zeros((n, len(COEFFS))), np.zeros((n, len(COEFFS)))
                comm_f[np.arange(n), pp_col] = steady * per_send
                win_f[:, C_COMPUTE] = np.where(steady > 0, ideal, 0.0)
                pp_overlap = (comm_f, win_f, np.where(steady > 0, 1.0, 0.0))
            # CP (ring attention): per layer and pass, each rank receives the other cp - 1 chunks' K
            # and V (its TP share of the KV heads); backward passes K/V and their gradients (twice
            # the bytes). Charged in series: an upper bound, as the ring hides part of it behind
            # the attention of the chunk at hand
            kv_local = 2 * np.maximum(model.kv_heads / tp, 1.0) * model.hd
            cp_passes = np.where(c.recompute, 4.0, 3.0) if kind == "train" else np.ones(n)
            cp_bytes = tokens * (cp - 1) / cp * stage_layers * cp_passes * kv_local * ACT_BYTES * (1 + bubble)
            add("cp", cp_col, np.where(c.cp > 1, cp_bytes / cp_bw, 0.0))
            wait(
                "cp", np.where(c.cp > 1, n_mb_total * (1 + bubble) * stage_layers * cp_passes * (cp - 1) * cp_lat, 0.0)
            )
            # EP: dispatch and combine per MoE layer, forward and backward (the backward's all-to-all
            # carries the gradients of both; the weight gradients need none), again when recomputing
            a2a_passes = np.where(c.recompute, 3.0, 2.0) if kind == "train" else np.ones(n)
            a2a = np.where(c.ep > 1, 2 * tokens / cp * moe_layers * a2a_passes * a2a_tok * (1 + bubble), 0.0)
            a2a_nv, a2a_nic = a2a_seconds(a2a)
            if carved:
                add("ep", C_NVLINK, a2a_nv)
                add("ep", C_NIC, a2a_nic)
            if model.moe and carved:  # the busiest EP rank's experts: their GEMMs and all-to-all wait for it
                expert_flops = (
                    passes
                    * model.moe_layers
                    * 2
                    * 3
                    * h
                    * cast(int, model.experts_per_token)
                    * cast(int, model.expert_ffn)
                )
                expert_ideal = np.where(c.ep > 1, tokens * expert_flops / (tp * pp * cp * peak) * (1 + bubble), 0.0)
                uneven["compute"] = expert_ideal[:, None] * onehot(C_COMPUTE)
                uneven["ep"] = a2a_nv[:, None] * onehot(C_NVLINK) + a2a_nic[:, None] * onehot(C_NIC)
            wait(
                "ep",
                np.where(c.ep > 1, n_mb_total * (1 + bubble) * moe_layers * a2a_passes * 2 * (ep - 1) * ep_lat, 0.0),
            )
            add("overhead", C_OVERHEAD, n_mb_total * (1 + bubble) * stage_layers * passes)
            if kind == "train":
                n_opt = epochs * workload.samples / (workload.mini_batch or workload.samples)
                # ZeRO-0 all-reduces the gradients; ZeRO-1 and 2 (Megatron's distributed optimizer,
                # FSDP without resharding after forward) reduce-scatter them and all-gather the
                # updated weights in the weights' dtype (bf16 beside fp32 gradients); ZeRO-3
                # reduce-scatters them and gathers each layer's weights per micro-batch (below)
                shard = lambda k: (k - 1) / k
                ring = lambda k: np.where(c.zero == 0, 2 * shard(k), shard(k))
                grad_bytes = n_opt * (ring(replicas) * dense_params + ring(edp) * expert_params) * c.grad_bytes
                gathered = shard(replicas) * dense_params + shard(edp) * expert_params
                gather_bytes = np.where(
                    c.zero == 3, n_mb_total * 2 * gathered * b, np.where(c.zero > 0, n_opt * gathered * b, 0.0)
                )
                # NCCL runs a ring through each NIC of a node (a channel per NIC): a group with
                # dp_local members on a node crosses between nodes over all of their NICs at once;
                # its members' NVLink hops carry the whole ring and bound it
                rate = np.where(c.dp_link == NIC, np.minimum(dp_bw * c.dp_local, nv_bw), dp_bw)
                dp_feat = np.where(replicas > 1, (grad_bytes + gather_bytes) / rate, 0.0)
                add("dp", dp_col, dp_feat)
                # what compute hides: ZeRO-3 gathers and reduces layer by layer beside all of it;
                # otherwise gradient buckets reduce during the backward of an optimizer step's last
                # micro-batch, and ZeRO-1/2's gathers run layer by layer ahead of the next step's
                # first forward (--overlap-param-gather). One window for both: with fp32 gradients
                # their bytes stand 2:1 as the backward to the forward
                backward = ideal * np.where(c.recompute, 3.0, 2.0) / passes
                forward = np.where(c.zero > 0, ideal / passes, 0.0)
                window = np.where(c.zero == 3, ideal, (backward + forward) * n_opt / n_mb_total)
                comm_f, win_f = np.zeros((n, len(COEFFS))), np.zeros((n, len(COEFFS)))
                for col in (C_NVLINK, C_NIC):
                    comm_f[:, col] = np.where(dp_col == col, dp_feat, 0.0)
                # dp_overlap false: no window (the reduction after the backward, each ZeRO-3 gather before its layer)
                win_f[:, C_COMPUTE] = np.where((replicas > 1) & c.dp_overlap, window, 0.0)
                overlap = (comm_f, win_f, self.efficiency.overlap)
                wait("dp", np.where(replicas > 1, n_opt * 2 * (replicas - 1) * dp_lat, 0.0))
                opt_params = dense_params / np.where(c.zero >= 1, replicas, 1.0) + expert_params / np.where(
                    c.zero >= 1, edp, 1.0
                )
                add("optimizer", C_HBM, n_opt * 32 * opt_params / self.cluster.hbm_bandwidth)
                # 1F1B keeps min(p, m) micro-batches in flight on the first stage; interleaved,
                # (1 + (p - 1) / (p v)) times as many (Korthikanti et al. 2022, section 4.2.3)
                # GPipe, every micro-batch; torch's zero bubble, of r per round (rounds of p), on
                # every rank; ZBV, min(p, m) on every rank
                in_flight = np.minimum(pp, m) * np.where(v > 1, 1 + (pp - 1) / (pp * v), 1.0)
                if named:
                    per_round = m / np.maximum(1.0, np.floor(m / pp))
                    in_flight = np.where(c.schedule == GPIPE, m, in_flight)
                    in_flight = np.where(
                        c.schedule == ZERO_BUBBLE, ((v - 1) * per_round + np.minimum(pp, per_round)) / v, in_flight
                    )
                    in_flight = np.where(c.schedule == ZBV, np.minimum(pp, m), in_flight)
                tok_mb = act_tokens / cp
                # full recomputation stores each layer's input (2sbh bytes, sharded by SP) for every
                # micro-batch in flight; the activations and scores of the one layer whose backward
                # runs, recomputed for one micro-batch, once
                stored = np.where(
                    c.recompute,
                    stage_layers * tok_mb * h * ACT_BYTES / sp_div,
                    stage_layers * (act_layer(tok_mb) + scores_kept(tok_mb)),
                )
                recomputed = np.where(c.recompute, act_layer(tok_mb) + scores_kept(tok_mb), 0.0)
                activations = in_flight * stored + tok_mb * V * 4 / tp + recomputed
            else:
                activations = (
                    2 * act_layer(act_tokens / cp) + scores_kept(act_tokens / cp) + act_tokens / cp * V * 4 / tp
                )
        elif kind == "generate":
            p, r, R = workload.prompt_len_mean, workload.response_len_mean, workload.response_len_max
            kv_tok = self.kv_bytes_per_token(model, tp, stage_layers)
            budget = VLLM_GPU_MEMORY_UTILIZATION * self.cluster.gpu_memory - weights - c.resident
            conc = np.clip(np.floor(budget / ((p + r) * kv_tok)), 0, samples)
            waves = np.where(conc >= 1, np.ceil(samples / np.maximum(conc, 1)), np.inf)
            prefill = samples * p * (L * layer_flops(p) + self.head_flops(model)) / (tp * pp * peak)
            add("prefill", C_COMPUTE, prefill)
            lengths = np.asarray(workload.response_len_dist or [r], dtype=float)  # equal shares of the responses
            if workload.response_len_dist:
                steps, draining = decode_iterations(lengths, samples, conc)
            else:  # lengths unknown: waves of sequences, each as long as the longest response
                steps, draining = waves * R, waves * (R - r)  # each wave drains from the mean length to the longest
            per_seq = lambda f: samples * np.mean([f(x) for x in lengths], axis=0)  # sum over the responses
            dec_compute = per_seq(lambda x: x * (L * layer_flops(p + x / 2) + self.head_flops(model))) / (
                tp * pp * peak
            )
            # a token passes the pipeline stages one after another, so PP does not shorten a decode
            # step (it frees memory for a larger batch): each step costs pp stage reads
            # a mixture of experts reads, per decode step, the experts its batch's tokens are routed
            # to: of E experts, top-k each, a batch of b tokens touches E (1 - (1 - k/E)^b) under
            # even routing (all of them once b is large)
            read = dense_params * b + expert_params * b * touched_share(model, conc) if model.moe else weights
            dec_memory = (
                pp * (steps * read + per_seq(lambda x: (p * x + x * x / 2) * kv_tok)) / self.cluster.hbm_bandwidth
            )
            decode = (dec_compute, dec_memory, np.clip(draining / np.maximum(steps, 1), 0.0, 1.0))
            tp_bytes = samples * (p + r) * 2 * stage_layers * ring_tp * h * ACT_BYTES
            add("tp", tp_col, np.where(c.tp > 1, tp_bytes / tp_bw, 0.0))
            wait("tp", np.where(c.tp > 1, (steps + waves) * 2 * stage_layers * 2 * (tp - 1) * tp_lat, 0.0))
            add("pp", pp_col, np.where(c.pp > 1, samples * (p + r) * (pp - 1) * h * ACT_BYTES / pp_bw, 0.0))
            wait("pp", np.where(c.pp > 1, (steps + waves) * (pp - 1) * pp_lat, 0.0))
            # EP: each decode step dispatches and combines its batch's tokens per MoE layer, where
            # the EP group spans engines (vLLM's data-parallel attention: ep > tp). EP over one
            # engine's TP ranks (ep <= tp) moves nothing more: every rank holds the batch's tokens
            # after attention, runs its own experts on them, and the TP all-reduce charged above sums
            # the experts' outputs (vLLM's FusedMoE reduces its results so)
            spans = c.ep > c.tp
            gen_a2a = np.where(spans, 2 * samples * (p + r) * moe_layers * a2a_tok * tp, 0.0)
            gen_nv, gen_nic = a2a_seconds(gen_a2a)
            if carved:
                add("ep", C_NVLINK, gen_nv)
                add("ep", C_NIC, gen_nic)
            if model.moe:
                uneven["ep"] = gen_nv[:, None] * onehot(C_NVLINK) + gen_nic[:, None] * onehot(C_NIC)
            wait("ep", np.where(spans, (steps + waves) * moe_layers * 2 * (ep - 1) * ep_lat, 0.0))
            add("overhead", C_OVERHEAD, (steps + waves) * stage_layers)
            kv = np.minimum(conc, samples) * (p + r) * kv_tok
            activations = np.minimum(conc, samples) * V * 4 / tp
        else:
            raise ValueError(f"unknown stage kind {kind}")
        resident_state = weights + grads + optimizer
        return StageCost(
            features=F,
            latency=latency,
            weights=weights,
            grads=grads,
            optimizer=optimizer,
            activations=np.asarray(activations, dtype=float),
            kv_cache=np.asarray(kv, dtype=float),
            resident_state=resident_state,
            parts=parts,
            waits=waits,
            decode=decode,
            overlap=overlap,
            tp_overlap=tp_overlap,
            pp_overlap=pp_overlap,
            shape=shape,
            imbalance=(uneven, self.efficiency.expert_imbalance) if uneven and np.any(c.ep > 1) else None,
            slack=1.0 if kind == "generate" else self.efficiency.memory_slack,
        )

    def offload_time(self, bytes_: float) -> tuple[float, float]:
        """(feature, latency) of moving ``bytes_`` to host after a stage and back before the next use.
        A cluster without a ``host_link`` cannot offload: any bytes cost infinite time (the
        verifier refuses such a layout; plan-search never picks one)."""
        link = self.cluster.host_link
        if link is None:  # the feature an array (0-d for a float) of inf and 0; callers take it as a float
            return np.where(np.asarray(bytes_, dtype=float) > 0, np.inf, 0.0), 0.0  # type: ignore[return-value]
        return 2 * bytes_ / link.bandwidth, 2 * link.latency
