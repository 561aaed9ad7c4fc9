"""The cost of every model-stage of a plan where it runs: the analysis ``estimate``,
``calibrate``, ``derive-emus``, plan-search's explanations and the exports share.

``layout_costs`` prices each model-stage with the memory every other model-stage keeps on its
GPUs between stages (less what the plan offloads); ``step_time`` adds the stages in order, the
slowest group of GPU-sharing model-stages in each (``stage_groups``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from ...ir import Module, Plan
from .cost_model import C_PCIE, Candidates, CostModel, StageCost

__all__ = ["LayoutCost", "layout_costs", "stage_groups", "step_time"]


@dataclass
class LayoutCost:
    """Everything ``estimate`` knows about one model-stage of a plan."""

    cost: StageCost
    offload_feature: float
    offload_latency: float
    resident_kept: float  # bytes of this model-stage's state left on each of its GPUs between stages
    others: dict[int, float]  # GPU -> bytes other model-stages keep there
    offloaded: float = 0.0  # bytes of this model-stage's state each of its GPUs keeps in host memory

    def features(self, coeffs: np.ndarray) -> tuple[np.ndarray, float]:
        """Feature row and fixed latency of this model-stage's time (for calibrate)."""
        f = self.cost.features_for(coeffs)[0].copy()
        f[C_PCIE] += self.offload_feature
        return f, float(self.cost.latency[0]) + self.offload_latency

    def time(self, coeffs: np.ndarray) -> float:
        f, lat = self.features(coeffs)
        return float(f @ coeffs + lat)


def layout_costs(m: Module, plan: Plan, model: CostModel | None = None) -> dict[str, LayoutCost]:
    """Cost of every model-stage of ``plan``, with memory held by the others on shared GPUs."""
    cluster = m.clusters[plan.cluster]
    workload = m.workloads[plan.workload]
    model = model or CostModel(cluster)
    kinds = {ms: st.kind for st in workload.stages for ms in st.model_stages()}
    # First pass: what each model-stage keeps resident between stages.
    kept: dict[str, float] = {}
    offloaded: dict[str, float] = {}
    for ms, lay in plan.layouts.items():
        c = model.stage(m.models[lay.model], workload, kinds[ms], Candidates.of_layout(cluster, lay))
        parts = {"weights": c.weights[0], "grads": c.grads[0], "optimizer": c.optimizer[0]}
        off = sum(parts[k] for k in lay.offload)
        offloaded[ms] = off
        kept[ms] = float(c.resident_state[0] - off)
    on_gpu: dict[int, float] = defaultdict(float)
    for ms, lay in plan.layouts.items():
        for g in lay.mesh:
            on_gpu[g] += kept[ms]
    out = {}
    for ms, lay in plan.layouts.items():
        others = {g: on_gpu[g] - kept[ms] for g in lay.mesh}
        cand = Candidates.of_layout(cluster, lay, resident=max(others.values(), default=0.0))
        cost = model.stage(m.models[lay.model], workload, kinds[ms], cand)
        feat, lat = model.offload_time(offloaded[ms]) if offloaded[ms] else (0.0, 0.0)
        out[ms] = LayoutCost(cost, feat, lat, kept[ms], others, offloaded[ms])
    return out


def stage_groups(plan: Plan, model_stages: list[str]) -> list[list[str]]:
    """Model-stages of one stage grouped by shared GPUs (connected components)."""
    parent = {ms: ms for ms in model_stages}

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    owner: dict[int, str] = {}
    for ms in model_stages:
        for g in plan.layouts[ms].mesh:
            if g in owner:
                parent[find(ms)] = find(owner[g])
            else:
                owner[g] = ms
    groups: dict[str, list[str]] = defaultdict(list)
    for ms in model_stages:
        groups[find(ms)].append(ms)
    return list(groups.values())


def step_time(m: Module, plan: Plan, times: dict[str, float]) -> float:
    """Stages in order; in a stage, the slowest group of GPU-sharing model-stages."""
    total = 0.0
    for st in m.workloads[plan.workload].stages:
        mss = [ms for ms in st.model_stages() if ms in plan.layouts]
        if mss:
            total += max(sum(times[ms] for ms in g) for g in stage_groups(plan, mss))
    return total
