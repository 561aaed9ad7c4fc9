"""What every export target shares: the header, a layout's description, stage kinds, the
pipeline-flush note, and the vLLM memory budget of a generating model-stage."""

from __future__ import annotations

import math

from ..ir import Layout, Module, Plan
from ..ir.attributes import compress_ints


def header(m: Module, plan: Plan, framework: str, what: str) -> list[str]:
    lines = [
        f"# Nereus plan @{plan.name} from {m.filename or '<input>'}, exported for {framework}: {what}",
        "# each value's comment names the Nereus layout (or workload / cluster attribute) it came from",
    ]
    return lines + [f"# layout {ms}: {desc(lay)}" for ms, lay in plan.layouts.items()]


def desc(lay: Layout) -> str:
    sizes = f"tp {lay.tp} x pp {lay.pp}" + (f" x cp {lay.cp}" if lay.cp > 1 else "") + f" x dp {lay.dp}"
    if lay.carves_experts:
        sizes += f", ep {lay.ep}" + (f" x etp {lay.expert_tp}" if lay.expert_tp != lay.tp else "")
    return f"{sizes} on GPUs {compress_ints(sorted(lay.mesh))}"


def kinds(m: Module, plan: Plan) -> dict[str, str]:
    return {ms: st.kind for st in m.workloads[plan.workload].stages for ms in st.model_stages()}


def flushes(m: Module, plan: Plan, lay: Layout, dp: int, framework: str) -> list[str]:
    """A note when the layout's micro-batches per pipeline flush differ from what the target
    derives: one flush per optimizer step of mini_batch / (dp x micro_batch) micro-batches."""
    w = m.workloads[plan.workload]
    n = (w.mini_batch or w.samples) // (dp * w.micro_batch)
    if lay.pp == 1 or n == lay.micro_batches:
        return []
    return [
        f"not expressible in {framework}: {lay.model_stage} micro_batches = {lay.micro_batches} per pipeline flush; "
        f"{framework} flushes once per optimizer step: mini_batch {w.mini_batch or w.samples} / (dp {dp} x micro_batch "
        f"{w.micro_batch}) = {n} micro-batches"
    ]


def generate_memory(m: Module, plan: Plan, model_stage: str) -> tuple[float, float, float]:
    """``(gpu_memory_utilization, KV-cache bytes, bytes other model-stages keep)`` per GPU of a
    generating model-stage, as the cost model budgets it: vLLM's default 0.9 of the GPU's memory,
    less what other model-stages keep resident on the same GPUs (rounded down to 0.01)."""
    from ..passes.cost.cost_model import VLLM_GPU_MEMORY_UTILIZATION
    from ..passes.cost.layout_costs import layout_costs

    lc = layout_costs(m, plan)[model_stage]
    gpu = m.clusters[plan.cluster].gpu_memory
    others = max(lc.others.values(), default=0.0)
    util = math.floor((VLLM_GPU_MEMORY_UTILIZATION * gpu - others) / gpu * 100) / 100
    return util, float(lc.cost.kv_cache[0]), others
