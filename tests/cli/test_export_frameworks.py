"""The exports of every example plan (as written and as ``plan-search`` finds them, plus FSDP,
dynamic-batching and ZeRO-3 variants), checked by the frameworks' own code:

- verl 0.9.1 (``requirements-verl.txt``): its trainer config (``ppo_trainer.yaml`` or
  ``ppo_megatron_trainer.yaml``) composed by Hydra with the exported overrides, and separately
  a user config that lists it in its defaults with the exported YAML; then what
  ``verl.trainer.main_ppo.main`` runs before it starts Ray (``validate_config`` with
  ``need_reference_policy`` and ``need_critic``), the config resolved as its task runner does,
  and the rollout (``RolloutConfig``), reference engine and reward configs built with
  ``omega_conf_to_dataclass`` (``reward.reward_model``'s: verl 0.9.1's own
  ``RewardManagerConfig`` does not build outside its trainer).
- megatron-core 0.16.1 (``requirements-megatron.txt``; Megatron-LM's ``megatron/training``,
  which holds ``parse_args``, is not on PyPI): each argument array parsed with Megatron-LM's
  names, turned into ``TransformerConfig`` the way Megatron-LM's
  ``core_transformer_config_from_args`` does (same-named fields copied, its renames applied) and
  into ``DistributedDataParallelConfig``, so that their ``__post_init__`` checks run, and
  ``GPTModel``'s signature bound with the model's RoPE base and length; the launch line checked
  for what ``validate_args`` requires.
- vLLM: ``tests/cli/test_export.py``.
"""

import argparse
import copy
import dataclasses
import inspect
import json
import os
import shlex
from dataclasses import replace

import pytest

import nereus
from nereus.export import export_plan

from ..support import example
from .test_export import MEGATRON_FLAGS, MEGATRON_SWITCHES, megatron_arrays

EXAMPLES = {"grpo": "grpo_7b_8gpu.nir", "ppo8b": "ppo_8b_16gpu.nir", "ppo70b": "ppo_70b_1024gpu.nir"}


def _load(name):
    path = example(EXAMPLES[name])
    return nereus.verify(nereus.parse(path.read_text(), str(path)))


def _fsdp(m):
    """The 8B PPO job with FSDP training (TP = PP = 1, ZeRO-3 over all 16 GPUs): verl's FSDP workers."""
    p = m.plans["ppo_p0"]
    for ms, lay in p.layouts.items():
        if ms.endswith(".train"):
            md = m.models[lay.model]
            p.layouts[ms] = replace(
                lay, tp=1, pp=1, dp=16, layers=[(0, md.layers - 1)], mesh=list(range(16)), micro_batches=1, zero=3
            )
    return "ppo_p0"


def _dynamic(m):
    """The GRPO job with a token budget per micro-batch (verl's use_dynamic_bsz)."""
    m.workloads["grpo"].micro_batch_tokens = 16384
    return "grpo_p0"


def _zero3(m):
    """The GRPO job trained with ZeRO-3 (Megatron-FSDP) and fp32 gradients."""
    p = m.plans["grpo_p0"]
    p.layouts["actor.train"] = replace(p.layouts["actor.train"], zero=3, grad_dtype="fp32")
    return "grpo_p0"


def _tp_overlap(m):
    """The GRPO job's actor (TP 4 with sequence parallelism) with TP communication overlapped."""
    p = m.plans["grpo_p0"]
    p.layouts["actor.train"] = replace(p.layouts["actor.train"], tp_overlap=True)
    nereus.verify(m)
    return "grpo_p0"


def _overlaps_off(m):
    """The 70B PPO job's actor interleaved 2 ways, with its pipeline sends and its DP communication
    waited on instead of overlapped (Megatron-LM: --no-overlap-p2p-communication, no --overlap-*)."""
    p = m.plans["ppo70b_p0"]
    p.layouts["actor.train"] = replace(p.layouts["actor.train"], vpp=2, pp_overlap=False, dp_overlap=False)
    nereus.verify(m)
    return "ppo70b_p0"


