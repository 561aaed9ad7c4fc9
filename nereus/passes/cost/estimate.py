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

import dataclasses
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from ...ir import Diagnostic, DiagnosticError, Loc, Module, Plan
from ...ir.plan import MemoryBreakdown, TimeBreakdown
from ...ir.printer import printed_precision
from ...ir.units import Dim, format_bytes, format_quantity
from ..infra.pass_manager import ModulePass, Ref, no_such, register
from .cost_model import C_PCIE, CostModel
from .layout_costs import LayoutCost, layout_costs, step_time


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
        slack = own - float(c.counted()[0])  # held beyond what is counted (memory_slack)
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
            weights=round_bytes(c.weights[0]),
            grads=round_bytes(c.grads[0]),
            optimizer=round_bytes(c.optimizer[0]),
            activations=round_bytes(c.activations[0]),
            kv_cache=round_bytes(c.kv_cache[0]),
            slack=round_bytes(slack),
            resident=round_bytes(others),
        )
        if not np.isfinite(t):
            problems.append(
                Diagnostic(
                    lay.loc,
                    f"{ms}: the KV cache of one sequence does not fit on GPU {gpu} after "
                    f"{format_quantity(Dim.SIZE, int(c.weights[0] + others))} of weights and resident state",
                    "use more TP or PP for generation, or offload the state of other model-stages",
                )
            )
        elif peak > cluster.gpu_memory:
            short = int(round(peak - cluster.gpu_memory))
            problems.append(
                Diagnostic(
                    lay.loc,
                    f"{ms} needs {format_bytes(peak)} on GPU {gpu}, {short:,} bytes more than its "
                    f"{format_bytes(cluster.gpu_memory)}",
                    "breakdown: "
                    + ", ".join(
                        f"{k} {format_bytes(v)}"
                        for k, v in (
                            ("weights", c.weights[0]),
                            ("grads", c.grads[0]),
                            ("optimizer", c.optimizer[0]),
                            ("activations", c.activations[0]),
                            ("kv_cache", c.kv_cache[0]),
                            ("slack", slack),
                            ("resident", others),
                        )
                        if v
                    ),
                )
            )
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
    return [
        Diagnostic(
            lay.loc,
            f"the plan offloads {format_bytes(need)} to the host memory of node {node}, which has "
            f"{format_bytes(cluster.host_memory)} (host_memory of @{cluster.name})",
            "offload less state, or spread the offloading model-stages over more nodes",
        )
    ]


def round_bytes(n: float) -> int:
    """Bytes to whole MiB (estimates are not more precise than that)."""
    return int(round(n / 2**20)) * 2**20


@register
@dataclass(frozen=True)
class Estimate(ModulePass):
    """Options: ``plan`` (``@name``; default: every plan), ``oom`` (``error``: a plan that does
    not fit is an error; ``warn``: its estimates are kept and what does not fit becomes warnings,
    for a caller that asks whether the running plan still fits)."""

    name = "estimate"
    plan: Ref = ""
    oom: str = "error"

    def apply(self, module: Module) -> None:
        if self.oom not in ("error", "warn"):
            raise DiagnosticError(
                [Diagnostic(Loc(0, 0, module.filename), f"estimate: oom is error or warn, got '{self.oom}'")]
            )
        names = [self.plan] if self.plan else list(module.plans)
        if not names:
            raise DiagnosticError(
                [
                    Diagnostic(
                        Loc(0, 0, module.filename),
                        "estimate: the module has no plan to estimate",
                        "write a plan, or find one with plan-search",
                    )
                ]
            )
        problems = []
        for name in names:
            plan = module.plans.get(name)
            if plan is None:
                raise no_such(module, "estimate", "plan", name)
            problems += estimate_plan(module, plan)
        if problems and self.oom == "warn":
            module.warnings.extend(dataclasses.replace(d, severity="warning") for d in problems)
        elif problems:
            raise DiagnosticError(problems, module.source)
