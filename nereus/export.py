"""``nereus export``: a plan's layouts as the configuration of the frameworks people run.

Targets (``export_plan(module, plan, target)``):

- ``verl``: a YAML fragment of verl's trainer config (``verl/trainer/config/ppo_megatron_trainer.yaml``
  and ``ppo_trainer.yaml``): GPUs, batch sizes, the rollout's TP, and per role (actor, ref,
  critic, reward model) its Megatron parallel sizes when a trained layout uses TP or PP, otherwise
  its FSDP keys. ``verl-overrides``: the same as Hydra ``key=value`` lines for
  ``python -m verl.trainer.main_ppo``.
- ``megatron``: Megatron-LM arguments (``pretrain_gpt.py``) per trained model-stage, as bash arrays.
- ``vllm``: per generating model-stage, ``vllm.LLM`` / ``vllm.EngineArgs`` keyword arguments
  (a Python dict), the number of engine instances (the layout's DP) and ``vllm serve`` flags.

Every value carries a comment naming the layout (or workload / cluster attribute) it came from.
Whatever the framework cannot express is a line ``# not expressible in verl|Megatron-LM|vLLM: ...``,
never dropped. Units: batch sizes in samples (sequences) unless said to be prompts; lengths in
tokens; memory as the fraction of a GPU's memory vLLM takes (``gpu_memory_utilization``).
"""

from __future__ import annotations

import json
import math

from .ir import Layout, Module, Plan, bare_name
from .ir.attributes import compress_ints
from .ir.diagnostics import plural

TARGETS = ("verl", "verl-overrides", "megatron", "vllm")
_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def export_plan(module: Module, plan_name: str, target: str) -> str:
    """The text of ``plan_name`` (with or without ``@``) for ``target`` (one of ``TARGETS``)."""
    if target not in TARGETS:
        raise ValueError(f"unknown export target '{target}'; targets: {', '.join(TARGETS)}")
    name = bare_name(plan_name)
    plan = module.plans.get(name)
    if plan is None:
        from .passes.infra.pass_manager import no_such

        raise no_such(module, "export", "plan", name)
    body = {"verl": _verl, "verl-overrides": _verl, "megatron": _megatron, "vllm": _vllm}[target](module, plan, target)
    at = 2 + len(plan.layouts)  # after the header's lines (``_header``)
    return "\n".join(body[:at] + _as_run(module, plan, target) + body[at:]) + "\n"


def _as_run(module: Module, plan: Plan, target: str) -> list[str]:
    """Comment lines: the step time and memory of what the framework really runs of ``plan``,
    and ``# warning:`` lines where that differs from the plan (``passes.search.targets``)."""
    if target not in ("verl", "verl-overrides", "megatron"):
        return []
    from .passes.search.targets import run_report

    lines, warnings = run_report(module, plan, target.partition("-")[0])
    return [f"# {x}" for x in lines] + [f"# warning: {x}" for x in warnings]


# ------------------------------------------------------------------- shared
def _header(m: Module, plan: Plan, framework: str, what: str) -> list[str]:
    lines = [
        f"# Nereus plan @{plan.name} from {m.filename or '<input>'}, exported for {framework}: {what}",
        "# each value's comment names the Nereus layout (or workload / cluster attribute) it came from",
    ]
    return lines + [f"# layout {ms}: {_desc(lay)}" for ms, lay in plan.layouts.items()]


def _desc(lay: Layout) -> str:
    sizes = f"tp {lay.tp} x pp {lay.pp}" + (f" x cp {lay.cp}" if lay.cp > 1 else "") + f" x dp {lay.dp}"
    return f"{sizes} on GPUs {compress_ints(sorted(lay.mesh))}"


def _kinds(m: Module, plan: Plan) -> dict[str, str]:
    return {ms: st.kind for st in m.workloads[plan.workload].stages for ms in st.model_stages()}