def _attention(m):
    """The 70B PPO job as Megatron-LM ran before FlashAttention: the actor's scores materialized
    (with full recomputation, and Megatron-LM's default attention dropout), the critic's
    recomputed by selective recomputation instead."""
    p = m.plans["ppo70b_p0"]
    actor = p.layouts["actor.train"].model
    m.models[actor] = replace(m.models[actor], attention_dropout=0.1)
    p.layouts["actor.train"] = replace(p.layouts["actor.train"], attention="materialized")
    p.layouts["critic.train"] = replace(p.layouts["critic.train"], recompute=False, attention="recomputed")
    nereus.verify(m)
    return "ppo70b_p0"


def _moe(m):
    """The GRPO job's actor and reference as mixtures of experts (Qwen2-MoE-like: 8 experts, top 2,
    a shared expert), on the same plan: the experts split by TP as a dense MLP (EP 1)."""
    for name in ("actor", "ref"):
        md = m.models[name]
        md.experts, md.experts_per_token, md.expert_ffn, md.shared_expert_ffn = 8, 2, md.ffn // 8, md.ffn // 4
        md.__dict__.pop("tensors", None)  # the inventory, cached, is remade with the experts
        md.__dict__.pop("expert_of", None)
    m.emus.clear()  # the dense MLP's slices: the plan's EMUs are derived again where needed
    nereus.verify(m)
    return "grpo_p0"


def _expert_parallel(m):
    """``grpo_moe`` with expert parallelism: training EP 4 x ETP 2 carved from TP 4 x DP 2, the
    reference EP 4 with whole experts, and the rollout's vLLM engines EP over their TP ranks."""
    plan = _moe(m)
    p = m.plans[plan]
    for ms, ep, etp in (("actor.train", 4, 2), ("actor.infer", 4, 2), ("ref.infer", 4, 1), ("actor.generate", 2, 1)):
        p.layouts[ms] = replace(p.layouts[ms], ep=ep, etp=etp)
    m.emus.clear()
    nereus.verify(m)
    return plan


def _uneven(layers, vpp):
    """The 70B PPO job's actor trained over uneven pipeline stages, interleaved ``vpp`` ways."""

    def make(m):
        p = m.plans["ppo70b_p0"]
        p.layouts["actor.train"] = replace(p.layouts["actor.train"], layers=layers, vpp=vpp)
        m.emus.clear()
        nereus.verify(m)
        return "ppo70b_p0"

    return make


def _searched(name):
    def make(m):
        nereus.run_pipeline(m, "plan-search")
        (new,) = set(m.plans) - {p for p in _load(name).plans}
        return new

    return make


CASES = {
    "grpo_p0": ("grpo", lambda m: "grpo_p0"),
    "ppo_p0": ("ppo8b", lambda m: "ppo_p0"),
    "ppo70b_p0": ("ppo70b", lambda m: "ppo70b_p0"),
    "grpo_searched": ("grpo", _searched("grpo")),
    "ppo_searched": ("ppo8b", _searched("ppo8b")),
    "ppo70b_searched": ("ppo70b", _searched("ppo70b")),
    "ppo_fsdp": ("ppo8b", _fsdp),
    "grpo_dynamic": ("grpo", _dynamic),
    "grpo_zero3": ("grpo", _zero3),
    "grpo_tp_overlap": ("grpo", _tp_overlap),
    "ppo70b_overlaps_off": ("ppo70b", _overlaps_off),
    "ppo70b_attention": ("ppo70b", _attention),
    "grpo_moe": ("grpo", _moe),
    "grpo_ep": ("grpo", _expert_parallel),
    # a layer fewer at each end, as Llama 3's 405B: Megatron-LM's first and last stage sizes
    "ppo70b_ends": ("ppo70b", _uneven([(0, 17), (18, 39), (40, 61), (62, 79)], 2)),
    # uneven middle stages: only Megatron-LM's layout string says it
    "ppo70b_layout": ("ppo70b", _uneven([(0, 21), (22, 39), (40, 61), (62, 79)], 2)),
}
_CACHE: dict = {}


def case(name):
    """``(module, plan name)`` of a case, built once per session (plan-search takes seconds)."""
    if name not in _CACHE:
        ex, make = CASES[name]
        m = _load(ex)
        _CACHE[name] = (m, make(m))
    return _CACHE[name]


