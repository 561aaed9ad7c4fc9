"""The plan users write by hand today: the peer ``plan-search`` is measured against.

As in verl's hybrid engine and OpenRLHF's colocated mode: every model-stage of a stage shares
all available GPUs and they run one after another; each model-stage takes the largest TP that
fits in a node (and divides its heads; after GPU failures, the largest that still uses 90% of
the GPUs), then the smallest PP (powers of two) with which the
whole plan fits in memory, and DP fills the GPUs, TP groups inside nodes (the same placement
plan-search uses, so that failed GPUs hurt both alike). Training uses activation recomputation,
ZeRO-1 and 4 x PP micro-batches, as the frameworks' defaults do. The plan is costed by the same
``estimate`` as searched plans, so the comparison is like for like.
"""

from __future__ import annotations

from ..ir import Cluster, Layout, Module, Plan, Workload
from ..ir.model import even_split
from .estimate import estimate_plan
from .plan_search import place_blocks


def greedy_plan(m: Module, workload: Workload, cluster: Cluster, name: str = "greedy") -> Plan | None:
    """The hand-written plan, estimated; None when no PP makes it fit."""
    gpus = cluster.available_gpus()
    n = len(gpus)
    per_node = cluster.gpus_per_node
    free = {}
    for g in gpus:
        free[g // per_node] = free.get(g // per_node, 0) + 1
    pp_of = {ms: 1 for ms in workload.model_stages()}
    while True:
        layouts, colocate = {}, []
        for st in workload.stages:
            mss = st.model_stages()
            if len(mss) > 1:
                colocate.append(list(mss))
            for ms in mss:
                model = m.models[ms.rpartition(".")[0]]
                usable_with = lambda t: sum(f // t * t for f in free.values())  # TP groups inside nodes
                # the largest TP that fits in a node, among those that still use 90% of the GPUs
                # (after failures, a full-node TP would leave most GPUs idle; a person would go lower)
                tp = max(t for t in range(1, min(cluster.gpus_per_node, n) + 1)
                         if model.heads % t == 0 and (t % model.kv_heads == 0 or model.kv_heads % t == 0)
                         and usable_with(t) >= 0.9 * n)
                pp = pp_of[ms]
                usable = usable_with(tp)
                dp = usable // (tp * pp)
                if dp < 1 or pp > model.layers:
                    return None
                (mesh,) = place_blocks(gpus, per_node, [(tp * pp * dp, tp)])
                train = st.kind == "train"
                layers = [(lo, hi - 1) for lo, hi in (even_split(model.layers, pp, r) for r in range(pp))]
                layouts[ms] = Layout(model_stage=ms, tp=tp, pp=pp, dp=dp, layers=layers, mesh=mesh,
                                     micro_batches=4 * pp if pp > 1 else 1, zero=1 if train and dp > 1 else 0,
                                     recompute=train)
        plan = Plan(name=name, workload=workload.name, cluster=cluster.name, colocate=colocate, layouts=layouts)
        problems = estimate_plan(m, plan)
        if not problems:
            return plan
        # grow the pipeline of the model-stages that did not fit, and try again
        short = [d.message.split()[0].rstrip(":") for d in problems]
        grown = False
        for ms in short:
            if ms in pp_of and pp_of[ms] * 2 <= m.models[ms.rpartition(".")[0]].layers:
                pp_of[ms] *= 2
                grown = True
        if not grown:
            return None
