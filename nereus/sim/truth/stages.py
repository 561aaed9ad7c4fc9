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
from .kernels import attention_seconds, gemm_seconds, memory_seconds
from .misspecified import NONE, Misspecification
from .network import collective_seconds, link_of
from .pipeline import play

ACT = 2  # bytes of an activation (bf16)
WORKSPACE = 2 * 2**30  # CUDA context, cuBLAS workspace, NCCL buffers (an assumption)
FRAGMENTATION = 1.15  # the caching allocator's blocks against the activations' bytes (an assumption)
VLLM_MEMORY = 0.9  # vLLM's gpu_memory_utilization default
SCHEDULER_S = 5e-4  # an engine's CPU work per decode iteration: scheduling, sampling (an assumption)
PASSES = 2  # DP replicas played per train or infer stage (sampled, as REPLICAS)
REPLICAS = 4  # engine replicas played per generate stage (sampled: the slowest of these ends it)


def local_params(model: Model, tp: int) -> tuple[int, int, int]:
    """Parameters on TP rank 0: of one layer, of the first stage's extras, of the last's."""
    layer = first = last = 0
    for spec in model.tensors.values():
        n = math.prod(hi - lo for lo, hi in model.tp_box(spec, tp, 0))
        if spec.per_layer:
            layer += n
        else:
            first += n if spec.placement in ("first", "first_and_last") else 0
            last += n if spec.placement in ("last", "first_and_last") else 0
    return layer, first, last


def stage_params(model: Model, lay: Layout, s: int) -> int:
    """Parameters of pipeline stage ``s`` on one of its GPUs."""
    layer, first, last = local_params(model, lay.tp)
    lo, hi = lay.layers[s]
    return (hi - lo + 1) * layer + (first if s == 0 else 0) + (last if s == lay.pp - 1 else 0)


def state_bytes(model: Model, lay: Layout, train: bool) -> dict[str, float]:
    """Bytes of weights, gradients and fp32 master plus Adam moments on the fullest GPU of
    ``lay``, divided over its copies where its ZeRO stage shards them."""
    params = max(stage_params(model, lay, s) for s in range(lay.pp))
    copies = lay.dp * lay.cp
    grad = 4 if lay.grad_dtype == "fp32" else 2
    return {
        "weights": params * model.dtype_bytes / (copies if train and lay.zero >= 3 else 1),
        "grads": params * grad / (copies if lay.zero >= 2 else 1) if train else 0.0,
        "optimizer": params * 12 / (copies if lay.zero >= 1 else 1) if train else 0.0,
    }


class Pass:
    """Seconds of one layer (and of the head) on one GPU of ``lay`` for a micro-batch."""

    def __init__(self, model: Model, lay: Layout, cluster: Cluster):
        self.m, self.lay, self.c = model, lay, cluster
        tp_gpus = lay.mesh[: lay.tp]
        _, self.tp_bw, self.tp_lat = link_of(cluster, tp_gpus)
        self.peak = cluster.peak_flops
        self.hbm = cluster.hbm_bandwidth

    def layer(self, tokens: float, ctx: float, backward: bool = False, attention: bool = True) -> float:
        m, t = self.m, self.lay.tp
        h, q, k = m.hidden, m.heads * m.hd, m.kv_heads * m.hd
        g = gemm_seconds
        shapes = [(tokens, (q + 2 * k) / t, h), (tokens, h, q / t)]
        if m.moe:  # the router, then each expert's GEMMs on its share of the routed tokens (even routing)
            e, f = cast(int, m.experts), cast(int, m.expert_ffn)
            routed = tokens * cast(int, m.experts_per_token) / e
            shapes.append((tokens, e, h))
            expert = g(routed, 2 * f / t, h, self.peak, self.hbm) + g(routed, h, f / t, self.peak, self.hbm)
            if m.shared_expert_ffn:
                shapes += [(tokens, 2 * m.shared_expert_ffn / t, h), (tokens, h, m.shared_expert_ffn / t)]
        else:
            up = (2 if m.mlp == "gated" else 1) * m.ffn
            shapes += [(tokens, up / t, h), (tokens, h, m.ffn / t)]
            e, expert = 0, 0.0
        gemms = sum(g(a, b, c, self.peak, self.hbm) for a, b, c in shapes) + e * expert
        attn = (
            attention_seconds(tokens, ctx, m.heads / t, m.hd, self.peak, causal=True, backward=backward)
            if attention
            else 0.0
        )
        # norms, rotary, the MLP's activation, residual adds: about 12 reads or writes of the hidden state
        sp = t if self.lay.sp else 1
        elementwise = memory_seconds(12 * tokens * h * ACT / sp, self.hbm, kernels=6)
        comm = 2 * collective_seconds("all_reduce", tokens * h * ACT, t, self.tp_bw, self.tp_lat)
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


