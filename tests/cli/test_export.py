"""``nereus export``: the values each target gets equal the plan's layouts; the outputs parse
(YAML, Hydra overrides, Megatron-LM arguments through an argparse mirror, vLLM's own EngineArgs
and CLI parser when vLLM is installed); what a target cannot express is said; a missing plan
is a diagnostic listing the plans."""

import argparse
import shlex

import pytest

import nereus
from nereus.cli import main
from nereus.export import export_plan

from ..support import example

PPO, GRPO = example("ppo_8b_16gpu.nir"), example("grpo_7b_8gpu.nir")


def load(path):
    return nereus.verify(nereus.parse(path.read_text(), str(path)))


def simple_yaml(text: str) -> dict:
    """The export's YAML (nested keys, two-space indent, scalars, # comments), without pyyaml."""
    root: dict = {}
    stack = [(-1, root)]
    for line in text.splitlines():
        body = line.split("  #")[0].rstrip()
        if not body or body.lstrip().startswith("#"):
            continue
        depth = len(body) - len(body.lstrip())
        key, _, value = body.strip().partition(":")
        key = key.strip("'")
        while stack[-1][0] >= depth:
            stack.pop()
        if value.strip():
            v = value.strip()
            root_v = {"true": True, "false": False}.get(v, v)
            for cast in (int, float):
                try:
                    root_v = cast(v)
                    break
                except ValueError:
                    pass
            stack[-1][1][key] = root_v
        else:
            stack[-1][1][key] = child = {}
            stack.append((depth, child))
    return root


def parse_yaml(text: str) -> dict:
    try:
        import yaml
    except ImportError:
        return simple_yaml(text)
    assert yaml.safe_load(text) == simple_yaml(text)
    return yaml.safe_load(text)