# --------------------------------------------------------------------------------------------- verl
def _hf_dir(tmp_path, md):
    """A Hugging Face model directory (config.json only) of the IR model, for verl's HFModelConfig."""
    transformers = pytest.importorskip("transformers")
    family = "qwen3" if md.qk_norm else "qwen2" if md.qkv_bias else "llama"
    cfg = transformers.AutoConfig.for_model(
        family,
        num_hidden_layers=md.layers,
        hidden_size=md.hidden,
        num_attention_heads=md.heads,
        num_key_value_heads=md.kv_heads,
        intermediate_size=md.ffn,
        vocab_size=md.vocab,
        architectures=[{"qwen3": "Qwen3", "qwen2": "Qwen2", "llama": "Llama"}[family] + "ForCausalLM"],
    )
    d = tmp_path / md.name
    cfg.save_pretrained(d)
    return d


def _user_overrides(tmp_path, m, plan):
    """What a user adds to any verl config: the checkpoints' paths (here: config.json only, no tokenizer)."""
    roles = {md.name: md for md in m.models.values()}
    w = m.workloads[m.plans[plan].workload]
    actor = next(roles[r] for r in w.roles if roles[r].trained and roles[r].head == "lm")
    out = [f"actor_rollout_ref.model.path={_hf_dir(tmp_path, actor)}", "+actor_rollout_ref.model.load_tokenizer=false"]
    critic = [roles[r] for r in w.roles if roles[r].trained and roles[r].head == "value"]
    if critic:
        out += [f"critic.model.path={_hf_dir(tmp_path, critic[0])}", "+critic.model.load_tokenizer=false"]
    return out


def _verl_check(cfg):
    """What verl runs on its config before training: main_ppo.main's validation, then the task
    runner's resolve and the dataclasses its workers build."""
    from omegaconf import OmegaConf
    from verl.trainer.main_ppo import need_critic, need_reference_policy, validate_config
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import RewardModelConfig, RolloutConfig

    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    OmegaConf.resolve(cfg)
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    assert isinstance(rollout, RolloutConfig)
    ref = cfg.actor_rollout_ref.ref
    if need_reference_policy(cfg):
        omega_conf_to_dataclass(ref.megatron if cfg.actor_rollout_ref.actor.strategy == "megatron" else ref.fsdp_config)
    reward = None
    if cfg.reward.reward_model.enable:  # verl builds the reward model's config only then
        reward = omega_conf_to_dataclass(cfg.reward.reward_model)
        assert isinstance(reward, RewardModelConfig) and isinstance(reward.rollout, RolloutConfig)
    return rollout, reward


def _config_name(text):
    return "ppo_megatron_trainer" if "--config-name ppo_megatron_trainer" in text.splitlines()[0] else "ppo_trainer"


@pytest.fixture
def verl_config_dir():
    pytest.importorskip("verl.trainer.main_ppo")
    import verl.trainer.config
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    yield os.path.dirname(verl.trainer.config.__file__)
    GlobalHydra.instance().clear()


