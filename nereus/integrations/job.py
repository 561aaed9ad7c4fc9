"""A live RL job as an IR module: the cluster of this process group, the models, plans.

``rl_job([actor, ref], {"a": [layout(actor, tp=2, dp=2), layout(ref, dp=4, stage="infer")]}, gpus)``
is what a training loop under ``run_local`` or ``torchrun`` hands the passes: one node of
``gpus`` GPUs (rank == GPU), a workload whose stages are the layouts' model-stages
(``actor.train``, ``ref.infer``, ``critic.train``), and one plan per entry with its EMUs
derived, so that ``plan_layout`` and ``plan-transition`` read every model's state and one
transition moves them all. ``training_job(model, {"a": layout(...)}, gpus)`` is the one-model
case. The cluster's figures are nominal (an H100 node): they size the cost model, not the run.
"""

from __future__ import annotations

import dataclasses

from ..ir import Cluster, Layout, Link, Model, Module, Plan, Stage, Workload, verify
from ..ir.model import even_split
from ..registry import run_pipeline

GIB = 2**30


def layout(
    model: Model,
    tp: int = 1,
    dp: int = 1,
    pp: int = 1,
    mesh: list[int] | None = None,
    micro_batches: int | None = None,
    stage: str = "train",
    zero: int = 0,
) -> Layout:
    """The layout of ``model``'s ``stage`` (``train``, ``infer``, ``generate``): layers split evenly
    over ``pp`` stages, GPUs 0.. in (dp, pp, tp) order, ``pp`` micro-batches per step unless told
    (1F1B's least); ``zero``: the ZeRO stage over DP (3: FSDP2 in the live model)."""
    ranges = [(lo, hi - 1) for lo, hi in (even_split(model.layers, pp, r) for r in range(pp))]
    return Layout(
        model_stage=f"{model.name}.{stage}",
        tp=tp,
        pp=pp,
        dp=dp,
        layers=ranges,
        mesh=list(range(tp * pp * dp)) if mesh is None else list(mesh),
        micro_batches=pp if micro_batches is None else micro_batches,
        zero=zero,
    )


KINDS = ("generate", "infer", "train")  # the order a step runs its stages in


def rl_job(
    models: list[Model],
    plans: dict[str, dict[str, Layout] | list[Layout]],
    gpus: int,
    *,
    rows: int = 4,
    seq: int = 16,
    algorithm: str | None = None,
    group: int = 2,
    cluster: Cluster | None = None,
) -> Module:
    """The verified module of an RL job whose model-stages are the layouts' (``actor.train``,
    ``ref.infer``, ``critic.train``, ...): a workload with one stage per kind that occurs
    (generate, infer, train, in that order), each running the models that have a layout of that
    kind, and one plan per entry of ``plans`` with its EMUs derived. ``algorithm`` defaults to
    ``ppo`` when a trained model has a value head (a critic), ``grpo`` otherwise; ``group``:
    responses per prompt. ``cluster``: the machine (one node of ``gpus``); by default
    nominal H100 figures (named ``node``), which size the cost model, not the run. ``rows`` sequences of
    ``seq`` tokens (half prompt, half response) a step."""
    cluster = cluster or Cluster(
        name="node",
        nodes=1,
        gpus_per_node=gpus,
        gpu_memory=80 * GIB,
        peak_flops=989e12,
        hbm_bandwidth=3.35e12,
        intra_node=Link(450e9, 2e-6),
        inter_node=Link(50e9, 5e-6),
    )
    by_name = {m.name: m for m in models}
    plans = {
        name: {lay.model_stage: lay for lay in (p.values() if isinstance(p, dict) else p)} for name, p in plans.items()
    }
    seen = {tuple(ms.split(".")) for p in plans.values() for ms in p}  # (model, kind)
    unknown = sorted({kind for _, kind in seen} - set(KINDS))
    if unknown:
        raise ValueError(f"model-stage kinds {', '.join(unknown)}: the layouts' model-stages end in {', '.join(KINDS)}")
    stages = [
        Stage(name=kind, kind=kind, models=sorted(model for model, k in seen if k == kind))
        for kind in KINDS
        if any(k == kind for _, k in seen)
    ]
    if algorithm is None:
        algorithm = "ppo" if any(m.head == "value" and m.trained for m in models) else "grpo"
    work = Workload(
        name="job",
        algorithm=algorithm,
        roles=[m for m in by_name if any(m in st.models for st in stages)],
        global_batch=max(1, rows // group),
        group_size=group,
        prompt_len_mean=seq // 2,
        prompt_len_max=seq // 2,
        response_len_mean=seq // 2,
        response_len_max=seq // 2,
        micro_batch=1,
        stages=stages,
    )
    module_plans = {
        name: Plan(
            name=name, workload="job", cluster=cluster.name, layouts=dict(lays), colocate=colocated(lays, stages)
        )
        for name, lays in plans.items()
    }
    used = {name: by_name[name] for name in work.roles}
    m = Module(clusters={cluster.name: cluster}, models=used, workloads={"job": work}, plans=module_plans)
    verify(m)
    return run_pipeline(m, ",".join(f"derive-emus{{plan=@{name}}}" for name in plans))


def colocated(layouts: dict[str, Layout], stages: list[Stage]) -> list[list[str]]:
    """The model-stages of one stage that share a GPU, as one colocated group per stage: a live
    loop runs a stage's models one after another (PPO's actor and critic updates), so sharing
    GPUs is what it does."""
    groups = []
    for st in stages:
        mss = [ms for ms in st.model_stages() if ms in layouts]
        if any(set(layouts[x].mesh) & set(layouts[y].mesh) for i, x in enumerate(mss) for y in mss[i + 1 :]):
            groups.append(mss)
    return groups


def training_job(model: Model, layouts: dict[str, Layout], gpus: int, *, rows: int = 4, seq: int = 16) -> Module:
    """A one-model job (``rl_job``): a plan per entry of ``layouts``, each the model's one
    model-stage (``actor.train``; ``actor.generate`` for a weights-only job such as a push to
    generation engines)."""
    return rl_job([model], {name: [lay] for name, lay in layouts.items()}, gpus, rows=rows, seq=seq, algorithm="grpo")


def restrict(module: Module, model_stages: set[str]) -> Module:
    """``module`` with only ``model_stages`` in its workloads and plans (their EMUs kept, the
    transitions dropped): the part of a job one component moves. The trainer's transition of a
    job whose generation engines refill their weights by a push is planned on it, so that no
    trainer shard is expected from, or sent to, an engine."""
    workloads = {
        name: dataclasses.replace(
            w,
            stages=[
                dataclasses.replace(st, models=[m for m in st.models if f"{m}.{st.name}" in model_stages])
                for st in w.stages
            ],
        )
        for name, w in module.workloads.items()
    }
    for w in workloads.values():
        w.stages = [st for st in w.stages if st.models]
        w.roles = [r for r in w.roles if any(r in st.models for st in w.stages)]
    plans = {
        name: dataclasses.replace(
            p,
            layouts={ms: lay for ms, lay in p.layouts.items() if ms in model_stages},
            colocate=[kept for g in p.colocate if len(kept := [ms for ms in g if ms in model_stages]) > 1],
        )
        for name, p in module.plans.items()
    }
    roles = {r for w in workloads.values() for r in w.roles}
    return Module(
        clusters=dict(module.clusters),
        models={name: m for name, m in module.models.items() if name in roles},
        workloads=workloads,
        plans=plans,
        emus={k: e for k, e in module.emus.items() if k[1] in model_stages},
    )
