"""``--to verl`` / ``verl-overrides``: a plan as verl 0.9.1's PPO trainer config.

Keys are those of ``verl/trainer/config/ppo_megatron_trainer.yaml`` (a trained layout with TP or
PP) or ``ppo_trainer.yaml`` (FSDP workers), which ``make test`` composes with Hydra and checks
with verl's own ``validate_config`` and config dataclasses. Keys verl's config leaves open
(``override_ddp_config``'s) are written ``+key=value`` as overrides. Roles: the actor generates
through verl's vLLM rollout; the reference model exists only when the KL options ask for it
(``actor.use_kl_loss`` for GRPO, ``algorithm.use_kl_in_reward`` for PPO), so they are set when
the plan has one; the reward model is ``reward.reward_model``, an inference server.
"""

from __future__ import annotations

from ..ir import Module, Plan
from ..ir.attributes import compress_ints
from .common import desc, flushes, generate_memory, header, kinds
from .vllm import vllm_expert_parallel

# model-stage keys verl's config leaves open: Hydra overrides add them with a leading +
# keys verl's config does not declare: a Hydra override must add them (``+key=value``); the
# transformer-config keys it declares (recompute_*) must not be added again
OPEN_KEYS = (
    "override_ddp_config.",
    "override_transformer_config.tp_comm_overlap",
    "override_transformer_config.fp8",
    "override_transformer_config.overlap_p2p_comm",
)
FSDP_SHARDING = {2: "optim_grads", 3: "optim_grads_params"}


def roles(m: Module, plan: Plan) -> tuple[dict[str, str], list[str]]:
    """verl role -> model: actor (generates), critic (trained value head), ref (frozen LM head),
    reward (frozen value head); and the models left without a role."""
    w = m.workloads[plan.workload]
    gen = [md for st in w.stages if st.kind == "generate" for md in st.models]
    found: dict[str, str] = {}
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
        if role in found:
            rest.append(name)
        else:
            found[role] = name
    return found, rest