def _flushes(m: Module, plan: Plan, lay: Layout, dp: int, framework: str) -> list[str]:
    """A note when the layout's micro-batches per pipeline flush differ from what the target
    derives: one flush per optimizer step of mini_batch / (dp x micro_batch) micro-batches."""
    w = m.workloads[plan.workload]
    n = (w.mini_batch or w.samples) // (dp * w.micro_batch)
    if lay.pp == 1 or n == lay.micro_batches:
        return []
    return [
        f"not expressible in {framework}: {lay.model_stage} micro_batches = {lay.micro_batches} per pipeline flush; "
        f"{framework} flushes once per optimizer step: mini_batch {w.mini_batch or w.samples} / (dp {dp} x micro_batch "
        f"{w.micro_batch}) = {plural(n, 'micro-batch', 'micro-batches')}"
    ]


def generate_memory(m: Module, plan: Plan, model_stage: str) -> tuple[float, float, float]:
    """``(gpu_memory_utilization, KV-cache bytes, bytes other model-stages keep)`` per GPU of a
    generating model-stage, as the cost model budgets it: vLLM's default 0.9 of the GPU's memory,
    less what other model-stages keep resident on the same GPUs (rounded down to 0.01)."""
    from .passes.cost.cost_model import VLLM_GPU_MEMORY_UTILIZATION
    from .passes.cost.layout_costs import layout_costs

    lc = layout_costs(m, plan)[model_stage]
    gpu = m.clusters[plan.cluster].gpu_memory
    others = max(lc.others.values(), default=0.0)
    util = math.floor((VLLM_GPU_MEMORY_UTILIZATION * gpu - others) / gpu * 100) / 100
    return util, float(lc.cost.kv_cache[0]), others


# --------------------------------------------------------------------- verl
def _roles(m: Module, plan: Plan) -> tuple[dict[str, str], list[str]]:
    """verl role -> model: actor (generates), critic (trained value head), ref (frozen LM head),
    reward (frozen value head); and the models left without a role."""
    w = m.workloads[plan.workload]
    gen = [md for st in w.stages if st.kind == "generate" for md in st.models]
    roles: dict[str, str] = {}
    rest = []
    for name in w.roles:
        md = m.models[name]
        role = (
            "actor"
            if name in gen or (md.trained and md.head == "lm")
            else "critic"
            if md.trained
            else "ref"
            if md.head == "lm"
            else "reward"
        )
        if role in roles:
            rest.append(name)
        else:
            roles[role] = name
    return roles, rest