def flatten(d: dict, prefix="") -> dict:
    out = {}
    for k, v in d.items():
        out.update(flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


@pytest.mark.parametrize("path, plan", [(PPO, "ppo_p0"), (GRPO, "grpo_p0")])
def test_verl_values_are_the_layouts(path, plan):
    m = load(path)
    p, w = m.plans[plan], m.workloads[m.plans[plan].workload]
    text = export_plan(m, "@" + plan, "verl")
    assert text.startswith(f"# Nereus plan @{plan} from {path}")
    cfg = flatten(parse_yaml(text))
    lay = p.layouts
    assert cfg["trainer.nnodes"] * cfg["trainer.n_gpus_per_node"] == m.clusters[p.cluster].num_gpus
    assert cfg["data.train_batch_size"] == w.global_batch and cfg["actor_rollout_ref.rollout.n"] == w.group_size
    assert cfg["actor_rollout_ref.actor.ppo_mini_batch_size"] * w.group_size == w.mini_batch
    assert cfg["algorithm.adv_estimator"] == {"ppo": "gae", "grpo": "grpo"}[w.algorithm]
    assert cfg["actor_rollout_ref.rollout.tensor_model_parallel_size"] == lay["actor.generate"].tp
    assert 0.3 < cfg["actor_rollout_ref.rollout.gpu_memory_utilization"] <= 0.9
    roles = {
        "actor_rollout_ref.actor": "actor.train",
        "actor_rollout_ref.ref": "ref.infer",
        "critic": "critic.train",
    }
    # the reward model is verl 0.9.1's reward.reward_model, an inference server (the legacy reward_model.* is gone)
    assert not any(k.startswith("reward_model.") for k in cfg)
    if "reward.infer" in lay:
        assert cfg["reward.reward_model.enable"] is True
        assert cfg["reward.reward_model.rollout.tensor_model_parallel_size"] == lay["reward.infer"].tp
    else:
        assert not any(k.startswith("reward.") for k in cfg)
    for prefix, ms in roles.items():
        if ms not in lay:
            assert not any(k.startswith(prefix + ".") for k in cfg)
            continue
        e = f"{prefix}.megatron"
        assert cfg[f"{e}.tensor_model_parallel_size"] == lay[ms].tp
        assert cfg[f"{e}.pipeline_model_parallel_size"] == lay[ms].pp
        assert cfg[f"{e}.context_parallel_size"] == lay[ms].cp
        assert cfg[f"{e}.sequence_parallel"] == lay[ms].sp
        assert cfg[f"{e}.param_offload"] == ("weights" in lay[ms].offload)
        if ms.endswith("train"):
            assert cfg[f"{e}.use_distributed_optimizer"] == (lay[ms].zero >= 1)
            assert f"{e}.grad_offload" not in cfg  # verl's McoreEngineConfig has no such key
            assert (cfg.get(f"{e}.override_transformer_config.recompute_granularity") == "full") == lay[ms].recompute
    # the Hydra overrides say the same
    overrides = export_plan(m, plan, "verl-overrides")
    pairs = dict(line.split("=", 1) for line in overrides.splitlines() if line and not line.startswith("#"))
    # keys verl's config leaves open (override_ddp_config's) are added with Hydra's +
    assert all(k.startswith("+") == (".override_ddp_config." in k) for k in pairs)
    pairs = {k.removeprefix("+"): v for k, v in pairs.items()}
    assert pairs == {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in cfg.items()}


def test_verl_says_what_it_cannot_express():
    notes = [
        x for x in export_plan(load(PPO), "ppo_p0", "verl").splitlines() if x.startswith("# not expressible in verl:")
    ]
    text = "\n".join(notes)
    # training side by side on GPUs 0..7 and 8..15; inference layouts unlike the training ones
    assert "stage train runs actor.train, critic.train side by side" in text
    assert "actor.train runs on GPUs 0..7 (dp = 1)" in text and "DP 2 there" in text
    assert "actor.infer (tp 2 x pp 1 x dp 2 on GPUs 0..3) differs from actor.train" in text
    # the GRPO plan is one verl can run as written: nothing to say
    assert "not expressible" not in export_plan(load(GRPO), "grpo_p0", "verl")


MEGATRON_FLAGS = {
    "--tensor-model-parallel-size": int,
    "--pipeline-model-parallel-size": int,
    "--context-parallel-size": int,
    "--num-layers-per-virtual-pipeline-stage": int,
    "--decoder-first-pipeline-num-layers": int,
    "--decoder-last-pipeline-num-layers": int,
    "--num-virtual-stages-per-pipeline-rank": int,
    "--pipeline-model-parallel-layout": str,
    "--recompute-granularity": str,
    "--recompute-method": str,
    "--recompute-num-layers": int,
    "--fp8-format": str,
    "--attention-backend": str,
    "--micro-batch-size": int,
    "--global-batch-size": int,
    "--seq-length": int,
    "--max-position-embeddings": int,
    "--rotary-base": int,
    "--norm-epsilon": float,
    "--attention-dropout": float,
    "--hidden-dropout": float,
    "--data-parallel-sharding-strategy": str,
    "--num-layers": int,
    "--hidden-size": int,
    "--num-attention-heads": int,
    "--num-query-groups": int,
    "--kv-channels": int,
    "--ffn-hidden-size": int,
    "--num-experts": int,
    "--moe-router-topk": int,
    "--moe-ffn-hidden-size": int,
    "--moe-shared-expert-intermediate-size": int,
    "--expert-model-parallel-size": int,
    "--expert-tensor-parallel-size": int,
    "--normalization": str,
    "--position-embedding-type": str,
}
MEGATRON_SWITCHES = (
    "--sequence-parallel",
    "--tp-comm-overlap",
    "--use-distributed-optimizer",
    "--overlap-grad-reduce",
    "--overlap-param-gather",
    "--accumulate-allreduce-grads-in-fp32",
    "--grad-reduce-in-bf16",
    "--use-megatron-fsdp",
    "--add-qkv-bias",
    "--qk-layernorm",
    "--group-query-attention",
    "--swiglu",
    "--untie-embeddings-and-output-weights",
    "--disable-bias-linear",
    "--bf16",
    "--fp16",
)


def megatron_parser() -> argparse.ArgumentParser:
    """The arguments the export may write, as Megatron-LM's arguments.py declares them."""
    p = argparse.ArgumentParser(allow_abbrev=False)
    for flag, kind in MEGATRON_FLAGS.items():
        p.add_argument(flag, type=kind)
    for flag in MEGATRON_SWITCHES:
        p.add_argument(flag, action="store_true")
    p.add_argument("--no-overlap-p2p-communication", action="store_false", dest="overlap_p2p_comm")
    return p


def megatron_arrays(text: str) -> dict[str, list[str]]:
    arrays, name = {}, None
    for line in text.splitlines():
        if line.endswith("=("):
            name = line[:-2]
            arrays[name] = []
        elif line == ")":
            name = None
        elif name:
            arrays[name] += shlex.split(line, comments=True)
    return arrays


@pytest.mark.parametrize("path, plan", [(PPO, "ppo_p0"), (GRPO, "grpo_p0")])
def test_megatron_arguments(path, plan):
    m = load(path)
    p = m.plans[plan]
    w = m.workloads[p.workload]
    text = export_plan(m, plan, "megatron")
    assert text.startswith(f"# Nereus plan @{plan} from {path}")
    arrays = megatron_arrays(text)
    trained = [ms for ms in p.layouts if w.stage_of(ms).kind == "train"]
    assert sorted(arrays) == sorted(ms.upper().replace(".", "_") + "_ARGS" for ms in trained)
    for ms in trained:
        lay, md = p.layouts[ms], m.models[p.layouts[ms].model]
        a = megatron_parser().parse_args(arrays[ms.upper().replace(".", "_") + "_ARGS"])
        assert (a.tensor_model_parallel_size, a.pipeline_model_parallel_size, a.context_parallel_size) == (
            lay.tp,
            lay.pp,
            lay.cp,
        )
        assert a.sequence_parallel == lay.sp and a.use_distributed_optimizer == (lay.zero >= 1)
        assert (a.recompute_granularity == "full") == lay.recompute
        assert (a.micro_batch_size, a.global_batch_size) == (w.micro_batch, w.mini_batch)
        assert a.seq_length == w.prompt_len_max + w.response_len_max
        assert (a.num_layers, a.hidden_size, a.num_attention_heads, a.ffn_hidden_size) == (
            md.layers,
            md.hidden,
            md.heads,
            md.ffn,
        )
        assert a.group_query_attention and a.num_query_groups == md.kv_heads
        assert a.swiglu and a.untie_embeddings_and_output_weights and a.bf16
    if path == PPO:  # a value head, and 16 micro-batches per flush against Megatron-LM's 128 / (1 x 4)
        assert "# not expressible in Megatron-LM: critic.train model @critic head = value" in text
        assert "actor.train micro_batches = 16 per pipeline flush" in text and "= 32 micro-batches" in text


def test_megatron_arrays_are_bash(tmp_path):
    import shutil
    import subprocess

    if not shutil.which("bash"):
        pytest.skip("no bash")
    script = tmp_path / "args.sh"
    script.write_text(export_plan(load(PPO), "ppo_p0", "megatron") + 'echo "${ACTOR_TRAIN_ARGS[@]:0:2}"\n')
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["--tensor-model-parallel-size", "4"]


def vllm_args(text: str) -> dict:
    ns: dict = {}
    exec(text, ns)  # comments and one dict literal
    return ns["ENGINE_ARGS"]


@pytest.mark.parametrize("path, plan", [(PPO, "ppo_p0"), (GRPO, "grpo_p0")])
def test_vllm_values(path, plan):
    m = load(path)
    p, w = m.plans[plan], m.workloads[m.plans[plan].workload]
    text = export_plan(m, plan, "vllm")
    assert text.startswith(f"# Nereus plan @{plan} from {path}")
    engines = vllm_args(text)
    lay = p.layouts["actor.generate"]
    assert list(engines) == ["actor.generate"]
    kw = engines["actor.generate"]
    assert (kw["tensor_parallel_size"], kw["pipeline_parallel_size"]) == (lay.tp, lay.pp)
    assert kw["max_model_len"] == w.prompt_len_max + w.response_len_max and kw["dtype"] == "bfloat16"
    assert 0.3 < kw["gpu_memory_utilization"] <= 0.9
    assert f"its dp = {lay.dp}" in text and f"--data-parallel-size {lay.dp}" in text


def test_vllm_accepts_the_arguments():
    pytest.importorskip("vllm")
    from vllm import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    text = export_plan(load(GRPO), "grpo_p0", "vllm")
    kw = vllm_args(text)["actor.generate"]
    e = EngineArgs(**kw)
    assert (e.tensor_parallel_size, e.max_model_len, e.gpu_memory_utilization) == (
        2,
        5120,
        kw["gpu_memory_utilization"],
    )
    serve = next(x for x in text.splitlines() if "one server for all: vllm serve MODEL" in x)
    flags = shlex.split(serve.split("vllm serve MODEL", 1)[1])
    parsed = EngineArgs.from_cli_args(EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(flags))
    assert (parsed.tensor_parallel_size, parsed.data_parallel_size, parsed.max_model_len) == (2, 4, 5120)
    assert parsed.gpu_memory_utilization == kw["gpu_memory_utilization"] and parsed.dtype == "bfloat16"


def test_missing_plan_lists_the_plans(capsys, tmp_path):
    with pytest.raises(nereus.DiagnosticError, match=r"export: no plan @nope; the module's plans: @ppo_p0"):
        export_plan(load(PPO), "@nope", "verl")
    assert main(["export", str(PPO), "--plan", "@ppo_p", "--to", "megatron"]) == 1
    err = capsys.readouterr().err
    assert "export: no plan @ppo_p; the module's plans: @ppo_p0" in err and "did you mean @ppo_p0?" in err
    out = tmp_path / "grpo.yaml"
    assert main(["export", str(GRPO), "--plan", "@grpo_p0", "--to", "verl", "-o", str(out)]) == 0
    assert out.read_text() == export_plan(load(GRPO), "grpo_p0", "verl")
