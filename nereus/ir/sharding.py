"""Derive the EMUs of a model-stage from its layout: who holds which slice of every tensor.

Weights follow the model's TP sharding rules (``Model.tp_span``) and the layout's pipeline
layer ranges; one entry per (family, pipeline stage) covers the stage's whole layer range,
since every layer of a stage is sliced the same way (a family that exists in some layers only,
a mixture of experts' dense first layers, covers the stage's layers it exists in).

A trained model in a train stage also holds its optimizer state: the fp32 master copy and
Adam's two moments (``master``, ``exp_avg``, ``exp_avg_sq``), sliced like the weights. Under
ZeRO (``zero`` on the layout) the state is sharded over DP as FSDP2 shards a parameter: each
TP-local slice is split along its dimension 0 among the DP replicas by the uneven-split rule
(``even_split``): optimizer state from ZeRO-1, weights too under ZeRO-3. Gradients are not
part of an EMU: they are recomputed every step and carry nothing across a step boundary.

Expert parallelism (``ep``, ``etp`` on the layout of a mixture of experts) carves expert ranks
from each pipeline stage's dp x cp x tp ranks as Megatron does (``Layout.expert_rank``): EP rank
``i`` holds experts ``[i E / ep, (i + 1) E / ep)`` (the uneven-split rule), each split by ETP as a
dense MLP is by TP, and ZeRO splits the experts' state over the expert-DP ranks holding the same
slice. The router, the shared expert and every dense tensor keep the dense rule.
"""

from __future__ import annotations

from typing import cast

from .emu import Emu, Shard, SliceEntry
from .model import Model, even_split
from .plan import Layout

OPTIMIZER_STATES = ("master", "exp_avg", "exp_avg_sq")


def states_of(model: Model, stage_kind: str) -> tuple[str, ...]:
    """The states an EMU of this model in a stage of this kind holds."""
    return ("weight", *OPTIMIZER_STATES) if model.trained and stage_kind == "train" else ("weight",)


def dp_sharded(state: str, zero: int) -> bool:
    """Whether ZeRO stage ``zero`` splits ``state`` over the DP replicas."""
    return zero >= 3 if state == "weight" else zero >= 1


def _held(model: Model, layout: Layout, pp: int) -> list[tuple]:
    """(spec, layers) of every tensor pipeline stage ``pp`` holds, in inventory order: a per-layer
    family over the stage's layers it exists in, a non-layer tensor (layers None) on the stages
    holding it."""
    lo, hi = layout.layers[pp]
    out: list[tuple] = []
    for spec in model.tensors.values():
        if spec.per_layer:
            a, b = spec.span(model.layers)
            if max(a, lo) <= min(b, hi):
                out.append((spec, (max(a, lo), min(b, hi))))
        elif pp in model.stages_holding(spec, layout.pp):
            out.append((spec, None))
    return out


def shard_entries(
    model: Model, layout: Layout, pp: int, tp: int, states=("weight",), dp_rank: int = 0
) -> list[SliceEntry]:
    """The slices held at pipeline stage ``pp``, tensor rank ``tp`` of DP replica ``dp_rank``, in inventory order."""
    if model.moe and layout.carves_experts:
        return _carved_entries(model, layout, pp, tp, dp_rank, states)
    return _dp_entries(_tp_slices(model, layout, pp, tp, states), layout.replicas, dp_rank)


def _carved_entries(model: Model, layout: Layout, pp: int, tp: int, replica: int, states) -> list[SliceEntry]:
    """``shard_entries`` under expert parallelism: dense tensors by the dense rule, each routed
    expert held by its EP rank only, split by ETP and (ZeRO) over expert-DP."""
    ep, etp_rank, edp_rank = layout.expert_rank(replica, tp)
    experts = even_split(cast(int, model.experts), layout.ep, ep)
    held = _held(model, layout, pp)
    out: list[SliceEntry] = []
    for state in states:
        dense_split = dp_sharded(state, layout.zero) and layout.replicas > 1
        expert_split = dp_sharded(state, layout.zero) and layout.expert_dp > 1
        for spec, layers in held:
            e = model.expert_of.get(spec.family)
            if e is None:
                box = model.tp_box(spec, layout.tp, tp)
                parts, rank = (layout.replicas, replica) if dense_split else (1, 0)
            elif experts[0] <= e < experts[1]:
                box = model.tp_box(spec, layout.expert_tp, etp_rank)
                parts, rank = (layout.expert_dp, edp_rank) if expert_split else (1, 0)
            else:
                continue
            a, b = box[0]
            first = even_split(b - a, parts, rank)
            box = ((a + first[0], a + first[1]),) + box[1:]
            if all(b > a for a, b in box):  # a dimension smaller than its split leaves the last ranks nothing
                out.append(SliceEntry(family=spec.family, layers=layers, box=box, state=state))
    return out


