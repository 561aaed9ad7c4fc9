"""One model-stage of a plan played out on its GPUs, for the event truth: its seconds and the
memory its fullest GPU allocates.

- **train** and **infer**: each DP replica takes its share of the step's sequences (lengths
  drawn from the step's distribution), cut into micro-batches in order; a micro-batch's layers
  run their GEMMs at its token count, flash attention at its sequence length, the memory-bound
  kernels, and the TP all-reduces (``network``) on the TP group's link. The pipeline schedule is
  played micro-batch by micro-batch (``pipeline.play``, uneven stages and micro-batches as they
  are). Training then syncs gradients over DP: buckets all-reduced behind the last micro-batch's
  backward, what does not fit behind it exposed (ZeRO-3 gathers and reduce-scatters each layer's
  weights beside that layer's compute instead); then the optimizer step, memory-bound. PPO's
  epochs and mini-batches repeat it. The slowest replica ends the stage.
- **generate**: continuous batching per engine replica (``generation.serve``).

Replicas are sampled: the first ``REPLICAS`` engine replicas (``PASSES`` DP replicas of a train
or infer stage) are played, each with its own share of the step's sequences, and the slowest of
them ends the stage (the slowest of all of them would
be a little slower: the truth understates the straggling of many replicas).

Memory as allocated: the GPU's state (weights, gradients, fp32 master and Adam moments, ZeRO's
division where the layout has one), the activations of the micro-batches the schedule holds at
its peak (the longest micro-batches: the allocator keeps their blocks), logits in fp32 on the
last stage, a workspace (``WORKSPACE``: CUDA context, cuBLAS and NCCL buffers) and the caching
allocator's fragmentation (``FRAGMENTATION`` of the activations). Both are assumptions, stated.
"""

from __future__ import annotations

import math
from typing import cast

import numpy as np

from ...ir import Cluster, Layout, Model, Workload
from . import generation as gen
from .experts import Experts, even, expert_dp_groups, stage_gpu
from .kernels import attention_seconds, gemm_seconds, memory_seconds
from .misspecified import NONE, Misspecification
from .network import SUPERPOD, Fabric, collective_seconds, link_of, ring_link_of, slowdowns
from .pipeline import play
from .torch_schedules import TORCH_CLASSES

ACT = 2  # bytes of an activation (bf16)
WORKSPACE = 2 * 2**30  # CUDA context, cuBLAS workspace, NCCL buffers (an assumption)
FRAGMENTATION = 1.15  # the caching allocator's blocks against the activations' bytes (an assumption)
VLLM_MEMORY = 0.9  # vLLM's gpu_memory_utilization default
SCHEDULER_S = 5e-4  # an engine's CPU work per decode iteration: scheduling, sampling (an assumption)
PASSES = 2  # DP replicas played per train or infer stage (sampled, as REPLICAS)
REPLICAS = 4  # engine replicas played per generate stage (sampled: the slowest of these ends it)


def stage_params(model: Model, lay: Layout, s: int) -> tuple[int, int]:
    """(dense, expert) parameters of pipeline stage ``s`` on one of its GPUs: every GPU of a stage
    holds as many (EP rank 0's experts, ``E / ep`` of them, each split over ``etp``)."""
    lo, hi = lay.layers[s]
    expert_of = model.expert_of
    own = (model.experts or 0) // lay.ep
    dense = experts = 0
    for name, spec in model.tensors.items():
        if spec.per_layer:
            a, b = spec.span(model.layers)
            count = max(0, min(hi, b) - max(lo, a) + 1)
        else:
            count = int(s in model.stages_holding(spec, lay.pp))
        e = expert_of.get(name)
        if count == 0 or (e is not None and e >= own):
            continue
        tp = lay.tp if e is None else lay.expert_tp
        n = count * math.prod(hi_ - lo_ for lo_, hi_ in model.tp_box(spec, tp, 0))
        if e is None:
            dense += n
        else:
            experts += n
    return dense, experts