@pytest.mark.parametrize("name", list(CASES))
def test_verl_overrides_pass_verls_validation(name, tmp_path, verl_config_dir):
    from hydra import compose, initialize_config_dir

    m, plan = case(name)
    text = export_plan(m, plan, "verl-overrides")
    overrides = [line for line in text.splitlines() if line and not line.startswith("#")]
    with initialize_config_dir(config_dir=verl_config_dir, version_base=None):
        cfg = compose(config_name=_config_name(text), overrides=overrides + _user_overrides(tmp_path, m, plan))
    rollout, reward = _verl_check(cfg)
    p, w = m.plans[plan], m.workloads[m.plans[plan].workload]
    gen = p.layouts["actor.generate"]
    assert (
        rollout.name == "vllm"
        and rollout.tensor_model_parallel_size == gen.tp
        and rollout.pipeline_model_parallel_size == 1
    )
    assert cfg.trainer.total_training_steps == w.steps
    if m.models["actor"].moe:
        assert rollout.expert_parallel_size == gen.ep
        train = p.layouts["actor.train"]
        megatron = cfg.actor_rollout_ref.actor.megatron
        assert (megatron.expert_model_parallel_size, megatron.expert_tensor_parallel_size) == (
            train.ep,
            train.expert_tp,
        )
    roles = set(w.roles)
    assert (cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward) == ("ref" in roles)
    assert (reward is not None and reward.enable) == ("reward" in roles)
    if "reward" in roles:
        assert reward.rollout.tensor_model_parallel_size == p.layouts["reward.infer"].tp
    if gen.pp > 1:
        assert f"actor.generate pp = {gen.pp}; verl's vLLM rollout has no pipeline parallelism" in text
    a = cfg.actor_rollout_ref.actor
    train = p.layouts["actor.train"]
    if a.get("megatron") is not None and "override_ddp_config" in text:
        # verl's Megatron workers build megatron-core's DDP config from its defaults and these
        # overrides: the DP overlap the estimate assumed is what they run
        from megatron.core.distributed import DistributedDataParallelConfig

        ddp = DistributedDataParallelConfig(
            **{
                "use_distributed_optimizer": a.megatron.use_distributed_optimizer,
                "grad_reduce_in_fp32": True,
                "overlap_grad_reduce": False,
                **a.megatron.override_ddp_config,
            }
        )
        assert ddp.overlap_grad_reduce == (train.replicas > 1 and train.dp_overlap)
        assert ddp.overlap_param_gather == (train.replicas > 1 and train.zero >= 1 and train.dp_overlap)
    if a.get("megatron") is not None and train.pp > 1 and train.vpp > 1:
        # verl's Megatron workers set overlap_p2p_comm where vpp > 1; the overrides have the last word
        overrides = a.megatron.override_transformer_config
        assert overrides.get("overlap_p2p_comm", True) == train.pp_overlapped
    assert a.use_dynamic_bsz == (w.micro_batch_tokens is not None)
    if w.micro_batch_tokens is not None:
        assert a.ppo_max_token_len_per_gpu == w.micro_batch_tokens // p.layouts["actor.train"].cp
        assert (
            cfg.actor_rollout_ref.rollout.log_prob_use_dynamic_bsz
            and cfg.actor_rollout_ref.ref.log_prob_use_dynamic_bsz
        )


@pytest.mark.parametrize("name", list(CASES))
def test_verl_yaml_passes_verls_validation(name, tmp_path, verl_config_dir):
    """The YAML route: Hydra merges unknown keys silently here, so only validation finds them."""
    from hydra import compose, initialize_config_dir

    m, plan = case(name)
    text = export_plan(m, plan, "verl")
    (tmp_path / "job.yaml").write_text(
        f"defaults:\n  - {_config_name(text)}\n  - _self_\nhydra:\n  searchpath:\n    - pkg://verl.trainer.config\n"
        + text
    )
    with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
        cfg = compose(config_name="job", overrides=_user_overrides(tmp_path, m, plan))
    _verl_check(cfg)


def test_verl_fsdp_keys():
    m, plan = case("ppo_fsdp")
    text = export_plan(m, plan, "verl-overrides")
    assert "--config-name ppo_trainer" in text and "critic.fsdp.param_offload=" in text
    assert "critic.model.fsdp_config" not in text and "reward_model.strategy" not in text


# ----------------------------------------------------------------------------------------- megatron


def megatron_args(argv):
    """``argv`` under Megatron-LM's argument names (arguments.py), defaults as Megatron-LM's."""
    p = argparse.ArgumentParser(allow_abbrev=False)
    for flag, kind in MEGATRON_FLAGS.items():
        p.add_argument(flag, type=kind)
    for flag in MEGATRON_SWITCHES:
        p.add_argument(flag, action="store_true")
    p.add_argument("--no-overlap-p2p-communication", action="store_false", dest="overlap_p2p_comm")
    a = p.parse_args(argv)
    # validate_args: "Overlap P2P communication is disabled if not using the interleaved schedule"
    # (a layout string's stages beyond one per PP rank are its virtual stages)
    layout_stages = a.pipeline_model_parallel_layout.count("|") + 1 if a.pipeline_model_parallel_layout else 0
    interleaved = layout_stages > (a.pipeline_model_parallel_size or 1)
    if not (a.num_layers_per_virtual_pipeline_stage or a.num_virtual_stages_per_pipeline_rank or interleaved):
        a.overlap_p2p_comm = False
    a.rotary_base = 10000 if a.rotary_base is None else a.rotary_base
    a.norm_epsilon = 1e-5 if a.norm_epsilon is None else a.norm_epsilon
    a.expert_model_parallel_size = a.expert_model_parallel_size or 1
    # validate_args: "if args.expert_tensor_parallel_size is None: ... = args.tensor_model_parallel_size"
    a.expert_tensor_parallel_size = a.expert_tensor_parallel_size or a.tensor_model_parallel_size
    return a