def _verl(m: Module, plan: Plan, target: str) -> list[str]:
    w, c = m.workloads[plan.workload], m.clusters[plan.cluster]
    kinds, lays = _kinds(m, plan), plan.layouts
    roles, rest = _roles(m, plan)
    of = {(lays[ms].model, k): ms for ms, k in kinds.items()}  # (model, stage kind) -> model-stage
    megatron = any(lays[ms].tp > 1 or lays[ms].pp > 1 for ms, k in kinds.items() if k == "train")
    strategy = "megatron" if megatron else "fsdp"
    gpus = c.available_gpus()
    entries: list[tuple[str, object, str]] = []
    notes: list[str] = []

    def put(key, value, src):
        entries.append((key, value, src))

    put("trainer.nnodes", c.nodes, f"cluster @{c.name} nodes")
    put("trainer.n_gpus_per_node", c.gpus_per_node, f"cluster @{c.name} gpus_per_node")
    put("data.train_batch_size", w.global_batch, f"workload @{w.name} global_batch (prompts)")
    put("data.max_prompt_length", w.prompt_len_max, f"workload @{w.name} prompt_len_max")
    put("data.max_response_length", w.response_len_max, f"workload @{w.name} response_len_max")
    put("algorithm.adv_estimator", "grpo" if w.algorithm == "grpo" else "gae", f"workload @{w.name} algorithm")
    if w.algorithm == "sft":
        notes.append("not expressible in verl: algorithm = sft (verl's SFT trainer is another entry point)")
    if len(gpus) != c.num_gpus:
        notes.append(
            f"not expressible in verl: unavailable GPUs {compress_ints(c.unavailable)} (verl uses every GPU of its "
            "nodes)"
        )

    def engine(prefix: str, fsdp: dict[str, str], ms: str, trained: bool):
        """The parallel sizes, ZeRO, recomputation and offload of one role's worker."""
        lay = lays[ms]
        off = set(lay.offload)
        src = f"layout {ms}"
        if megatron:
            e = f"{prefix}.megatron"
            put(f"{e}.tensor_model_parallel_size", lay.tp, src)
            put(f"{e}.pipeline_model_parallel_size", lay.pp, src)
            if lay.vpp > 1:
                put(f"{e}.virtual_pipeline_model_parallel_size", lay.vpp, src)
            put(f"{e}.context_parallel_size", lay.cp, src)
            put(f"{e}.sequence_parallel", lay.sp, f"{src} sp")
            put(f"{e}.param_offload", "weights" in off, f"{src} offload")
            if trained:
                put(f"{e}.use_distributed_optimizer", lay.zero >= 1, f"{src} zero = {lay.zero}")
                put(f"{e}.grad_offload", "grads" in off, f"{src} offload")
                put(f"{e}.optimizer_offload", "optimizer" in off, f"{src} offload")
                if lay.recompute:
                    t = f"{e}.override_transformer_config"
                    put(f"{t}.recompute_granularity", "full", f"{src} recompute")
                    put(f"{t}.recompute_method", "uniform", f"{src} recompute")
                    put(f"{t}.recompute_num_layers", 1, f"{src} recompute")
                if lay.zero >= 2:
                    notes.append(
                        f"not expressible in verl: {ms} zero = {lay.zero}; verl's Megatron workers shard "
                        "only optimizer state over DP (use_distributed_optimizer, ZeRO-1)"
                    )
                notes.extend(_flushes(m, plan, lay, len(gpus) // (lay.tp * lay.pp * lay.cp), "verl"))
            sizes = [b - a + 1 for a, b in lay.layers]
            if len(set(sizes)) > 1:
                notes.append(
                    f"not expressible in verl: {ms} uneven pipeline stages {sizes} layers (verl splits evenly)"
                )
        else:
            put(fsdp["param_offload"], "weights" in off, f"{src} offload")
            if trained:
                put(fsdp["optimizer_offload"], "optimizer" in off, f"{src} offload")
                put(fsdp["recompute"], lay.recompute, f"{src} recompute")
                if lay.zero != 3:
                    notes.append(
                        f"not expressible in verl: {ms} zero = {lay.zero}; verl's FSDP workers shard weights, "
                        "grads and optimizer state (ZeRO-3)"
                    )
                if "grads" in off:
                    notes.append(
                        f"not expressible in verl: {ms} offload of grads (FSDP workers offload weights and optimizer)"
                    )
            if "ulysses" in fsdp:
                put(fsdp["ulysses"], lay.cp, f"{src} cp (verl: Ulysses sequence parallelism, not ring attention)")
            elif lay.cp > 1:
                notes.append(
                    f"not expressible in verl: {ms} cp = {lay.cp} (this role follows the actor's Ulysses size)"
                )
            if lay.tp > 1 or lay.pp > 1:
                notes.append(
                    f"not expressible in verl: {ms} tp = {lay.tp}, pp = {lay.pp}; with no trained layout using "
                    "TP or PP this export picks verl's FSDP workers, which have neither"
                )
        if lay.fp8 or lay.grad_dtype != "bf16":
            notes.append(
                f"not expressible in verl: {ms} fp8 = {str(lay.fp8).lower()}, grad_dtype = {lay.grad_dtype} "
                "(no verl key; Megatron's own options through override_transformer_config)"
            )
        n = len(gpus) // (lay.tp * lay.pp * lay.cp)
        if sorted(lay.mesh) != gpus:
            notes.append(
                f"not expressible in verl: {ms} runs on GPUs {compress_ints(sorted(lay.mesh))} (dp = {lay.dp}); "
                f"verl runs every role on all {plural(len(gpus), 'GPU')}, so these sizes give DP {n} there"
            )
        elif n != lay.dp:
            notes.append(f"not expressible in verl: {ms} dp = {lay.dp}; verl derives DP {n} from the GPUs")

    def same_as_train(ms_infer: str, ms_train: str):
        a, b = lays[ms_infer], lays[ms_train]
        if (a.tp, a.pp, a.cp, a.dp, a.vpp, a.sp, sorted(a.mesh)) != (
            b.tp,
            b.pp,
            b.cp,
            b.dp,
            b.vpp,
            b.sp,
            sorted(b.mesh),
        ):
            notes.append(
                f"not expressible in verl: {ms_infer} ({_desc(a)}) differs from {ms_train} ({_desc(b)}); "
                f"verl runs a trained model's forward passes with its training layout"
            )

    actor = roles.get("actor")
    if actor:
        ms = of.get((actor, "generate"))
        if ms:
            lay = lays[ms]
            r = "actor_rollout_ref.rollout"
            put(f"{r}.tensor_model_parallel_size", lay.tp, f"layout {ms}")
            if lay.pp > 1:
                put(f"{r}.pipeline_model_parallel_size", lay.pp, f"layout {ms}")
            util = generate_memory(m, plan, ms)[0]
            put(f"{r}.gpu_memory_utilization", util, f"layout {ms}: the cost model's vLLM budget")
            put(f"{r}.n", w.group_size, f"workload @{w.name} group_size")
            put(f"{r}.log_prob_micro_batch_size_per_gpu", w.micro_batch, f"workload @{w.name} micro_batch")
            n = len(gpus) // (lay.tp * lay.pp)
            if sorted(lay.mesh) != gpus or n != lay.dp:
                notes.append(
                    f"not expressible in verl: {ms} {_desc(lay)}; "
                    f"verl's rollout runs on all {plural(len(gpus), 'GPU')}, "
                    f"{n} engines of TP {lay.tp} x PP {lay.pp}"
                )
            for what, bad in (("cp", lay.cp > 1), ("sp", lay.sp), ("offload", lay.offload), ("fp8", lay.fp8)):
                if bad:
                    notes.append(
                        f"not expressible in verl: {ms} {what} = {getattr(lay, what)} (verl's vLLM rollout has no "
                        "such setting)"
                    )
        ms = of.get((actor, "train"))
        if ms:
            a = "actor_rollout_ref.actor"
            put(f"{a}.strategy", strategy, "layouts of the trained model-stages (TP/PP: megatron)")
            put(
                f"{a}.ppo_mini_batch_size",
                (w.mini_batch or w.samples) // w.group_size,
                f"workload @{w.name} mini_batch / group_size (prompts)",
            )
            if (w.mini_batch or w.samples) % w.group_size:
                notes.append(
                    f"not expressible in verl: mini_batch = {w.mini_batch} is not a multiple of group_size = "
                    f"{w.group_size} (verl's mini-batches hold whole groups)"
                )
            put(f"{a}.ppo_micro_batch_size_per_gpu", w.micro_batch, f"workload @{w.name} micro_batch")
            put(f"{a}.ppo_epochs", w.ppo_epochs, f"workload @{w.name} ppo_epochs")
            engine(
                a,
                {
                    "param_offload": f"{a}.fsdp_config.param_offload",
                    "optimizer_offload": f"{a}.fsdp_config.optimizer_offload",
                    "recompute": "actor_rollout_ref.model.enable_gradient_checkpointing",
                    "ulysses": f"{a}.ulysses_sequence_parallel_size",
                },
                ms,
                True,
            )
            if (actor, "infer") in of:
                same_as_train(of[(actor, "infer")], ms)
    ref = roles.get("ref")
    if ref and (ref, "infer") in of:
        r = "actor_rollout_ref.ref"
        put(f"{r}.log_prob_micro_batch_size_per_gpu", w.micro_batch, f"workload @{w.name} micro_batch")
        engine(r, {"param_offload": f"{r}.fsdp_config.param_offload"}, of[(ref, "infer")], False)
    critic = roles.get("critic")
    if critic and (critic, "train") in of:
        ms = of[(critic, "train")]
        put("critic.strategy", strategy, "layouts of the trained model-stages (TP/PP: megatron)")
        put("critic.ppo_micro_batch_size_per_gpu", w.micro_batch, f"workload @{w.name} micro_batch")
        engine(
            "critic",
            {
                "param_offload": "critic.model.fsdp_config.param_offload",
                "optimizer_offload": "critic.model.fsdp_config.optimizer_offload",
                "recompute": "critic.model.enable_gradient_checkpointing",
                "ulysses": "critic.ulysses_sequence_parallel_size",
            },
            ms,
            True,
        )
        if (critic, "infer") in of:
            same_as_train(of[(critic, "infer")], ms)
    reward = roles.get("reward")
    if reward and (reward, "infer") in of:
        put("reward_model.enable", True, f"model @{reward} (frozen, value head)")
        put("reward_model.strategy", strategy, "layouts of the trained model-stages (TP/PP: megatron)")
        put("reward_model.micro_batch_size_per_gpu", w.micro_batch, f"workload @{w.name} micro_batch")
        engine(
            "reward_model",
            {
                "param_offload": "reward_model.model.fsdp_config.param_offload",
                "ulysses": "reward_model.ulysses_sequence_parallel_size",
            },
            of[(reward, "infer")],
            False,
        )
    for name in rest:
        notes.append(f"not expressible in verl: model @{name} (verl has one actor, critic, ref and reward model)")
    for ms in sorted(set(kinds) - set(of.values())):
        notes.append(f"not expressible in verl: {ms} (a second {kinds[ms]} stage of model @{lays[ms].model})")
    for st in w.stages:  # model-stages Nereus runs side by side run one after another in verl
        mss = st.model_stages()
        apart = [a for a in mss if any(not set(lays[a].mesh) & set(lays[b].mesh) for b in mss if b != a)]
        if apart:
            notes.append(
                f"not expressible in verl: stage {st.name} runs {', '.join(apart)} side by side on disjoint "
                "GPUs; verl runs them one after another on all GPUs"
            )

    config = f"--config-name {'ppo_megatron_trainer' if megatron else 'ppo_trainer'}"
    form = "Hydra overrides" if target == "verl-overrides" else "YAML"
    lines = _header(m, plan, "verl", f"{form} for verl's {strategy} workers ({config})")
    if target == "verl-overrides":
        lines.append(f"# use: python -m verl.trainer.main_ppo {config} $(grep -v '^#' THIS_FILE)")
    lines += [f"# {n}" for n in dict.fromkeys(notes)]
    return lines + (_overrides(entries) if target == "verl-overrides" else _yaml(entries))


def _scalar(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def _yaml(entries) -> list[str]:
    tree: dict = {}
    for key, value, src in entries:
        *path, leaf = key.split(".")
        node = tree
        for p in path:
            node = node.setdefault(p, {})
        node[leaf] = (value, src)
    lines: list[str] = []

    def walk(node: dict, depth: int):
        for k, v in node.items():
            k = f"'{k}'" if k in ("n", "y") else k  # YAML 1.1 reads a bare n or y as a boolean
            if isinstance(v, dict):
                lines.append(f"{'  ' * depth}{k}:")
                walk(v, depth + 1)
            else:
                lines.append(f"{'  ' * depth}{k}: {_scalar(v[0])}  # {v[1]}")

    walk(tree, 0)
    return lines


def _overrides(entries) -> list[str]:
    lines, last = [], None
    for key, value, src in entries:
        if src != last:
            lines.append(f"# {src}")
            last = src
        lines.append(f"{key}={_scalar(value)}")
    return lines


# ----------------------------------------------------------------- megatron
def _megatron(m: Module, plan: Plan, target: str) -> list[str]:
    w, c = m.workloads[plan.workload], m.clusters[plan.cluster]
    kinds = _kinds(m, plan)
    lines = _header(m, plan, "Megatron-LM", "pretrain_gpt.py arguments, one bash array per trained model-stage")
    skipped = [ms for ms, k in kinds.items() if k != "train"]
    if skipped:
        lines.append(
            f"# not exported: {', '.join(skipped)} (Megatron-LM arguments describe training; generation: --to vllm)"
        )
    for ms, k in kinds.items():
        if k != "train":
            continue
        lay, md = plan.layouts[ms], m.models[plan.layouts[ms].model]
        src, mdl, wl = f"layout {ms}", f"model @{md.name}", f"workload @{w.name}"
        args: list[tuple[str, object, str]] = [
            ("--tensor-model-parallel-size", lay.tp, src),
            ("--pipeline-model-parallel-size", lay.pp, src),
            ("--context-parallel-size", lay.cp, src),
        ]
        notes = []
        sizes = [b - a + 1 for a, b in lay.layers]
        if lay.vpp > 1:
            if len(set(sizes)) == 1 and sizes[0] % lay.vpp == 0:
                args.append(("--num-layers-per-virtual-pipeline-stage", sizes[0] // lay.vpp, f"{src} vpp = {lay.vpp}"))
            else:
                notes.append(f"vpp = {lay.vpp} over uneven stages {sizes} layers")
        elif len(set(sizes)) > 1:
            if len(set(sizes[1:-1])) <= 1:  # the middle stages split the rest evenly
                args += [
                    ("--decoder-first-pipeline-num-layers", sizes[0], f"{src} layers"),
                    ("--decoder-last-pipeline-num-layers", sizes[-1], f"{src} layers"),
                ]
            else:
                notes.append(f"uneven pipeline stages {sizes} layers (Megatron-LM sets only the first and last)")
        if lay.sp:
            args.append(("--sequence-parallel", None, f"{src} sp"))
        if lay.zero >= 1:
            args.append(("--use-distributed-optimizer", None, f"{src} zero = {lay.zero}"))
        if lay.zero >= 2:
            notes.append(
                f"zero = {lay.zero}: the distributed optimizer shards optimizer state (ZeRO-1); "
                "Megatron-LM keeps every rank's full gradient buffer and weights"
            )
        if lay.recompute:
            args += [
                ("--recompute-granularity", "full", f"{src} recompute"),
                ("--recompute-method", "uniform", f"{src} recompute"),
                ("--recompute-num-layers", 1, f"{src} recompute"),
            ]
        if lay.fp8:
            args.append(("--fp8-format", "hybrid", f"{src} fp8"))
        if lay.grad_dtype == "fp32":
            args.append(("--accumulate-allreduce-grads-in-fp32", None, f"{src} grad_dtype"))
        args += [
            ("--micro-batch-size", w.micro_batch, f"{wl} micro_batch"),
            ("--global-batch-size", w.mini_batch or w.samples, f"{wl} mini_batch (samples per optimizer step)"),
            ("--seq-length", w.prompt_len_max + w.response_len_max, f"{wl} prompt_len_max + response_len_max"),
            ("--num-layers", md.layers, mdl),
            ("--hidden-size", md.hidden, mdl),
            ("--num-attention-heads", md.heads, mdl),
        ]
        if md.kv_heads != md.heads:
            args += [("--group-query-attention", None, mdl), ("--num-query-groups", md.kv_heads, f"{mdl} kv_heads")]
        if md.head_dim is not None:
            args.append(("--kv-channels", md.head_dim, f"{mdl} head_dim"))
        args.append(("--ffn-hidden-size", md.ffn, mdl))
        if md.mlp == "gated":
            args.append(("--swiglu", None, f"{mdl} mlp = gated"))
        if not md.tied_embeddings:
            args.append(("--untie-embeddings-and-output-weights", None, f"{mdl} tied_embeddings = false"))
        args += [
            ("--normalization", "RMSNorm", f"{mdl} (Llama-style)"),
            ("--position-embedding-type", "rope", f"{mdl} (Llama-style)"),
            ("--disable-bias-linear", None, f"{mdl} (no biases in the IR)"),
        ]
        if md.dtype in ("bf16", "fp16"):
            args.append((f"--{md.dtype}", None, f"{mdl} dtype"))
        elif md.dtype == "fp8":
            notes.append(f"{mdl} dtype = fp8 weights (Megatron-LM keeps bf16 weights; --fp8-format is for GEMMs)")
        if md.head == "value":
            notes.append(f"{mdl} head = value (Megatron-LM's GPT model has an LM head only)")
        if lay.offload:
            notes.append(
                f"offload = [{', '.join(lay.offload)}] (moving state to host memory between RL stages "
                "is the RL framework's job, not a Megatron-LM argument)"
            )
        notes = [f"not expressible in Megatron-LM: {ms} {n}" for n in notes] + _flushes(
            m, plan, lay, lay.dp, "Megatron-LM"
        )
        nodes = sorted({c.node_of(g) for g in lay.mesh})
        var = ms.upper().replace(".", "_") + "_ARGS"
        lines += [
            "",
            f"# {ms}: {_desc(lay)}; Megatron-LM derives DP {lay.dp} from the world size",
            f"# launch: torchrun --nnodes {len(nodes)} --nproc-per-node {lay.world // len(nodes)} pretrain_gpt.py "
            f'"${{{var}[@]}}" (plus data, tokenizer: vocab {md.vocab}, and optimizer arguments)',
        ]
        lines += [f"# {n}" for n in notes]
        lines.append(f"{var}=(")
        lines += [f"  {flag}{'' if v is None else f' {v}'}  # {s}" for flag, v, s in args]
        lines.append(")")
    return lines


# --------------------------------------------------------------------- vllm
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
    if md.dtype in _DTYPE:
        kw["dtype"] = _DTYPE[md.dtype]
    if lay.fp8 or md.dtype == "fp8":
        kw["quantization"] = "fp8"
    return kw


def _vllm(m: Module, plan: Plan, target: str) -> list[str]:
    w, c = m.workloads[plan.workload], m.clusters[plan.cluster]
    lines = _header(
        m,
        plan,
        "vLLM",
        "keyword arguments of vllm.LLM(model=..., **ENGINE_ARGS[model_stage]) "
        "and vllm.EngineArgs, one engine per DP replica",
    )
    engines = {}
    for ms, k in _kinds(m, plan).items():
        if k != "generate":
            continue
        lay = plan.layouts[ms]
        kw = engines[ms] = vllm_engine_args(m, plan, ms)
        util, kv, others = generate_memory(m, plan, ms)
        per = lay.tp * lay.pp * lay.cp
        groups = [lay.mesh[i * per : (i + 1) * per] for i in range(lay.dp)]
        shown = " ".join(str(g) for g in groups[:8]) + (f" ... ({lay.dp} in all)" if lay.dp > 8 else "")
        flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in kw.items())
        lines += [
            "",
            f"# {ms}: {_desc(lay)}, model @{lay.model}",
            f"#   tensor_parallel_size, pipeline_parallel_size: layout {ms}; engine instances: its dp = {lay.dp}, "
            f"on global GPUs {shown}",
            f"#   max_model_len: workload @{w.name} prompt_len_max + response_len_max",
            f"#   gpu_memory_utilization: layout {ms}, the cost model's budget: 0.9 of {c.gpu_memory / 2**30:.0f} GiB "
            f"less {others / 2**30:.1f} GiB other model-stages keep on these GPUs; KV cache {kv / 2**30:.1f} GiB per "
            "GPU",
            f"#   per instance: CUDA_VISIBLE_DEVICES={','.join(str(g % c.gpus_per_node) for g in groups[0])} "
            f"vllm serve MODEL {flags}",
            f"#   or one server for all: vllm serve MODEL {flags} --data-parallel-size {lay.dp}",
        ]
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
        if m.models[lay.model].dtype == "fp8":
            lines.append(
                f"# not expressible in vLLM: model @{lay.model} dtype = fp8 weights (exported as quantization = fp8)"
            )
    if not engines:
        lines.append("# not exported: the plan has no generating model-stage")
    return lines + ["ENGINE_ARGS = " + json.dumps(engines, indent=4)]  # str, int and float only: valid Python