def state_bytes(model: Model, lay: Layout, train: bool) -> dict[str, float]:
    """Bytes of weights, gradients and fp32 master plus Adam moments on the fullest GPU of
    ``lay``, divided over its copies where its ZeRO stage shards them (the dense parameters over
    ``dp x cp``, the experts over their expert-DP copies)."""
    copies, expert_copies = lay.dp * lay.cp, lay.expert_dp
    grad = 4 if lay.grad_dtype == "fp32" else 2

    def of(stage: int) -> dict[str, float]:
        dense, experts = stage_params(model, lay, stage)

        def sharded(per: float, from_zero: int) -> float:
            if not train or lay.zero < from_zero:
                return (dense + experts) * per
            return (dense / copies + experts / expert_copies) * per

        return {
            "weights": sharded(model.dtype_bytes, 3) if train else (dense + experts) * model.dtype_bytes,
            "grads": sharded(grad, 2) if train else 0.0,
            "optimizer": sharded(12, 1) if train else 0.0,
        }

    return max((of(st) for st in range(lay.pp)), key=lambda parts: sum(parts.values()))


class Pass:
    """Seconds of one layer (and of the head) on one GPU of ``lay`` for a micro-batch."""

    def __init__(
        self,
        model: Model,
        lay: Layout,
        cluster: Cluster,
        shares: np.ndarray | None = None,
        engine: bool = False,
        fabric: Fabric = SUPERPOD,
    ):
        self.m, self.lay, self.c = model, lay, cluster
        tp_gpus = lay.mesh[: lay.tp]
        _, self.tp_bw, self.tp_lat = link_of(cluster, tp_gpus)
        self.peak = cluster.peak_flops
        self.hbm = cluster.hbm_bandwidth
        self.experts = None
        if model.moe:  # routing as drawn for the step (even where none is given)
            routed = shares if shares is not None else even(model)
            self.experts = Experts(model, lay, cluster, routed, engine, fabric)
        self._layers: dict[tuple, float] = {}  # ``layer`` by its arguments: every stage of a pipeline asks alike

    def layer(
        self,
        tokens: float,
        ctx: float,
        backward: bool = False,
        attention: bool = True,
        decode: bool = False,
        moe: bool = True,
        weight: bool = False,
    ) -> float:
        """One layer; ``moe``: False for a mixture of experts' dense first layers (a dense MLP of
        ``ffn``); ``weight``: only its weight gradients, the part of the backward a zero-bubble
        schedule runs apart (one GEMM per forward GEMM)."""
        key = (tokens, ctx, backward, attention, decode, moe, weight)
        out = self._layers.get(key)
        if out is None:
            out = self._layers[key] = self._layer(tokens, ctx, backward, attention, decode, moe, weight)
        return out

    def _layer(
        self, tokens: float, ctx: float, backward: bool, attention: bool, decode: bool, moe: bool, weight: bool = False
    ) -> float:
        m, t = self.m, self.lay.tp
        h, q, k = m.hidden, m.heads * m.hd, m.kv_heads * m.hd
        g = gemm_seconds
        shapes = [(tokens, (q + 2 * k) / t, h), (tokens, h, q / t)]
        expert = dispatch = 0.0
        reduces = 2  # TP all-reduces per layer: attention's and the MLP's
        if self.experts is not None and moe:  # the router, the busiest EP rank's experts, the dispatcher
            shapes.append((tokens, cast(int, m.experts), h))
            expert = self.experts.gemm_seconds(tokens, decode)
            dispatch = 2 * self.experts.dispatch_seconds(tokens)
            if dispatch:
                reduces = 1  # the dispatcher, not an all-reduce, brings the experts' outputs back
            if m.shared_expert_ffn:
                shapes += [(tokens, 2 * m.shared_expert_ffn / t, h), (tokens, h, m.shared_expert_ffn / t)]
        else:
            up = (2 if m.mlp == "gated" else 1) * m.ffn
            shapes += [(tokens, up / t, h), (tokens, h, m.ffn / t)]
        gemms = sum(g(a, b, c, self.peak, self.hbm) for a, b, c in shapes) + expert
        if weight:
            return gemms
        attn = (
            attention_seconds(tokens, ctx, m.heads / t, m.hd, self.peak, causal=True, backward=backward)
            if attention
            else 0.0
        )
        # norms, rotary, the MLP's activation, residual adds: about 12 reads or writes of the hidden state
        sp = t if self.lay.sp else 1
        elementwise = memory_seconds(12 * tokens * h * ACT / sp, self.hbm, kernels=6)
        comm = reduces * collective_seconds("all_reduce", tokens * h * ACT, t, self.tp_bw, self.tp_lat)
        if self.lay.tp_overlap and t > 1:
            # Megatron's userbuffers: each GEMM in t chunks, a ring step beside each chunk's GEMM; the
            # first chunk's step waits, the rest hide while the GEMMs (twice as many backward) last
            comm -= min(comm * (t - 1) / t, gemms * (2 if backward else 1))
        comm += dispatch
        if backward:  # data and weight gradients: two GEMMs of each forward one
            return 2 * gemms + attn + 2 * elementwise + comm
        return gemms + attn + elementwise + comm

    def head(self, tokens: float, backward: bool = False) -> float:
        n = self.m.vocab if self.m.head == "lm" else 1
        s = gemm_seconds(tokens, n / self.lay.tp, self.m.hidden, self.peak, self.hbm)
        return 2 * s if backward else s


