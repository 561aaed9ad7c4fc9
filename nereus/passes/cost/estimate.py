"""``estimate``: predicted time and peak memory of every model-stage, and the step time of a plan.

Results are IR attributes: on each layout ``time``, ``memory``, ``time_breakdown`` and
``memory_breakdown``; on the plan ``step_time``. A model-stage whose peak exceeds the GPU
memory is a diagnostic naming the model-stage, the GPU and the shortfall in bytes.

Memory on a GPU during a model-stage = its own peak + the state that every other model-stage
placed on that GPU keeps there between stages (weights; grads and optimizer state of trained
ones), less what the plan offloads. Stages run in order; inside a stage, model-stages on
disjoint GPUs run concurrently and those that share GPUs one after another.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from ...ir import Diagnostic, DiagnosticError, Loc, Module, Plan
from ...ir.plan import MemoryBreakdown, TimeBreakdown
from ...ir.printer import printed_precision
from ...ir.units import Dim, format_quantity
from .cost_model import C_PCIE, Candidates, CostModel, StageCost
from ..infra.pass_manager import ModulePass, Ref, no_such, register


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


def estimate_plan(m: Module, plan: Plan, model: CostModel | None = None) -> list[Diagnostic]:
    """Annotate ``plan`` with times and memory; returns out-of-memory diagnostics."""
    cluster = m.clusters[plan.cluster]
    model = model or CostModel(cluster)
    coeffs = model.coeffs
    costs = layout_costs(m, plan, model)
    problems = []
    times = {}
    for ms, lc in costs.items():
        lay = plan.layouts[ms]
        c = lc.cost
        own = float(c.memory()[0])
        gpu, others = max(lc.others.items(), key=lambda kv: (kv[1], -kv[0]))
        peak = own + others
        parts = c.breakdown(coeffs)
        parts["offload"] = lc.offload_feature * coeffs[C_PCIE] + lc.offload_latency
        t = lc.time(coeffs)
        times[ms] = t
        lay.time = printed_precision(t)
        lay.memory = round_bytes(peak)
        lay.time_breakdown = TimeBreakdown(**{k: printed_precision(v) for k, v in parts.items()})
        lay.memory_breakdown = MemoryBreakdown(
            weights=round_bytes(c.weights[0]), grads=round_bytes(c.grads[0]), optimizer=round_bytes(c.optimizer[0]),
            activations=round_bytes(c.activations[0]), kv_cache=round_bytes(c.kv_cache[0]), resident=round_bytes(others))
        if not np.isfinite(t):
            problems.append(Diagnostic(lay.loc, f"{ms}: the KV cache of one sequence does not fit on GPU {gpu} after "
                                                f"{format_quantity(Dim.SIZE, int(c.weights[0] + others))} of weights and resident state",
                                       "use more TP or PP for generation, or offload the state of other model-stages"))
        elif peak > cluster.gpu_memory:
            short = int(round(peak - cluster.gpu_memory))
            problems.append(Diagnostic(
                lay.loc, f"{ms} needs {_size(peak)} on GPU {gpu}, {short:,} bytes more than its {_size(cluster.gpu_memory)}",
                "breakdown: " + ", ".join(f"{k} {_size(v)}" for k, v in (
                    ("weights", c.weights[0]), ("grads", c.grads[0]), ("optimizer", c.optimizer[0]),
                    ("activations", c.activations[0]), ("kv_cache", c.kv_cache[0]), ("resident", others)) if v)))
    problems += host_memory_problems(m, plan, costs)
    plan.step_time = printed_precision(step_time(m, plan, times)) if all(np.isfinite(list(times.values()))) else None
    return problems


def host_memory_problems(m: Module, plan: Plan, costs: dict[str, LayoutCost]) -> list[Diagnostic]:
    """What the plan offloads must fit in host memory: per node, the offloaded bytes of every
    model-stage on its GPUs against the cluster's ``host_memory``."""
    cluster = m.clusters[plan.cluster]
    per_node: dict[int, float] = defaultdict(float)
    first: dict[int, str] = {}
    for ms, lc in costs.items():
        if lc.offloaded:
            for g in plan.layouts[ms].mesh:
                node = cluster.node_of(g)
                per_node[node] += lc.offloaded
                first.setdefault(node, ms)
    if not per_node or cluster.host_memory is None:  # the verifier refuses offload without host memory
        return []
    node, need = max(per_node.items(), key=lambda kv: (kv[1], -kv[0]))
    if need <= cluster.host_memory:
        return []
    lay = plan.layouts[first[node]]
    return [Diagnostic(lay.loc, f"the plan offloads {_size(need)} to the host memory of node {node}, which has "
                                f"{_size(cluster.host_memory)} (host_memory of @{cluster.name})",
                       "offload less state, or spread the offloading model-stages over more nodes")]


def round_bytes(n: float) -> int:
    """Bytes to whole MiB (estimates are not more precise than that)."""
    return int(round(n / 2**20)) * 2**20


def _size(n: float) -> str:
    """Bytes in the largest binary unit that keeps at least 1 (2 decimals): 73.41 GiB, 625.25 KiB."""
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= k:
            return f"{n / k:.2f} {unit}"
    return f"{int(n)} B"


@register
@dataclass(frozen=True)
class Estimate(ModulePass):
    """Options: ``plan`` (``@name``; default: every plan)."""

    name = "estimate"
    plan: Ref = ""

    def apply(self, module: Module) -> None:
        names = [self.plan.lstrip("@")] if self.plan else list(module.plans)
        if not names:
            raise DiagnosticError([Diagnostic(Loc(0, 0, module.filename), "estimate: the module has no plan to estimate",
                                              "write a plan, or find one with plan-search")])
        problems = []
        for name in names:
            plan = module.plans.get(name)
            if plan is None:
                raise no_such(module, "estimate", "plan", name)
            problems += estimate_plan(module, plan)
        if problems:
            raise DiagnosticError(problems, module.source)