def transformer_config(a):
    """Megatron-LM's core_transformer_config_from_args on these arguments."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    args = vars(a).copy()
    args["params_dtype"] = torch.bfloat16 if a.bf16 else torch.float16 if a.fp16 else torch.float32
    if not a.group_query_attention:
        args["num_query_groups"] = None
    kw = {f.name: args[f.name] for f in dataclasses.fields(TransformerConfig) if f.name in args}
    kw |= {
        "layernorm_epsilon": a.norm_epsilon,
        "pipeline_dtype": args["params_dtype"],
        "add_bias_linear": not a.disable_bias_linear,
        "num_layers_in_first_pipeline_stage": a.decoder_first_pipeline_num_layers,
        "num_layers_in_last_pipeline_stage": a.decoder_last_pipeline_num_layers,
        "fp8": a.fp8_format,
        "deallocate_pipeline_outputs": True,
        "batch_p2p_comm": not a.overlap_p2p_comm,
    }
    if a.num_layers_per_virtual_pipeline_stage:  # validate_args derives the virtual stages
        kw["virtual_pipeline_model_parallel_size"] = (
            a.num_layers // a.pipeline_model_parallel_size // a.num_layers_per_virtual_pipeline_stage
        )
    elif a.num_virtual_stages_per_pipeline_rank:  # validate_args: taken as it is
        kw["virtual_pipeline_model_parallel_size"] = a.num_virtual_stages_per_pipeline_rank
    if a.swiglu:
        kw |= {"gated_linear_unit": True, "activation_func": F.silu}
    if a.num_experts:  # Megatron-LM: args.num_experts -> num_moe_experts
        kw["num_moe_experts"] = a.num_experts
    if a.attention_backend:  # Megatron-LM: the name of an AttnBackend member
        from megatron.core.transformer.enums import AttnBackend

        kw["attention_backend"] = AttnBackend[a.attention_backend]
    return TransformerConfig(**kw)


def ddp_config(a):
    """Megatron-LM's DistributedDataParallelConfig: bf16 gradients reduce in fp32 unless --grad-reduce-in-bf16."""
    from megatron.core.distributed import DistributedDataParallelConfig

    fp32 = a.accumulate_allreduce_grads_in_fp32 or (a.bf16 and not a.grad_reduce_in_bf16)
    kw = dict(grad_reduce_in_fp32=fp32, use_distributed_optimizer=a.use_distributed_optimizer)
    kw |= dict(overlap_grad_reduce=a.overlap_grad_reduce, overlap_param_gather=a.overlap_param_gather)
    if a.use_megatron_fsdp:
        kw |= dict(use_megatron_fsdp=True, data_parallel_sharding_strategy=a.data_parallel_sharding_strategy)
    return DistributedDataParallelConfig(**kw)


def _env(text, var):
    line = next(x for x in text.splitlines() if x.startswith(f"{var}_ENV=("))
    return shlex.split(line.split("=(", 1)[1].rsplit(")", 1)[0])