def micro_batches(lengths: np.ndarray, per: int) -> list[np.ndarray]:
    """The replica's sequences, ``per`` to a micro-batch, in order."""
    return [lengths[i : i + per] for i in range(0, len(lengths), per)]


def batch_tokens(batches: list[np.ndarray]) -> np.ndarray:
    """Each micro-batch's tokens (sums of integer lengths: exact), in one call: a micro-batch of
    one sequence each is hundreds of arrays a step, and a sum each cost more than the pipeline."""
    sizes = [len(b) for b in batches]
    return np.add.reduceat(np.concatenate(batches), np.cumsum([0] + sizes[:-1]))


# the IR's schedule names (``Layout.pipeline_schedule``) as ``pipeline.play`` names them
TRUTH_SCHEDULES = {
    "one_f_one_b": "1f1b",
    "interleaved": "interleaved",
    "gpipe": "gpipe",
    "zero_bubble": "zero_bubble",
    "zbv": "zbv",
}


def playable(schedule: str | None, p: int, v: int, m: int) -> bool:
    """Whether ``schedule`` (None: inference's forwards) runs ``m`` micro-batches over ``p`` ranks
    of ``v`` chunks: Megatron's interleaving needs ``m`` a multiple of ``p``; torch's zero-bubble
    schedules, ``m`` a multiple of its rounds (``zero_bubble``; ``zbv`` runs any)."""
    if schedule == "zero_bubble":
        return m % max(1, m // p) == 0
    return schedule == "zbv" or v == 1 or m % p == 0


def pipeline_time(
    model: Model,
    lay: Layout,
    cluster: Cluster,
    batches: list[np.ndarray],
    train: bool,
    recompute: bool,
    shares: np.ndarray | None = None,
    fabric: Fabric = SUPERPOD,
) -> tuple[float, float, list[int], float]:
    """(makespan, the last micro-batch's backward on stage 0, in-flight micro-batches per stage,
    the seconds of one pipeline send over a NIC: 0 where the stages share a node) of one pass
    over ``batches`` on one DP replica of ``lay``; ``shares``: a mixture of experts' routing
    (``experts.routing``)."""
    ps = Pass(model, lay, cluster, shares, fabric=fabric)
    tokens = batch_tokens(batches).astype(float)
    ref = float(tokens.max()) / lay.cp  # the reference micro-batch: the longest
    ctx = float(tokens.sum() / sum(len(b) for b in batches))  # attention's sequence: the mean length
    v = lay.vpp
    schedule = TRUTH_SCHEDULES[lay.pipeline_schedule] if train else None
    split = schedule in TORCH_CLASSES  # the weight gradients run apart
    head_rank = 0 if schedule == "zbv" else lay.pp - 1  # the last virtual stage's rank (ZBV's V ends on rank 0)
    fwd, bwd, wgt = [], [], []
    for s in range(lay.pp):
        lo, hi = lay.layers[s]
        n = hi - lo + 1
        dense = max(0, min(hi, (model.dense_layers or 0) - 1) - lo + 1) if model.moe else 0  # dense first layers
        f = (n - dense) * ps.layer(ref, ctx) + dense * ps.layer(ref, ctx, moe=False)
        f += ps.head(ref) if s == head_rank else 0.0
        b = (n - dense) * ps.layer(ref, ctx, backward=True) + dense * ps.layer(ref, ctx, backward=True, moe=False)
        b += ps.head(ref, backward=True) if s == head_rank else 0.0
        if split:
            w = (n - dense) * ps.layer(ref, ctx, weight=True) + dense * ps.layer(ref, ctx, weight=True, moe=False)
            w += ps.head(ref) if s == head_rank else 0.0
            wgt.append([w / v] * v)
        if recompute:
            b += f
        fwd.append([f / v] * v)
        bwd.append([b / v] * v)
        if schedule == "zbv" and s == head_rank:  # the head only on the V's last stage: rank 0's chunk 1
            hf, hb = ps.head(ref), ps.head(ref, backward=True) + (ps.head(ref) if recompute else 0.0)
            fwd[-1] = [(f - hf) / 2, (f - hf) / 2 + hf]
            bwd[-1] = [(b - hb) / 2, (b - hb) / 2 + hb]
            wgt[-1] = [(w - hf) / 2, (w - hf) / 2 + hf]
    scale = (tokens / lay.cp / ref).tolist()
    pp_gpus = [lay.mesh[i * lay.tp] for i in range(lay.pp)]
    pp_link, bw, lat = link_of(cluster, pp_gpus)
    send = collective_seconds("send", ref * model.hidden * ACT / lay.tp, 2, bw, lat) if lay.pp > 1 else 0.0
    m = len(batches)
    if not playable(schedule, lay.pp, v, m):
        # Megatron or torch would refuse these micro-batches; the truth plays 1F1B over the chunks' sum
        schedule, split, v = ("1f1b" if train else None), False, 1
        fwd = [[sum(x)] for x in fwd]
        bwd = [[sum(x)] for x in bwd]
    played = play(
        fwd,
        bwd if train else None,
        m,
        send,
        schedule=schedule,
        scale=scale,
        weight=wgt if split else None,
        blocking=not lay.pp_overlapped,
    )
    last_bwd = bwd[0][0] * v * scale[-1] if train else 0.0
    return played.makespan, last_bwd, played.in_flight, send if pp_link == "nic" else 0.0


def dp_rings(lay: Layout) -> list[list[int]]:
    """Every data-parallel group of ``lay`` (a stage's TP rank's copies over dp x cp), in mesh order."""
    step = lay.tp * lay.pp
    return [lay.mesh[o::step] for o in range(step)]


def train_or_infer(
    model: Model,
    lay: Layout,
    work: Workload,
    cluster: Cluster,
    lengths: np.ndarray,
    kind: str,
    misspec: Misspecification = NONE,
    routes: np.ndarray | None = None,
    beside: tuple[Layout, ...] = (),
) -> tuple[float, float]:
    """(seconds, bytes on the fullest GPU) of a train or infer model-stage; ``lengths``: every
    sequence of the step (prompt plus response); ``misspec``: its ``inter_node`` slows the
    data-parallel collectives that cross nodes, its ``fabric`` is the switches; ``routes``: a
    mixture of experts' routing; ``beside``: the layouts of model-stages that train at the same
    time on other GPUs, whose gradient syncs run at the same moments as this one's (an
    assumption: PPO's actor and critic step alike) and share the fabric with it."""
    train = kind == "train"
    shares = np.array_split(lengths, lay.dp)[:PASSES]  # sampled: the slowest of these ends the stage
    per = max(1, work.micro_batch)
    epochs = work.ppo_epochs if train else 1
    mini = (work.mini_batch or work.samples) if train else work.samples
    opt_steps = max(1, math.ceil(work.samples / mini)) if train else 1
    dense, experts = max((stage_params(model, lay, s) for s in range(lay.pp)), key=sum)
    copies, expert_copies = lay.dp * lay.cp, lay.expert_dp
    dp_gpus = lay.mesh[:: lay.tp * lay.pp][: lay.dp]
    dp_link, dp_bw, dp_lat = ring_link_of(cluster, dp_gpus)
    # an expert's copies: stage ranks etp x ep apart (``Layout.expert_rank``), on the mesh
    step = lay.expert_tp * lay.ep
    edp_gpus = [stage_gpu(lay, r) for r in range(0, step * expert_copies, step)]
    edp_link, edp_bw, edp_lat = ring_link_of(cluster, edp_gpus)
    if dp_link == "nic":
        dp_bw /= misspec.inter_node
        if train:  # every DP ring of this model-stage and of those beside it at once
            phase = [("ring", g) for x in (lay, *beside) for g in dp_rings(x)]
            own = len(dp_rings(lay))
            dp_bw /= max(slowdowns(cluster, misspec.fabric, phase)[:own])
    if edp_link == "nic":
        edp_bw /= misspec.inter_node
        if train and experts:
            edp_bw /= max(slowdowns(cluster, misspec.fabric, [("ring", g) for g in expert_dp_groups(lay)]))
    grad = 4 if lay.grad_dtype == "fp32" else 2
    # each group's collective: the dense parameters over dp x cp, the experts over their copies
    groups = [(dense, copies, dp_bw, dp_lat), (experts, expert_copies, edp_bw, edp_lat)]
    worst, in_flight_peak, longest = 0.0, 0, 0.0
    for share in shares:
        t = 0.0
        for _ in range(epochs):
            for part in np.array_split(share, opt_steps):
                if len(part) == 0:
                    continue
                batches = micro_batches(part, per)
                span, last_bwd, flight, nic_send = pipeline_time(
                    model, lay, cluster, batches, train, lay.recompute, routes, misspec.fabric
                )
                in_flight_peak = max(in_flight_peak, max(flight))
                longest = max(longest, float(batch_tokens(batches).max()))
                t += span
                if not train:
                    continue
                if lay.zero >= 3:  # per layer and micro-batch: gather weights twice, scatter grads
                    gathers = sum(
                        2 * len(batches) * collective_seconds("all_gather", n * model.dtype_bytes, g, bw, lat)
                        for n, g, bw, lat in groups
                    )
                    scatter = sum(
                        collective_seconds("reduce_scatter", n * grad, g, bw, lat) for n, g, bw, lat in groups
                    )
                    # prefetched beside the layers' compute (dp_overlap), else each before its layer
                    t += max(0.0, gathers + scatter - (0.8 * span if lay.dp_overlap else 0.0))
                else:
                    # ZeRO-0 all-reduces the gradients; ZeRO-1/2 (the distributed optimizer)
                    # reduce-scatters them and gathers the updated weights in their own dtype
                    reduce = "all_reduce" if lay.zero == 0 else "reduce_scatter"
                    sync = sum(collective_seconds(reduce, n * grad, g, bw, lat) for n, g, bw, lat in groups)
                    gather = 0.0
                    if lay.zero > 0:
                        gather = sum(
                            collective_seconds("all_gather", n * model.dtype_bytes, g, bw, lat)
                            for n, g, bw, lat in groups
                        )
                    if dp_link == "nic":
                        sync += nic_send  # the last backward's send shares the NIC with the buckets
                    # buckets reduce behind the last backward (dp_overlap), else after it; the
                    # gathers run ahead of the next step's first forward, about half a backward
                    t += max(0.0, sync - (last_bwd if lay.dp_overlap else 0.0))
                    t += max(0.0, gather - (last_bwd / 2 if lay.dp_overlap else 0.0))
                sharded = sum(n / (g if lay.zero >= 1 else 1) for n, g, _, _ in groups)
                t += memory_seconds(sharded * 32, cluster.hbm_bandwidth, kernels=4)  # fp32 Adam
        worst = max(worst, t)
    # memory as allocated on the fullest GPU
    h, t = model.hidden, lay.tp
    q, k = model.heads * model.hd, model.kv_heads * model.hd
    tok = longest / lay.cp
    layers = max(hi - lo + 1 for lo, hi in lay.layers)
    per_layer = 4 * tok * h * ACT / (t if lay.sp else 1) + (2 * q + 2 * k + 3 * model.active_ffn) * tok * ACT / t
    if not train:
        act = 2 * per_layer
    elif lay.recompute:
        act = in_flight_peak / lay.vpp * layers * tok * h * ACT + per_layer
    else:
        act = in_flight_peak / lay.vpp * layers * per_layer
    logits = tok * (model.vocab if model.head == "lm" else 1) * 4 / t
    memory = sum(state_bytes(model, lay, train).values()) + (act + logits) * FRAGMENTATION + WORKSPACE
    return worst, memory


def generate(
    model: Model,
    lay: Layout,
    work: Workload,
    cluster: Cluster,
    prompts: np.ndarray,
    responses: np.ndarray,
    resident: float,
    misspec: Misspecification = NONE,
    shares: np.ndarray | None = None,
) -> tuple[float, float, int]:
    """(seconds, bytes on the fullest GPU, preemptions) of a generate model-stage; ``resident``:
    bytes other model-stages keep on its GPUs; ``misspec``: its ``context_factor`` slows decode;
    ``shares``: a mixture of experts' routing. A decode iteration reads the dense weights and,
    of a mixture of experts, the experts its batch touches on the busiest EP rank."""
    dense, experts = max((stage_params(model, lay, s) for s in range(lay.pp)), key=sum)
    weights = (dense + experts) * model.dtype_bytes
    hbm = cluster.hbm_bandwidth
    kv_tok = 2 * max(model.layers / lay.pp, 1) * max(model.kv_heads / lay.tp, 1.0) * model.hd * model.dtype_bytes
    free = VLLM_MEMORY * cluster.gpu_memory - weights - resident - WORKSPACE
    capacity = int(max(free, 0) / kv_tok)
    ps = Pass(model, lay, cluster, shares, engine=True, fabric=misspec.fabric)
    moe = model.moe_layers / lay.pp  # a stage's layers, on average: mixture-of-experts and dense
    dense = model.layers / lay.pp - moe

    def gemm_s(n: int) -> float:  # one decode iteration's GEMMs and TP all-reduces, every stage in turn
        step = moe * ps.layer(n, 0.0, attention=False, decode=True) + dense * ps.layer(
            n, 0.0, attention=False, moe=False
        )
        return lay.pp * (step + ps.head(n))

    read_experts = None
    if ps.experts is not None:
        routed = ps.experts

        def read_experts(n: int) -> float:  # the experts a batch of n touches, every stage in turn
            return lay.pp * moe * routed.touched_bytes(n) / (hbm * 0.85)

    def prefill_s(tokens: float, mean: float) -> float:
        chunks = max(1, math.ceil(tokens / gen.MAX_BATCHED_TOKENS))
        per = tokens / chunks
        return chunks * lay.pp * (moe * ps.layer(per, mean) + dense * ps.layer(per, mean, moe=False) + ps.head(per))

    engine = gen.Engine(
        kv_capacity=capacity,
        weights_s=lay.pp * (weights if read_experts is None else dense * model.dtype_bytes) / (hbm * 0.85),
        experts_s=read_experts,
        kv_s=lay.pp * kv_tok / (hbm * 0.85),
        fixed_s=SCHEDULER_S,
        gemm_s=gemm_s,
        prefill_s=prefill_s,
        context_factor=misspec.context_factor,
    )
    worst, preempted = 0.0, 0
    split = list(zip(np.array_split(prompts, lay.dp), np.array_split(responses, lay.dp)))
    for p, r in split[:REPLICAS]:
        served = gen.serve(p, r, engine)
        worst, preempted = max(worst, served.seconds), preempted + served.preemptions
    memory = VLLM_MEMORY * cluster.gpu_memory
    return worst, memory, preempted
