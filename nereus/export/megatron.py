"""``--to megatron``: Megatron-LM ``pretrain_gpt.py`` arguments per trained model-stage.

Each model-stage gets a bash array of arguments (``ACTOR_TRAIN_ARGS``) and one of environment
settings (``ACTOR_TRAIN_ENV``: ``CUDA_DEVICE_MAX_CONNECTIONS=1``, which Megatron-LM's
``validate_args`` requires with TP or CP > 1, so that its communication overlaps in order).
The model's shape, RoPE base, norm epsilon and q/k/v biases are written out; ZeRO-1 is the
distributed optimizer, ZeRO-2/3 Megatron-FSDP (``--use-megatron-fsdp`` with
``--data-parallel-sharding-strategy optim_grads`` or ``optim_grads_params``); bf16 gradients are
``--grad-reduce-in-bf16`` (Megatron-LM otherwise reduces bf16 models' gradients in fp32). The
data-parallel communication the estimate hides behind compute (``dp_overlap``, on by default) is
asked for: ``--overlap-grad-reduce`` and, with a sharded optimizer, ``--overlap-param-gather``
(both off in Megatron-LM by default). Pipeline sends overlap in Megatron-LM's interleaved schedule
unless ``--no-overlap-p2p-communication`` (``pp_overlap = false``), and never under 1F1B.
"""

from __future__ import annotations

import shlex

from ..ir import Layout, Module, Plan
from .common import desc, flushes, header, kinds

# what Megatron-LM (and Hugging Face's Llama) assume when a model gives no value
DEFAULT_ROTARY_BASE = 10000
DEFAULT_NORM_EPSILON = 1e-5
FSDP_SHARDING = {2: "optim_grads", 3: "optim_grads_params"}


def pipeline_layout(sizes: list[int], vpp: int) -> str:
    """Megatron-LM's ``--pipeline-model-parallel-layout`` for PP ranks holding ``sizes`` layers,
    each rank's split into ``vpp`` equal virtual stages: the pp x vpp stages in model order
    (virtual stage j of rank i is stage j * pp + i), ``|`` between them, the embedding (``E``)
    before the first layer and the loss (``L``) after the last."""
    stages = [f"t*{sizes[i] // vpp}" for j in range(vpp) for i in range(len(sizes))]
    stages[0], stages[-1] = "E" + stages[0], stages[-1] + "L"
    return "|".join(stages)


