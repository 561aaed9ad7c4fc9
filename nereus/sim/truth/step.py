"""``EventTruth``: what a plan really costs at a step of a trace, played out event by event.

It shares no formula with the cost model (``passes/cost``): kernels by shape (``kernels``),
collectives by algorithm (``network``), the pipeline schedule as it runs (``pipeline``), and
generation as continuous batching (``generation``), a mixture of experts' routing and
dispatch (``experts``), composed per model-stage in ``stages``.

The step's model-stages run in the workload's stage order (each stage's data comes from the one
before); inside a stage, model-stages run on their GPUs as soon as those are free, so those that
share GPUs run one after another and the others side by side. A model-stage's parts that the
plan offloads go to host memory after it and come back before it (``host_link``). A plan whose
fullest GPU would allocate more than its memory fails the step ("out of memory"), as does an
engine whose KV cache cannot hold one request.

Every sequence of the step is drawn: responses from the step's length distribution
(``generation.draw``), prompts all ``prompt_len_mean`` long (an assumption). The draw is seeded
by the step's conditions, so a plan's outcome at a step is the same for every policy.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

from ...ir import Module, Plan
from . import experts, stages
from .generation import draw
from .misspecified import NONE, Misspecification

HOST_EFFICIENCY = 0.8  # of the host link's bandwidth, for offloaded state (an assumption)


def seed_of(*parts) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little")


def resident_bytes(m: Module, plan: Plan, ms: str, kind: str) -> tuple[float, float]:
    """(bytes model-stage ``ms`` keeps on each of its GPUs between stages, bytes it offloads)."""
    lay = plan.layouts[ms]
    parts = stages.state_bytes(m.models[lay.model], lay, kind == "train")
    off = sum(parts[k] for k in lay.offload)
    return sum(parts.values()) - off, off


def shape_of(model) -> tuple:
    return (
        model.layers, model.hidden, model.heads, model.kv_heads, model.hd, model.ffn, model.vocab,
        model.mlp, model.head, model.dtype, model.trained,
        model.experts, model.experts_per_token, model.expert_ffn, model.shared_expert_ffn, model.dense_layers,
    )  # fmt: skip


def layout_of(lay) -> tuple:
    """What the truth reads of a layout (its caches' and the hidden truth's seeds' key): a named
    schedule other than the default, and TP, pipeline and DP overlap, only where set, so that layouts that ran
    before these existed keep their keys (and seeds)."""
    key = (
        lay.tp, lay.pp, lay.dp, lay.cp, lay.vpp, lay.zero, lay.recompute, lay.sp, lay.grad_dtype,
        lay.micro_batches, tuple(lay.layers), tuple(lay.mesh), lay.ep, lay.etp,
    )  # fmt: skip
    if lay.pipeline_schedule != lay.megatron_schedule:
        key += (lay.pipeline_schedule,)
    key += ("tp_overlap",) if lay.tp_overlap else ()
    posted_by_default = lay.pipeline_schedule != "one_f_one_b"  # ``Layout.pp_overlapped``'s default
    key += (("pp_overlap", lay.pp_overlapped),) if lay.pp_overlapped != posted_by_default else ()
    return key + (("no_dp_overlap",) if not lay.dp_overlap else ())


class EventTruth:
    """The event truth: ``evaluate`` a plan on the job at a step; ``misspec``: errors the cost
    model cannot know of (``misspecified``), none by default."""

    def __init__(self, misspec: Misspecification = NONE):
        self.misspec = misspec

    def evaluate(self, m: Module, plan: Plan, conditions: tuple) -> tuple[float, dict, dict, str]:
        """(step seconds, seconds per model-stage, bytes per model-stage, failure) of ``plan`` on
        ``m`` (the job at the step: its workload's length distribution, its cluster)."""
        (work,) = m.workloads.values()
        cluster = m.clusters[plan.cluster] if plan.cluster in m.clusters else next(iter(m.clusters.values()))
        rng = np.random.default_rng(seed_of(conditions, work.samples))
        dist = work.response_len_dist or [work.response_len_mean]
        responses = draw(dist, work.samples, rng)
        prompts = np.full(work.samples, work.prompt_len_mean, dtype=np.int64)
        lengths = prompts + responses
        # a mixture of experts' routing, drawn per model and step (its own stream: dense jobs draw as before)
        shares = {
            name: experts.routing(md, np.random.default_rng(seed_of(conditions, name)))
            for name, md in m.models.items()
            if md.moe
        }
        kinds = {ms: st.kind for st in work.stages for ms in st.model_stages()}
        kept, offloaded = {}, {}
        for ms in plan.layouts:
            kept[ms], offloaded[ms] = resident_bytes(m, plan, ms, kinds[ms])
        on_gpu: dict[int, float] = {}
        for ms, lay in plan.layouts.items():
            for g in lay.mesh:
                on_gpu[g] = on_gpu.get(g, 0.0) + kept[ms]
        seconds, memory = {}, {}
        failure = ""
        free: dict[int, float] = {}
        start = 0.0
        # model-stages of the same shape and layout play alike (a reference's infer and the actor's)
        played: dict[tuple, tuple] = {}
        for st in work.stages:
            end = start
            here = {ms: plan.layouts[ms] for ms in st.model_stages() if ms in plan.layouts}
            for ms, lay in here.items():
                model = m.models[lay.model]
                # training beside it on other GPUs: its gradient syncs share the fabric with this one's
                mesh = set(lay.mesh)
                beside = tuple(
                    x for o, x in here.items() if st.kind == "train" and o != ms and not mesh.intersection(x.mesh)
                )
                others = max(on_gpu[g] - kept[ms] for g in lay.mesh)
                routed = shares.get(lay.model)
                key = (
                    st.kind,
                    shape_of(model),
                    layout_of(lay),
                    others if st.kind == "generate" else None,
                    lay.model if routed is not None else None,  # each model routes its own way
                    tuple(layout_of(x) for x in beside),
                )
                if key not in played:
                    try:
                        if st.kind == "generate":
                            played[key] = stages.generate(
                                model, lay, work, cluster, prompts, responses, others, self.misspec, routed
                            )[:2]
                        else:
                            played[key] = stages.train_or_infer(
                                model, lay, work, cluster, lengths, st.kind, self.misspec, routed, beside
                            )
                    except MemoryError:
                        played[key] = (math.inf, math.inf)
                sec, mem = played[key]
                sec *= self.misspec.hidden_factor(seed_of(st.kind, key[1], key[2]))
                if st.kind != "generate":
                    mem += others
                if mem > cluster.gpu_memory:
                    failure = "out of memory"
                if offloaded[ms]:
                    link = cluster.host_link
                    sec += math.inf if link is None else 2 * offloaded[ms] / (link.bandwidth * HOST_EFFICIENCY)
                seconds[ms], memory[ms] = sec, mem
                begin = max([start] + [free.get(g, 0.0) for g in lay.mesh])
                for g in lay.mesh:
                    free[g] = begin + sec
                end = max(end, begin + sec)
            start = end
        if failure:
            return math.inf, seconds, memory, failure
        return start, seconds, memory, ""