@pytest.mark.parametrize("name", list(CASES))
def test_megatron_launch_is_complete(name):
    """What Megatron-LM's validate_args requires, and what the plan says, on every launch line."""
    m, plan = case(name)
    p = m.plans[plan]
    text = export_plan(m, plan, "megatron")
    for var, argv in megatron_arrays(text).items():
        ms = var.removesuffix("_ARGS").lower().replace("_", ".", 1)
        lay, md = p.layouts[ms], m.models[p.layouts[ms].model]
        a = megatron_args(argv)
        assert a.max_position_embeddings >= a.seq_length
        env = _env(text, var.removesuffix("_ARGS"))
        assert ("CUDA_DEVICE_MAX_CONNECTIONS=1" in env) == (lay.tp > 1 or lay.cp > 1)
        assert a.grad_reduce_in_bf16 == (lay.grad_dtype == "bf16" and md.dtype == "bf16")
        assert a.accumulate_allreduce_grads_in_fp32 == (lay.grad_dtype == "fp32")
        assert a.add_qkv_bias == md.qkv_bias and a.qk_layernorm == md.qk_norm
        assert "--rotary-base" in argv and "--norm-epsilon" in argv
        if md.rope_theta is not None:
            assert a.rotary_base == md.rope_theta and a.norm_epsilon == md.norm_eps
        assert a.use_megatron_fsdp == (lay.zero >= 2)
        assert (a.attention_backend == "unfused") == (lay.attention != "flash")
        assert (a.recompute_granularity == "selective") == (lay.attention == "recomputed")
        if lay.zero >= 2:
            assert a.data_parallel_sharding_strategy == {2: "optim_grads", 3: "optim_grads_params"}[lay.zero]
        assert f"{ms} zero = {lay.zero}: the distributed optimizer" not in text