def pipeline_split(lay: Layout, src: str) -> list[tuple[str, object, str]]:
    """The arguments that give each PP rank the layers ``lay`` gives it, and each of its
    ``vpp`` virtual stages an equal share (the IR's rule):

    - even stages: ``--num-layers-per-virtual-pipeline-stage`` where ``vpp`` > 1;
    - the first and last stages apart, the middle ones even (Llama 3's 405B takes a layer
      from each end): ``--decoder-first-pipeline-num-layers`` and ``--decoder-last-...``, with
      ``--num-virtual-stages-per-pipeline-rank`` where ``vpp`` > 1 (Megatron-LM's uneven
      pipelines take the virtual stages by count, not by size);
    - any other split: ``--pipeline-model-parallel-layout`` (``pipeline_layout``)."""
    sizes = [b - a + 1 for a, b in lay.layers]
    out: list[tuple[str, object, str]] = []
    if len(set(sizes)) == 1:
        if lay.vpp > 1:
            out.append(("--num-layers-per-virtual-pipeline-stage", sizes[0] // lay.vpp, f"{src} vpp = {lay.vpp}"))
    elif len(set(sizes[1:-1])) <= 1:  # the middle stages split the rest evenly
        out += [
            ("--decoder-first-pipeline-num-layers", sizes[0], f"{src} layers"),
            ("--decoder-last-pipeline-num-layers", sizes[-1], f"{src} layers"),
        ]
        if lay.vpp > 1:
            out.append(("--num-virtual-stages-per-pipeline-rank", lay.vpp, f"{src} vpp = {lay.vpp}"))
    else:
        out.append(
            ("--pipeline-model-parallel-layout", pipeline_layout(sizes, lay.vpp), f"{src} layers, vpp = {lay.vpp}")
        )
    return out


def megatron_lines(m: Module, plan: Plan, target: str) -> list[str]:
    w, c = m.workloads[plan.workload], m.clusters[plan.cluster]
    stage_kinds = kinds(m, plan)
    lines = header(m, plan, "Megatron-LM", "pretrain_gpt.py arguments, one bash array per trained model-stage")
    skipped = [ms for ms, k in stage_kinds.items() if k != "train"]
    if skipped:
        lines.append(
            f"# not exported: {', '.join(skipped)} (Megatron-LM arguments describe training; generation: --to vllm)"
        )
    for ms, k in stage_kinds.items():
        if k != "train":
            continue
        lay, md = plan.layouts[ms], m.models[plan.layouts[ms].model]
        src, mdl, wl = f"layout {ms}", f"model @{md.name}", f"workload @{w.name}"
        args: list[tuple[str, object, str]] = [
            ("--tensor-model-parallel-size", lay.tp, src),
            ("--pipeline-model-parallel-size", lay.pp, src),
            ("--context-parallel-size", lay.cp, src),
        ]
        notes: list[str] = []
        args += pipeline_split(lay, src)
        if lay.sp:
            args.append(("--sequence-parallel", None, f"{src} sp"))
        if lay.tp_overlap:
            args.append(("--tp-comm-overlap", None, f"{src} tp_overlap"))
        if lay.zero >= 1:
            args.append(("--use-distributed-optimizer", None, f"{src} zero = {lay.zero}"))
        if lay.pp > 1 and lay.vpp > 1 and not lay.pp_overlapped:  # Megatron-LM overlaps them by default
            args.append(("--no-overlap-p2p-communication", None, f"{src} pp_overlap = false"))
        elif lay.pp > 1 and lay.pipeline_schedule == "one_f_one_b" and lay.pp_overlapped:
            notes.append("pp_overlap under 1F1B (Megatron-LM overlaps pipeline sends in the interleaved schedule only)")
        if lay.replicas > 1 and lay.dp_overlap:  # the estimate hides DP communication behind compute
            args.append(("--overlap-grad-reduce", None, f"{src} dp x cp = {lay.replicas} (overlapped, as estimated)"))
            if lay.zero >= 1:
                args.append(("--overlap-param-gather", None, f"{src} zero = {lay.zero} (gathers ahead, as estimated)"))
        if lay.zero >= 2:
            args += [
                ("--use-megatron-fsdp", None, f"{src} zero = {lay.zero}"),
                ("--data-parallel-sharding-strategy", FSDP_SHARDING[lay.zero], f"{src} zero = {lay.zero}"),
            ]
        if lay.recompute:
            args += [
                ("--recompute-granularity", "full", f"{src} recompute"),
                ("--recompute-method", "uniform", f"{src} recompute"),
                ("--recompute-num-layers", 1, f"{src} recompute"),
            ]
        if lay.attention != "flash":  # the scores through HBM: Megatron-core's unfused core attention
            args.append(("--attention-backend", "unfused", f"{src} attention = {lay.attention}"))
        if lay.attention == "recomputed":  # selective recomputation redoes the core attention
            args.append(("--recompute-granularity", "selective", f"{src} attention = recomputed"))
        if lay.fp8:
            args.append(("--fp8-format", "hybrid", f"{src} fp8"))
        if lay.grad_dtype == "fp32":
            args.append(("--accumulate-allreduce-grads-in-fp32", None, f"{src} grad_dtype = fp32"))
        elif md.dtype == "bf16":
            args.append(("--grad-reduce-in-bf16", None, f"{src} grad_dtype = bf16"))
        seq = w.prompt_len_max + w.response_len_max
        args += [
            ("--micro-batch-size", w.micro_batch, f"{wl} micro_batch"),
            ("--global-batch-size", w.mini_batch or w.samples, f"{wl} mini_batch (samples per optimizer step)"),
            ("--seq-length", seq, f"{wl} prompt_len_max + response_len_max"),
            ("--max-position-embeddings", seq, f"{wl} prompt_len_max + response_len_max (the longest sequence)"),
            ("--num-layers", md.layers, mdl),
            ("--hidden-size", md.hidden, mdl),
            ("--num-attention-heads", md.heads, mdl),
        ]
        if md.kv_heads != md.heads:
            args += [("--group-query-attention", None, mdl), ("--num-query-groups", md.kv_heads, f"{mdl} kv_heads")]
        if md.head_dim is not None:
            args.append(("--kv-channels", md.head_dim, f"{mdl} head_dim"))
        args.append(("--ffn-hidden-size", md.ffn, mdl))
        if md.moe:  # every layer MoE; EP x ETP carved from dp x cp x tp, as the layout carves them
            args += [
                ("--num-experts", md.experts, f"{mdl} experts"),
                ("--moe-router-topk", md.experts_per_token, f"{mdl} experts_per_token"),
                ("--moe-ffn-hidden-size", md.expert_ffn, f"{mdl} expert_ffn"),
                ("--expert-model-parallel-size", lay.ep, f"{src} ep"),
                ("--expert-tensor-parallel-size", lay.expert_tp, f"{src} etp" if lay.etp else f"{src} tp (etp unset)"),
            ]
            if md.shared_expert_ffn:
                args.append(("--moe-shared-expert-intermediate-size", md.shared_expert_ffn, f"{mdl} shared_expert_ffn"))
        if md.mlp == "gated":
            args.append(("--swiglu", None, f"{mdl} mlp = gated"))
        if not md.tied_embeddings:
            args.append(("--untie-embeddings-and-output-weights", None, f"{mdl} tied_embeddings = false"))
        args += [
            ("--normalization", "RMSNorm", f"{mdl} (Llama-style)"),
            (
                "--norm-epsilon",
                md.norm_eps if md.norm_eps is not None else DEFAULT_NORM_EPSILON,
                _given(md, "norm_eps"),
            ),
            ("--position-embedding-type", "rope", f"{mdl} (Llama-style)"),
            # Megatron-LM drops out 0.1 of the attention weights and of the hidden states by default
            ("--attention-dropout", md.attention_dropout, f"{mdl} attention_dropout"),
            ("--hidden-dropout", 0.0, f"{mdl} (Llama-style: no dropout on the hidden states)"),
            (
                "--rotary-base",
                md.rope_theta if md.rope_theta is not None else DEFAULT_ROTARY_BASE,
                _given(md, "rope_theta"),
            ),
            ("--disable-bias-linear", None, f"{mdl} (no biases on o_proj and the MLP)"),
        ]
        if md.qkv_bias:
            args.append(("--add-qkv-bias", None, f"{mdl} qkv_bias = true"))
        if md.qk_norm:
            args.append(("--qk-layernorm", None, f"{mdl} qk_norm = true"))
        if md.dtype in ("bf16", "fp16"):
            args.append((f"--{md.dtype}", None, f"{mdl} dtype"))
        elif md.dtype == "fp8":
            notes.append(f"{mdl} dtype = fp8 weights (Megatron-LM keeps bf16 weights; --fp8-format is for GEMMs)")
        if md.head == "value":
            notes.append(f"{mdl} head = value (Megatron-LM's GPT model has an LM head only)")
        if lay.pipeline_schedule not in ("one_f_one_b", "interleaved"):
            notes.append(
                f"schedule = {lay.schedule} (megatron-core runs 1F1B, or interleaved 1F1B with virtual stages; "
                "torchtitan runs the others through torch.distributed.pipelining)"
            )
        if lay.offload:
            notes.append(
                f"offload = [{', '.join(lay.offload)}] (moving state to host memory between RL stages "
                "is the RL framework's job, not a Megatron-LM argument)"
            )
        if w.micro_batch_tokens is not None:
            notes.append(
                f"{wl} micro_batch_tokens = {w.micro_batch_tokens} (pretrain_gpt.py packs fixed-length samples; "
                "token-budget micro-batches are the RL framework's, e.g. verl's use_dynamic_bsz)"
            )
        notes = [f"not expressible in Megatron-LM: {ms} {n}" for n in notes] + flushes(
            m, plan, lay, lay.dp, "Megatron-LM"
        )
        nodes = sorted({c.node_of(g) for g in lay.mesh})
        var = ms.upper().replace(".", "_")
        env = ["CUDA_DEVICE_MAX_CONNECTIONS=1"] if lay.tp > 1 or lay.cp > 1 else []
        why = "TP or CP > 1: Megatron-LM requires it" if env else "TP = CP = 1: nothing required"
        lines += [
            "",
            f"# {ms}: {desc(lay)}; Megatron-LM derives DP {lay.dp} from the world size",
            f'# launch: env "${{{var}_ENV[@]}}" torchrun --nnodes {len(nodes)} --nproc-per-node '
            f'{lay.world // len(nodes)} pretrain_gpt.py "${{{var}_ARGS[@]}}" (plus data, tokenizer: vocab {md.vocab}, '
            "and optimizer arguments)",
        ]
        lines += [f"# {n}" for n in notes]
        lines.append(f"{var}_ENV=({' '.join(env)})  # {src}: {why}")
        lines.append(f"{var}_ARGS=(")
        lines += [f"  {flag}{'' if v is None else f' {shlex.quote(str(v))}'}  # {s}" for flag, v, s in args]
        lines.append(")")
    return lines


def _given(md, attr: str) -> str:
    if getattr(md, attr) is not None:
        return f"model @{md.name} {attr}"
    return f"model @{md.name} gives no {attr}: Megatron-LM's default"