def _tp_slices(model: Model, layout: Layout, pp: int, tp: int, states) -> list[tuple]:
    """The slices at (``pp``, ``tp``) before ZeRO splits them, in inventory order: (state,
    family, layers, TP box, split over DP); a slice no replica splits comes as its ``SliceEntry``
    (None when empty), which every replica shares."""
    held = _held(model, layout, pp)
    boxes: dict[str, tuple] = {}  # the TP box of a tensor is the same for every state
    out: list = []
    for state in states:
        split = dp_sharded(state, layout.zero) and layout.replicas > 1
        for spec, layers in held:
            box = boxes.get(spec.family)
            if box is None:
                box = boxes[spec.family] = model.tp_box(spec, layout.tp, tp)
            if split:
                out.append((state, spec.family, layers, box))
            elif any(b <= a for a, b in box):
                out.append(None)  # a dimension smaller than TP leaves the last ranks with nothing of it
            else:
                out.append(SliceEntry(family=spec.family, layers=layers, box=box, state=state))
    return out


def _dp_entries(slices: list, dp: int, dp_rank: int) -> list[SliceEntry]:
    """The entries of DP replica ``dp_rank`` from ``_tp_slices``: dimension 0 of the split ones
    divided among ``dp`` replicas."""
    out = []
    for s in slices:
        if s is None:
            continue
        if isinstance(s, SliceEntry):
            out.append(s)
            continue
        state, family, layers, box = s
        a, b = box[0]
        lo, hi = even_split(b - a, dp, dp_rank)
        box = ((a + lo, a + hi),) + box[1:]
        if any(hi <= lo for lo, hi in box):
            continue  # a dimension smaller than TP (or DP) leaves the last ranks with nothing of it
        out.append(SliceEntry(family=family, layers=layers, box=box, state=state))
    return out


def derive_emus(
    plan_name: str, model: Model, layout: Layout, states=("weight",), kv_cache: int | None = None
) -> list[Emu]:
    """Every EMU (one per DP replica) of ``layout``'s model-stage (``kv_cache``: bytes per shard, for generation).

    Replicas whose slices are equal share one entry tuple, which the printer and the verifier
    use to treat them once.
    """
    if model.moe and layout.carves_experts:
        return _carved_emus(plan_name, model, layout, states, kv_cache)
    sharded = any(dp_sharded(s, layout.zero) for s in states) and layout.replicas > 1
    cache: dict[tuple[int, int, int], tuple[SliceEntry, ...]] = {}
    tp_slices: dict[tuple[int, int], list[tuple]] = {}  # replicas differ only in what ZeRO splits
    emus = []
    for d in range(layout.replicas):
        shards = []
        for p in range(layout.pp):
            for t in range(layout.tp):
                key = (d if sharded else 0, p, t)
                if key not in cache:
                    if (p, t) not in tp_slices:
                        tp_slices[(p, t)] = _tp_slices(model, layout, p, t, states)
                    cache[key] = tuple(_dp_entries(tp_slices[(p, t)], layout.replicas, key[0]))
                shards.append(Shard(pp=p, tp=t, gpu=layout.gpu(d, p, t), entries=cache[key], kv_cache=kv_cache))
        # a list: Emu.__post_init__ makes it a tuple
        emus.append(Emu(plan=plan_name, model_stage=layout.model_stage, replica=d, shards=shards))  # type: ignore[arg-type]
    return emus


def _carved_emus(plan_name: str, model: Model, layout: Layout, states, kv_cache: int | None) -> list[Emu]:
    """``derive_emus`` under expert parallelism: a shard's slices depend on its replica through
    ZeRO's dense split and its expert ranks, so shards with equal ranks share one entry tuple."""
    sharded = any(dp_sharded(s, layout.zero) for s in states)
    cache: dict[tuple, tuple[SliceEntry, ...]] = {}
    emus = []
    for d in range(layout.replicas):
        shards = []
        for p in range(layout.pp):
            for t in range(layout.tp):
                ep, etp, edp = layout.expert_rank(d, t)
                key = (p, t, d if sharded else 0, ep, etp, edp if sharded else 0)
                if key not in cache:
                    cache[key] = tuple(_carved_entries(model, layout, p, t, d, states))
                shards.append(Shard(pp=p, tp=t, gpu=layout.gpu(d, p, t), entries=cache[key], kv_cache=kv_cache))
        emus.append(Emu(plan=plan_name, model_stage=layout.model_stage, replica=d, shards=shards))  # type: ignore[arg-type]
    return emus
