"""``--to vllm``: ``vllm.EngineArgs`` keyword arguments and ``vllm serve`` flags per generating model-stage."""

from __future__ import annotations

import json

from ..ir import Module, Plan
from .common import desc, generate_memory, header, kinds

DTYPE = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def vllm_expert_parallel(lay) -> str | None:
    """How vLLM runs a generation layout's expert parallelism (``enable_expert_parallel``: each
    expert whole, split over every TP x DP rank of a server): ``"engine"`` when EP spans each
    engine's TP ranks, ``"server"`` when it spans all DP engines of one server, None when vLLM
    cannot run it so (or there is none)."""
    if not lay.carves_experts or lay.expert_tp != 1 or lay.pp > 1 or lay.cp > 1:
        return None
    return "engine" if lay.ep == lay.tp else "server" if lay.ep == lay.tp * lay.dp else None


def vllm_engine_args(m: Module, plan: Plan, model_stage: str) -> dict:
    """``vllm.EngineArgs`` keyword arguments of one engine of a generating model-stage (no ``model``)."""
    lay, w = plan.layouts[model_stage], m.workloads[plan.workload]
    md = m.models[lay.model]
    kw = {
        "tensor_parallel_size": lay.tp,
        "pipeline_parallel_size": lay.pp,
        "max_model_len": w.prompt_len_max + w.response_len_max,
        "gpu_memory_utilization": generate_memory(m, plan, model_stage)[0],
    }
    if md.dtype in DTYPE:
        kw["dtype"] = DTYPE[md.dtype]
    if md.moe and vllm_expert_parallel(lay):
        kw["enable_expert_parallel"] = True
    if lay.fp8 or md.dtype == "fp8":
        kw["quantization"] = "fp8"
    return kw


def vllm_lines(m: Module, plan: Plan, target: str) -> list[str]:
    w, c = m.workloads[plan.workload], m.clusters[plan.cluster]
    lines = header(
        m,
        plan,
        "vLLM",
        "keyword arguments of vllm.LLM(model=..., **ENGINE_ARGS[model_stage]) "
        "and vllm.EngineArgs, one engine per DP replica",
    )
    engines = {}
    for ms, k in kinds(m, plan).items():
        if k != "generate":
            continue
        lay = plan.layouts[ms]
        kw = engines[ms] = vllm_engine_args(m, plan, ms)
        util, kv, others = generate_memory(m, plan, ms)
        per = lay.tp * lay.pp * lay.cp
        groups = [lay.mesh[i * per : (i + 1) * per] for i in range(lay.dp)]
        shown = " ".join(str(g) for g in groups[:8]) + (f" ... ({lay.dp} in all)" if lay.dp > 8 else "")
        flags = " ".join(f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in kw.items())
        ep = vllm_expert_parallel(lay) if m.models[lay.model].moe else None
        lines += [
            "",
            f"# {ms}: {desc(lay)}, model @{lay.model}",
            f"#   tensor_parallel_size, pipeline_parallel_size: layout {ms}; engine instances: its dp = {lay.dp}, "
            f"on global GPUs {shown}",
            f"#   max_model_len: workload @{w.name} prompt_len_max + response_len_max",
            f"#   gpu_memory_utilization: layout {ms}, the cost model's budget: 0.9 of {c.gpu_memory / 2**30:.0f} GiB "
            f"less {others / 2**30:.1f} GiB other model-stages keep on these GPUs; KV cache {kv / 2**30:.1f} GiB per "
            "GPU",
        ]
        per_instance = (
            f"#   per instance: CUDA_VISIBLE_DEVICES={','.join(str(g % c.gpus_per_node) for g in groups[0])} "
            f"vllm serve MODEL {flags}"
        )
        one_server = f"vllm serve MODEL {flags} --data-parallel-size {lay.dp}"
        if ep == "engine":  # one server for all would spread the experts over its TP x DP ranks
            lines += [
                per_instance,
                f"#   ep = tp = {lay.ep}: each engine holds every expert, so one server per instance",
            ]
        elif ep == "server":
            lines.append(f"#   ep = {lay.ep} = tp x dp: experts span the engines (vLLM's EP is TP x DP): {one_server}")
        else:
            lines += [per_instance, f"#   or one server for all: {one_server}"]
        if any(len({c.node_of(g) for g in grp}) > 1 for grp in groups):
            lines.append("#   an engine spans nodes: vLLM runs it with --distributed-executor-backend ray")
        for what, bad, why in (
            ("cp", lay.cp > 1, "vLLM does not split a prompt's context over GPUs this way"),
            ("sp", lay.sp, "vLLM has no sequence parallelism"),
            (
                "offload",
                lay.offload,
                "freeing the engine's memory between steps is the RL framework's job (vLLM's sleep mode)",
            ),
        ):
            if bad:
                lines.append(f"# not expressible in vLLM: {ms} {what} = {getattr(lay, what)} ({why})")
        if m.models[lay.model].moe and lay.carves_experts and ep is None:
            lines.append(
                f"# not expressible in vLLM: {ms} ep = {lay.ep}, etp = {lay.expert_tp} (vLLM keeps each expert "
                "whole over all TP x DP ranks: ep = tp or tp x dp, etp = 1)"
            )
        if m.models[lay.model].dtype == "fp8":
            lines.append(
                f"# not expressible in vLLM: model @{lay.model} dtype = fp8 weights (exported as quantization = fp8)"
            )
    if not engines:
        lines.append("# not exported: the plan has no generating model-stage")
    return lines + ["ENGINE_ARGS = " + json.dumps(engines, indent=4)]  # str, int and float only: valid Python