def verl_lines(m: Module, plan: Plan, target: str) -> list[str]:
    w, c = m.workloads[plan.workload], m.clusters[plan.cluster]
    stage_kinds, lays = kinds(m, plan), plan.layouts
    role_of, rest = roles(m, plan)
    of = {(lays[ms].model, k): ms for ms, k in stage_kinds.items()}  # (model, stage kind) -> model-stage
    megatron = any(lays[ms].tp > 1 or lays[ms].pp > 1 for ms, k in stage_kinds.items() if k == "train")
    strategy = "megatron" if megatron else "fsdp"
    gpus = c.available_gpus()
    entries: list[tuple[str, object, str]] = []
    notes: list[str] = []
    wl = f"workload @{w.name}"

    def put(key, value, src):
        entries.append((key, value, src))

    put("trainer.nnodes", c.nodes, f"cluster @{c.name} nodes")
    put("trainer.n_gpus_per_node", c.gpus_per_node, f"cluster @{c.name} gpus_per_node")
    if w.steps is not None:
        put("trainer.total_training_steps", w.steps, f"{wl} steps")
    put("data.train_batch_size", w.global_batch, f"{wl} global_batch (prompts)")
    put("data.max_prompt_length", w.prompt_len_max, f"{wl} prompt_len_max")
    put("data.max_response_length", w.response_len_max, f"{wl} response_len_max")
    put("algorithm.adv_estimator", "grpo" if w.algorithm == "grpo" else "gae", f"{wl} algorithm")
    if w.algorithm == "sft":
        notes.append("not expressible in verl: algorithm = sft (verl's SFT trainer is another entry point)")
    for ms in sorted(ms for ms in stage_kinds if lays[ms].attention != "flash"):
        notes.append(
            f"not expressible in verl: {ms} attention = {lays[ms].attention} (verl's workers run flash attention)"
        )
    if len(gpus) != c.num_gpus:
        notes.append(
            f"not expressible in verl: unavailable GPUs {compress_ints(c.unavailable)} (verl uses every GPU of its "
            "nodes)"
        )

    def tokens_per_gpu(ms: str) -> int:
        """verl's token budget per GPU: it multiplies it by the Ulysses / context-parallel size."""
        lay = lays[ms]
        assert w.micro_batch_tokens is not None
        if w.micro_batch_tokens % lay.cp:
            notes.append(
                f"not expressible in verl: {ms} micro_batch_tokens = {w.micro_batch_tokens} over cp = {lay.cp} "
                f"(verl's budget is per GPU: rounded down to {w.micro_batch_tokens // lay.cp})"
            )
        return w.micro_batch_tokens // lay.cp

    def batching(keys: tuple[str, str] | None, micro: str | None, ms: str):
        """``micro_batch`` samples per micro-batch, or the workload's token budget (dynamic batching)."""
        if micro:
            put(micro, w.micro_batch, f"{wl} micro_batch")
        if keys and w.micro_batch_tokens is not None:
            put(keys[0], True, f"{wl} micro_batch_tokens (dynamic batching)")
            put(keys[1], tokens_per_gpu(ms), f"{wl} micro_batch_tokens / layout {ms} cp")

    def engine(prefix: str, fsdp: dict[str, str], ms: str, trained: bool):
        """The parallel sizes, ZeRO, recomputation, precision and offload of one role's worker."""
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
            if m.models[lay.model].moe:
                put(f"{e}.expert_model_parallel_size", lay.ep, f"{src} ep")
                put(f"{e}.expert_tensor_parallel_size", lay.expert_tp, f"{src} etp" if lay.etp else f"{src} tp")
            put(f"{e}.sequence_parallel", lay.sp, f"{src} sp")
            put(f"{e}.param_offload", "weights" in off, f"{src} offload")
            if trained:
                put(f"{e}.use_distributed_optimizer", lay.zero >= 1, f"{src} zero = {lay.zero}")
                put(f"{e}.use_megatron_fsdp", lay.zero >= 2, f"{src} zero = {lay.zero} (Megatron-FSDP from 2)")
                if lay.zero >= 2:
                    put(
                        f"{e}.override_ddp_config.data_parallel_sharding_strategy",
                        FSDP_SHARDING[lay.zero],
                        f"{src} zero = {lay.zero}",
                    )
                put(f"{e}.optimizer_offload", "optimizer" in off, f"{src} offload")
                put(
                    f"{e}.override_ddp_config.grad_reduce_in_fp32",
                    lay.grad_dtype == "fp32",
                    f"{src} grad_dtype = {lay.grad_dtype}",
                )
                if lay.replicas > 1 and lay.dp_overlap:  # as estimated (verl leaves it off but under Megatron-FSDP)
                    put(f"{e}.override_ddp_config.overlap_grad_reduce", True, f"{src} dp x cp (overlapped)")
                    if lay.zero >= 1:
                        put(f"{e}.override_ddp_config.overlap_param_gather", True, f"{src} zero (gathers ahead)")
                if "grads" in off:
                    notes.append(
                        f"not expressible in verl: {ms} offload of grads (verl's Megatron workers offload "
                        "weights with their gradient buffers (param_offload) and the optimizer)"
                    )
                t = f"{e}.override_transformer_config"
                if lay.recompute:
                    put(f"{t}.recompute_granularity", "full", f"{src} recompute")
                    put(f"{t}.recompute_method", "uniform", f"{src} recompute")
                    put(f"{t}.recompute_num_layers", 1, f"{src} recompute")
                if lay.fp8:
                    put(f"{t}.fp8", "hybrid", f"{src} fp8")
                if lay.tp_overlap:
                    put(f"{t}.tp_comm_overlap", True, f"{src} tp_overlap")
                if lay.pp > 1 and lay.vpp > 1 and not lay.pp_overlapped:  # verl's workers: on where vpp > 1
                    put(f"{t}.overlap_p2p_comm", False, f"{src} pp_overlap = false")
                elif lay.pp > 1 and lay.pipeline_schedule == "one_f_one_b" and lay.pp_overlapped:
                    notes.append(
                        f"not expressible in verl: {ms} pp_overlap under 1F1B (megatron-core overlaps pipeline "
                        "sends in the interleaved schedule only)"
                    )
                if lay.pipeline_schedule not in ("one_f_one_b", "interleaved"):
                    notes.append(
                        f"not expressible in verl: {ms} schedule = {lay.schedule} (verl's Megatron workers run "
                        "megatron-core's 1F1B and interleaved 1F1B)"
                    )
                notes.extend(flushes(m, plan, lay, len(gpus) // (lay.tp * lay.pp * lay.cp), "verl"))
            sizes = [b - a + 1 for a, b in lay.layers]
            if len(set(sizes)) > 1:
                notes.append(
                    f"not expressible in verl: {ms} uneven pipeline stages {sizes} layers (verl splits evenly)"
                )
        else:
            if lay.carves_experts and m.models[lay.model].moe:
                notes.append(
                    f"not expressible in verl: {ms} ep = {lay.ep}, etp = {lay.expert_tp} (verl's FSDP workers "
                    "shard experts as any other weight; expert parallelism needs its Megatron workers)"
                )
            put(fsdp["param_offload"], "weights" in off, f"{src} offload")
            if trained and not lay.dp_overlap:
                notes.append(
                    f"not expressible in verl: {ms} dp_overlap = false (FSDP2 prefetches the gathers and "
                    "reduce-scatters gradients during the backward)"
                )
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
                if lay.fp8 or lay.grad_dtype != "bf16":
                    notes.append(
                        f"not expressible in verl: {ms} fp8 = {str(lay.fp8).lower()}, grad_dtype = {lay.grad_dtype} "
                        "(verl's FSDP workers have neither setting)"
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
        n = len(gpus) // (lay.tp * lay.pp * lay.cp)
        if sorted(lay.mesh) != gpus:
            notes.append(
                f"not expressible in verl: {ms} runs on GPUs {compress_ints(sorted(lay.mesh))} (dp = {lay.dp}); "
                f"verl runs every role on all {len(gpus)} GPUs, so these sizes give DP {n} there"
            )
        elif n != lay.dp:
            notes.append(f"not expressible in verl: {ms} dp = {lay.dp}; verl derives DP {n} from the GPUs")

    def same_as_train(ms_infer: str, ms_train: str):
        a, b = lays[ms_infer], lays[ms_train]
        shape = lambda x: (x.tp, x.pp, x.cp, x.dp, x.vpp, x.sp, sorted(x.mesh))
        if shape(a) != shape(b):
            notes.append(
                f"not expressible in verl: {ms_infer} ({desc(a)}) differs from {ms_train} ({desc(b)}); "
                f"verl runs a trained model's forward passes with its training layout"
            )

    def server(prefix: str, ms: str, what: str):
        """A vLLM engine (the rollout, the reward model): TP only, one engine per TP group of all GPUs."""
        lay = lays[ms]
        put(f"{prefix}.name", "vllm", f"layout {ms} (verl's vLLM {what})")
        put(f"{prefix}.tensor_model_parallel_size", lay.tp, f"layout {ms}")
        if lay.pp > 1:
            notes.append(
                f"not expressible in verl: {ms} pp = {lay.pp}; verl's vLLM {what} has no pipeline parallelism "
                f"(RolloutConfig raises NotImplementedError): exported as PP 1, engines of TP {lay.tp}"
            )
        n = len(gpus) // lay.tp
        if sorted(lay.mesh) != gpus or n != lay.dp * lay.pp * lay.cp:
            notes.append(
                f"not expressible in verl: {ms} {desc(lay)}; verl's {what} runs on all {len(gpus)} GPUs, "
                f"{n} engines of TP {lay.tp}"
            )
        for attr, bad in (("cp", lay.cp > 1), ("sp", lay.sp), ("offload", lay.offload)):
            if bad:
                notes.append(
                    f"not expressible in verl: {ms} {attr} = {getattr(lay, attr)} (verl's vLLM {what} has no "
                    "such setting)"
                )
        md = m.models[lay.model]
        if md.moe and lay.carves_experts:
            if vllm_expert_parallel(lay) == "engine":
                put(f"{prefix}.expert_parallel_size", lay.ep, f"layout {ms} ep (vLLM's EP: every expert whole)")
            else:
                notes.append(
                    f"not expressible in verl: {ms} ep = {lay.ep}, etp = {lay.expert_tp}; verl's vLLM {what} "
                    f"splits experts over an engine's TP ranks, each whole (ep = tp = {lay.tp}, etp = 1)"
                )
        if lay.fp8 or md.dtype == "fp8":
            put(f"{prefix}.quantization", "fp8", f"layout {ms} fp8" if lay.fp8 else f"model @{md.name} dtype = fp8")

    actor = role_of.get("actor")
    a = "actor_rollout_ref.actor"
    if actor:
        ms = of.get((actor, "generate"))
        if ms:
            r = "actor_rollout_ref.rollout"
            server(r, ms, "rollout")
            put(
                f"{r}.gpu_memory_utilization",
                generate_memory(m, plan, ms)[0],
                f"layout {ms}: the cost model's vLLM budget",
            )
            put(f"{r}.n", w.group_size, f"{wl} group_size")
            batching((f"{r}.log_prob_use_dynamic_bsz", f"{r}.log_prob_max_token_len_per_gpu"), None, ms)
            put(f"{r}.log_prob_micro_batch_size_per_gpu", w.micro_batch, f"{wl} micro_batch")
        ms = of.get((actor, "train"))
        if ms:
            put(f"{a}.strategy", strategy, "layouts of the trained model-stages (TP/PP: megatron)")
            put(
                f"{a}.ppo_mini_batch_size",
                (w.mini_batch or w.samples) // w.group_size,
                f"{wl} mini_batch / group_size (prompts)",
            )
            if (w.mini_batch or w.samples) % w.group_size:
                notes.append(
                    f"not expressible in verl: mini_batch = {w.mini_batch} is not a multiple of group_size = "
                    f"{w.group_size} (verl's mini-batches hold whole groups)"
                )
            batching(
                (f"{a}.use_dynamic_bsz", f"{a}.ppo_max_token_len_per_gpu"), f"{a}.ppo_micro_batch_size_per_gpu", ms
            )
            put(f"{a}.ppo_epochs", w.ppo_epochs, f"{wl} ppo_epochs")
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
    ref = role_of.get("ref")
    if ref and (ref, "infer") in of:
        ms = of[(ref, "infer")]
        # verl creates the reference model only for a KL term: GRPO's in the loss, PPO's in the reward
        if w.algorithm == "grpo":
            put(f"{a}.use_kl_loss", True, f"model @{ref} (the reference model of GRPO's KL loss)")
        else:
            put("algorithm.use_kl_in_reward", True, f"model @{ref} (the reference model of PPO's KL reward)")
        r = "actor_rollout_ref.ref"
        batching((f"{r}.log_prob_use_dynamic_bsz", f"{r}.log_prob_max_token_len_per_gpu"), None, ms)
        put(f"{r}.log_prob_micro_batch_size_per_gpu", w.micro_batch, f"{wl} micro_batch")
        engine(r, {"param_offload": f"{r}.fsdp_config.param_offload"}, ms, False)
    critic = role_of.get("critic")
    if critic and (critic, "train") in of:
        ms = of[(critic, "train")]
        put("critic.strategy", strategy, "layouts of the trained model-stages (TP/PP: megatron)")
        batching(
            ("critic.use_dynamic_bsz", "critic.ppo_max_token_len_per_gpu"), "critic.ppo_micro_batch_size_per_gpu", ms
        )
        if w.micro_batch_tokens is not None:
            put("critic.forward_max_token_len_per_gpu", tokens_per_gpu(ms), f"{wl} micro_batch_tokens / layout {ms} cp")
        engine(
            "critic",
            {
                "param_offload": "critic.fsdp.param_offload",
                "optimizer_offload": "critic.fsdp.optimizer_offload",
                "recompute": "critic.model.enable_gradient_checkpointing",
                "ulysses": "critic.ulysses_sequence_parallel_size",
            },
            ms,
            True,
        )
        if (critic, "infer") in of:
            same_as_train(of[(critic, "infer")], ms)
    reward = role_of.get("reward")
    if reward and (reward, "infer") in of:
        ms = of[(reward, "infer")]
        rm = "reward.reward_model"
        put(f"{rm}.enable", True, f"model @{reward} (frozen, value head)")
        server(f"{rm}.rollout", ms, "reward model server")
        put(f"{rm}.rollout.prompt_length", w.prompt_len_max, f"{wl} prompt_len_max")
        put(f"{rm}.rollout.response_length", w.response_len_max, f"{wl} response_len_max")
    for name in rest:
        notes.append(f"not expressible in verl: model @{name} (verl has one actor, critic, ref and reward model)")
    for ms in sorted(set(stage_kinds) - set(of.values())):
        notes.append(f"not expressible in verl: {ms} (a second {stage_kinds[ms]} stage of model @{lays[ms].model})")
    for st in w.stages:  # model-stages Nereus runs side by side run one after another in verl
        mss = st.model_stages()
        apart = [x for x in mss if any(not set(lays[x].mesh) & set(lays[y].mesh) for y in mss if y != x)]
        if apart:
            notes.append(
                f"not expressible in verl: stage {st.name} runs {', '.join(apart)} side by side on disjoint "
                "GPUs; verl runs them one after another on all GPUs"
            )

    config = f"--config-name {'ppo_megatron_trainer' if megatron else 'ppo_trainer'}"
    form = "Hydra overrides" if target == "verl-overrides" else "YAML"
    lines = header(m, plan, "verl", f"{form} for verl's {strategy} workers ({config})")
    if target == "verl-overrides":
        lines.append(f"# use: python -m verl.trainer.main_ppo {config} $(grep -v '^#' THIS_FILE)")
    else:
        lines.append(
            f"# use: a config of your own with `defaults: [{config.split()[1]}, _self_]` and these keys, "
            "verl's config directory on Hydra's search path"
        )
    lines += [f"# {n}" for n in dict.fromkeys(notes)]
    return lines + (overrides(entries) if target == "verl-overrides" else yaml(entries))


def scalar(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def yaml(entries) -> list[str]:
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
                lines.append(f"{'  ' * depth}{k}: {scalar(v[0])}  # {v[1]}")

    walk(tree, 0)
    return lines


def overrides(entries) -> list[str]:
    lines, last = [], None
    for key, value, src in entries:
        if src != last:
            lines.append(f"# {src}")
            last = src
        plus = "+" if any(k in key for k in OPEN_KEYS) else ""
        lines.append(f"{plus}{key}={scalar(value)}")
    return lines