def pipeline_time(
    model: Model, lay: Layout, cluster: Cluster, batches: list[np.ndarray], train: bool, recompute: bool
) -> tuple[float, float, list[int]]:
    """(makespan, the last micro-batch's backward on stage 0, in-flight micro-batches per stage)
    of one pass over ``batches`` on one DP replica of ``lay``."""
    ps = Pass(model, lay, cluster)
    tokens = np.array([float(b.sum()) for b in batches])
    ref = float(tokens.max()) / lay.cp  # the reference micro-batch: the longest
    ctx = float(tokens.sum() / sum(len(b) for b in batches))  # attention's sequence: the mean length
    v = lay.vpp
    fwd, bwd = [], []
    for s in range(lay.pp):
        lo, hi = lay.layers[s]
        n = hi - lo + 1
        f = n * ps.layer(ref, ctx) + (ps.head(ref) if s == lay.pp - 1 else 0.0)
        b = n * ps.layer(ref, ctx, backward=True) + (ps.head(ref, backward=True) if s == lay.pp - 1 else 0.0)
        if recompute:
            b += f
        fwd.append([f / v] * v)
        bwd.append([b / v] * v)
    scale = (tokens / lay.cp / ref).tolist()
    pp_gpus = [lay.mesh[i * lay.tp] for i in range(lay.pp)]
    _, bw, lat = link_of(cluster, pp_gpus)
    send = collective_seconds("send", ref * model.hidden * ACT / lay.tp, 2, bw, lat) if lay.pp > 1 else 0.0
    m = len(batches)
    if v > 1 and m % lay.pp:
        v = 1  # Megatron would refuse; the truth plays 1F1B over the chunks' sum
        fwd = [[sum(x)] for x in fwd]
        bwd = [[sum(x)] for x in bwd]
    played = play(fwd, bwd if train else None, m, send, scale=scale)
    last_bwd = bwd[0][0] * v * scale[-1] if train else 0.0
    return played.makespan, last_bwd, played.in_flight


