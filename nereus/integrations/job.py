"""A one-model training job as an IR module: the cluster of this process group, the model, plans.

``training_job(model, {"a": layout(...), "b": layout(...)}, gpus)`` is what a training loop
under ``run_local`` or ``torchrun`` hands the passes: one node of ``gpus`` GPUs (rank == GPU),
a workload with one train stage of ``model`` (``<name>.train``), and one plan per layout with
its EMUs derived, so that ``plan_layout`` and ``plan-transition`` can read them. The cluster's
figures are nominal (an H100 node): they size the cost model, not the run.
"""

from __future__ import annotations

from ..ir import Cluster, Layout, Link, Model, Module, Plan, Stage, Workload, verify
from ..ir.model import even_split
from ..registry import run_pipeline

GIB = 2**30


def layout(
    model: Model, tp: int = 1, dp: int = 1, pp: int = 1, mesh: list[int] | None = None, micro_batches: int | None = None
) -> Layout:
    """The train layout of ``model``: layers split evenly over ``pp`` stages, GPUs 0.. in (dp, pp, tp)
    order, ``pp`` micro-batches per step unless told (1F1B's least)."""
    ranges = [(lo, hi - 1) for lo, hi in (even_split(model.layers, pp, r) for r in range(pp))]
    return Layout(
        model_stage=f"{model.name}.train",
        tp=tp,
        pp=pp,
        dp=dp,
        layers=ranges,
        mesh=list(range(tp * pp * dp)) if mesh is None else list(mesh),
        micro_batches=pp if micro_batches is None else micro_batches,
    )


def training_job(
    model: Model, layouts: dict[str, Layout], gpus: int, *, rows: int = 4, seq: int = 16, stage: str = "train"
) -> Module:
    """The verified module with a plan per entry of ``layouts`` and their EMUs. ``stage``: the
    workload's one stage (``train``, or ``generate`` for a weights-only job such as a push to
    generation engines), which names the layouts' model-stage."""
    cluster = Cluster(
        name="node",
        nodes=1,
        gpus_per_node=gpus,
        gpu_memory=80 * GIB,
        peak_flops=989e12,
        hbm_bandwidth=3.35e12,
        intra_node=Link(450e9, 2e-6),
        inter_node=Link(50e9, 5e-6),
    )
    work = Workload(
        name="job",
        algorithm="grpo",
        roles=[model.name],
        global_batch=max(1, rows // 2),
        group_size=2,
        prompt_len_mean=seq // 2,
        prompt_len_max=seq // 2,
        response_len_mean=seq // 2,
        response_len_max=seq // 2,
        micro_batch=1,
        stages=[Stage(name=stage, kind=stage, models=[model.name])],
    )
    plans = {
        name: Plan(name=name, workload="job", cluster="node", layouts={lay.model_stage: lay})
        for name, lay in layouts.items()
    }
    m = Module(clusters={"node": cluster}, models={model.name: model}, workloads={"job": work}, plans=plans)
    verify(m)
    return run_pipeline(m, ",".join(f"derive-emus{{plan=@{name}}}" for name in layouts))