@pytest.mark.parametrize("name", list(CASES))
def test_megatron_core_accepts_the_arguments(name):
    pytest.importorskip("megatron.core")
    from megatron.core.models.gpt import GPTModel

    m, plan = case(name)
    p = m.plans[plan]
    text = export_plan(m, plan, "megatron")
    arrays = megatron_arrays(text)
    assert arrays
    for var, argv in arrays.items():
        ms = var.removesuffix("_ARGS").lower().replace("_", ".", 1)
        lay, md = p.layouts[ms], m.models[p.layouts[ms].model]
        a = megatron_args(argv)
        cfg = transformer_config(a)
        assert (cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, cfg.context_parallel_size) == (
            lay.tp,
            lay.pp,
            lay.cp,
        )
        assert cfg.add_qkv_bias == md.qkv_bias and cfg.qk_layernorm == md.qk_norm and cfg.kv_channels == md.hd
        assert (cfg.sequence_parallel, cfg.tp_comm_overlap) == (lay.sp, lay.tp_overlap)
        # the model's attention dropout, and none on the hidden states (Megatron's defaults: 0.1 both)
        assert (cfg.attention_dropout, cfg.hidden_dropout) == (md.attention_dropout, 0.0)
        assert cfg.num_query_groups in (md.kv_heads, None) and cfg.ffn_hidden_size == md.ffn
        moe = (
            cfg.num_moe_experts,
            cfg.moe_router_topk,
            cfg.moe_ffn_hidden_size,
            cfg.moe_shared_expert_intermediate_size,
        )
        assert moe == (
            (md.experts, md.experts_per_token, md.expert_ffn, md.shared_expert_ffn) if md.moe else (None,) * 4
        )
        if md.moe:
            assert (cfg.expert_model_parallel_size, cfg.expert_tensor_parallel_size) == (lay.ep, lay.expert_tp)
        # every PP rank's virtual stages build the layers the layout gives the rank, split evenly
        v = cfg.virtual_pipeline_model_parallel_size or 1
        assert v == lay.vpp
        built = [[_layers_built(cfg, i, j) for j in range(v)] for i in range(lay.pp)]
        assert built == [[(hi - lo + 1) // v] * v for lo, hi in lay.layers], built
        ddp = ddp_config(a)
        assert ddp.grad_reduce_in_fp32 == (lay.grad_dtype == "fp32")
        assert ddp.use_megatron_fsdp == (lay.zero >= 2) and ddp.use_distributed_optimizer == (lay.zero >= 1)
        # the DP communication the estimate hides behind compute, asked of Megatron as estimated
        assert ddp.overlap_grad_reduce == (lay.replicas > 1 and lay.dp_overlap)
        assert ddp.overlap_param_gather == (lay.replicas > 1 and lay.zero >= 1 and lay.dp_overlap)
        # pipeline sends beside compute where the plan says so; Megatron overlaps them only interleaved
        assert cfg.overlap_p2p_comm == (lay.pp_overlapped and lay.vpp > 1)
        inspect.signature(GPTModel).bind_partial(
            config=cfg,
            transformer_layer_spec=None,
            vocab_size=md.vocab,
            max_sequence_length=a.max_position_embeddings,
            position_embedding_type=a.position_embedding_type,
            rotary_base=a.rotary_base,
            share_embeddings_and_output_weights=not a.untie_embeddings_and_output_weights,
        )


def _layers_built(cfg, pp_rank, vp_stage):
    """The decoder layers megatron-core builds on ``pp_rank``'s virtual stage ``vp_stage``."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    if cfg.pipeline_model_parallel_layout is not None:  # its own table, read without a process group
        return cfg.pipeline_model_parallel_layout.layout[pp_rank][vp_stage].count(LayerType.decoder)
    return get_num_layers_to_build(
        cfg, vp_stage=vp_stage if cfg.virtual_pipeline_model_parallel_size else None, pp_rank=pp_rank
    )


def test_uneven_interleaved_pipelines_export_as_megatron_takes_them():
    """Uneven stages with virtual stages: the first and last apart by Megatron-LM's first/last
    sizes and the virtual stages by count; any other split by a layout string."""
    for name, expect in (
        ("ppo70b_ends", ["--decoder-first-pipeline-num-layers", "--num-virtual-stages-per-pipeline-rank"]),
        ("ppo70b_layout", ["--pipeline-model-parallel-layout"]),
    ):
        m, plan = case(name)
        argv = megatron_arrays(export_plan(m, plan, "megatron"))["ACTOR_TRAIN_ARGS"]
        assert all(flag in argv for flag in expect), (name, argv)
        assert "--num-layers-per-virtual-pipeline-stage" not in argv
    argv = megatron_arrays(export_plan(*case("ppo70b_layout"), "megatron"))["ACTOR_TRAIN_ARGS"]
    layout = argv[argv.index("--pipeline-model-parallel-layout") + 1]
    assert layout == "Et*11|t*9|t*11|t*9|t*11|t*9|t*11|t*9L"


def test_cases_cover_what_the_checks_are_for():
    """The cases include TP > 1, PP > 1, q/k/v biases, ZeRO-3, FSDP and dynamic batching."""
    lays = [lay for n in CASES for lay in case(n)[0].plans[case(n)[1]].layouts.values()]
    assert any(lay.tp > 1 for lay in lays) and any(lay.pp > 1 for lay in lays) and any(lay.zero == 3 for lay in lays)
    assert any(md.qkv_bias for md in case("grpo_p0")[0].models.values())
    assert json.dumps(sorted(CASES))


# ------------------------------------------------------------------------------------------- vLLM
@pytest.mark.parametrize("ep, how", [(2, "per instance"), (8, "experts span the engines")])
def test_vllm_parses_the_rollouts_expert_parallelism(ep, how):
    """EP over each engine's TP ranks runs one server per instance; EP over TP x DP, one server
    for all: each line parsed by vLLM's own argument parser."""
    pytest.importorskip("vllm")
    from vllm import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    m, plan = case("grpo_ep")
    m = copy.deepcopy(m)
    p = m.plans[plan]
    p.layouts["actor.generate"] = replace(p.layouts["actor.generate"], ep=ep, etp=1)
    m.emus.clear()
    nereus.verify(m)
    text = export_plan(m, plan, "vllm")
    line = next(x for x in text.splitlines() if how in x and "vllm serve MODEL" in x)
    flags = shlex.split(line.split("vllm serve MODEL", 1)[1])
    parsed = EngineArgs.from_cli_args(EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(flags))
    assert parsed.enable_expert_parallel
    # vLLM's EP size is TP x DP of the server
    assert parsed.tensor_parallel_size * parsed.data_parallel_size == ep
    assert "not expressible" not in text.split("# actor.generate")[1]


def test_an_expert_split_vllm_cannot_run_is_said():
    m, plan = case("grpo_ep")
    m = copy.deepcopy(m)
    p = m.plans[plan]
    p.layouts["actor.generate"] = replace(p.layouts["actor.generate"], ep=4, etp=2)  # experts split by TP 2
    m.emus.clear()
    nereus.verify(m)
    assert "not expressible in vLLM: actor.generate ep = 4, etp = 2" in export_plan(m, plan, "vllm")
    assert "not expressible in verl: actor.generate ep = 4, etp = 2" in export_plan(m, plan, "verl")