def train_or_infer(
    model: Model,
    lay: Layout,
    work: Workload,
    cluster: Cluster,
    lengths: np.ndarray,
    kind: str,
    misspec: Misspecification = NONE,
) -> tuple[float, float]:
    """(seconds, bytes on the fullest GPU) of a train or infer model-stage; ``lengths``: every
    sequence of the step (prompt plus response); ``misspec``: its ``inter_node`` slows the
    data-parallel collectives that cross nodes."""
    train = kind == "train"
    shares = np.array_split(lengths, lay.dp)[:PASSES]  # sampled: the slowest of these ends the stage
    per = max(1, work.micro_batch)
    epochs = work.ppo_epochs if train else 1
    mini = (work.mini_batch or work.samples) if train else work.samples
    opt_steps = max(1, math.ceil(work.samples / mini)) if train else 1
    params_full = max(stage_params(model, lay, s) for s in range(lay.pp))
    copies = lay.dp * lay.cp
    dp_gpus = lay.mesh[:: lay.tp * lay.pp][: lay.dp]
    dp_link, dp_bw, dp_lat = link_of(cluster, dp_gpus)
    if dp_link == "nic":
        dp_bw /= misspec.inter_node
    worst, in_flight_peak, longest = 0.0, 0, 0.0
    for share in shares:
        t = 0.0
        for _ in range(epochs):
            for part in np.array_split(share, opt_steps):
                if len(part) == 0:
                    continue
                batches = micro_batches(part, per)
                span, last_bwd, flight = pipeline_time(model, lay, cluster, batches, train, lay.recompute)
                in_flight_peak = max(in_flight_peak, max(flight))
                longest = max(longest, max(float(b.sum()) for b in batches))
                t += span
                if not train:
                    continue
                grad_bytes = params_full * (4 if lay.grad_dtype == "fp32" else 2)
                if lay.zero >= 3 and copies > 1:  # per layer and micro-batch: gather weights twice, scatter grads
                    gathers = (
                        2
                        * len(batches)
                        * collective_seconds("all_gather", params_full * model.dtype_bytes, copies, dp_bw, dp_lat)
                    )
                    scatter = collective_seconds("reduce_scatter", grad_bytes, copies, dp_bw, dp_lat)
                    t += max(0.0, gathers + scatter - 0.8 * span)  # prefetched beside the layers' compute
                elif copies > 1:
                    sync = collective_seconds("all_reduce", grad_bytes, copies, dp_bw, dp_lat)
                    t += max(0.0, sync - last_bwd)  # buckets reduce behind the last backward
                shard = copies if lay.zero >= 1 else 1
                t += memory_seconds(params_full * 32 / shard, cluster.hbm_bandwidth, kernels=4)  # fp32 Adam
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
) -> tuple[float, float, int]:
    """(seconds, bytes on the fullest GPU, preemptions) of a generate model-stage; ``resident``:
    bytes other model-stages keep on its GPUs; ``misspec``: its ``context_factor`` slows decode."""
    params = max(stage_params(model, lay, s) for s in range(lay.pp))
    weights = params * model.dtype_bytes
    hbm = cluster.hbm_bandwidth
    kv_tok = 2 * max(model.layers / lay.pp, 1) * max(model.kv_heads / lay.tp, 1.0) * model.hd * model.dtype_bytes
    free = VLLM_MEMORY * cluster.gpu_memory - weights - resident - WORKSPACE
    capacity = int(max(free, 0) / kv_tok)
    ps = Pass(model, lay, cluster)
    layers = model.layers / lay.pp

    def gemm_s(n: int) -> float:  # one decode iteration's GEMMs and TP all-reduces, every stage in turn
        return lay.pp * (layers * ps.layer(n, 0.0, attention=False) + ps.head(n))

    def prefill_s(tokens: float, mean: float) -> float:
        chunks = max(1, math.ceil(tokens / gen.MAX_BATCHED_TOKENS))
        per = tokens / chunks
        return chunks * lay.pp * (layers * ps.layer(per, mean) + ps.head(per))

    engine = gen.Engine(
        kv_capacity=capacity,
        weights_s=lay.pp * weights / (hbm * 0.85),
        kv_s=lay.pp * kv_tok / (hbm * 0.85),
        fixed_s=SCHEDULER_S,
        gemm_s=gemm_s,
        prefill_s=prefill_s,
        context_factor=misspec.context_factor,
    )
    worst, preempted = 0.0, 0
    shares = list(zip(np.array_split(prompts, lay.dp), np.array_split(responses, lay.dp)))
    for p, r in shares[:REPLICAS]:
        served = gen.serve(p, r, engine)
        worst, preempted = max(worst, served.seconds), preempted + served.preemptions
    memory = VLLM_MEMORY * cluster.gpu_memory
    return worst, memory, preempted
