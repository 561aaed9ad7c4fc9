"""The reference jobs of ``examples/``, built from parameters.

The checked-in examples are produced by ``python -m nereus.testing.jobs examples/`` and a test checks
they are up to date; each carries the weights of one model-stage's EMUs (and, for generation,
the KV-cache budget); the benchmarks call the same builders at other sizes (the 70B job at
128 to 1,024 GPUs). Hardware figures are NVIDIA's H100 SXM datasheet: 80 GB HBM3 at 3.35 TB/s,
989 TFLOP/s dense bf16, 900 GB/s NVLink (450 GB/s each way) and one 400 Gb/s NIC per GPU.
"""

from __future__ import annotations

from pathlib import Path

from ..ir import parse, print_ir
from ..ir.presets import preset_attrs

H100 = """\
  gpu_memory = 80GiB
  peak_flops = 989TFLOPs
  hbm_bandwidth = 3.35TB/s
  intra_node = link(bandwidth = 450GB/s, latency = 2us)
  inter_node = link(bandwidth = 400Gb/s, latency = 5us)
  host_link = link(bandwidth = 55GB/s, latency = 10us)
  host_memory = 2TiB"""

# model shapes: the public presets (nereus/ir/presets.py, with their sources)
LLAMA3_8B = preset_attrs("llama3-8b")
LLAMA2_7B = preset_attrs("llama2-7b")
QWEN2_7B = preset_attrs("qwen2-7b")
LLAMA3_70B = preset_attrs("llama3-70b")
QWEN3_235B_A22B = preset_attrs("qwen3-235b-a22b")


TRAIN_70B = ", micro_batches = 16, zero = 1, recompute = true"  # the 70B job's training layouts


def _layout_line(ms: str, tp: int, pp: int, dp: int, layers: int, gpus: str, extra: str = "") -> str:
    per = layers // pp
    ranges = ", ".join(f"{i * per}..{(i + 1) * per - 1 if i < pp - 1 else layers - 1}" for i in range(pp))
    return f"  layout {ms} {{ tp = {tp}, pp = {pp}, dp = {dp}, layers = [{ranges}], mesh = [{gpus}]{extra} }}\n"


def _with_emus(text: str, plan: str, model_stage: str, filename: str) -> str:
    from ..passes.transition.derive_emus import model_stage_emus

    m = parse(text, filename)
    # weights (and generation's KV budget) only: with ZeRO-sharded optimizer state the replicas
    # of the 70B job would no longer print as one block; derive-emus adds the state
    for emu in model_stage_emus(m, plan, model_stage, weights_only=True):
        m.emus[emu.key] = emu
    return print_ir(m)


def ppo_8b_16gpu() -> str:
    text = f"""\
// PPO for an 8B actor (Llama-3-8B) with an 8B critic, an 8B reference model and a 7B-class
// reward model (Llama-2-7B with a value head), on 2 nodes x 8 H100-80GB.
cluster @h100x16 {{
  nodes = 2
  gpus_per_node = 8
{H100}
}}

model @actor {{ {LLAMA3_8B}, trained = true }}
model @critic {{ {LLAMA3_8B}, head = value, trained = true }}
model @ref {{ {LLAMA3_8B} }}
model @reward {{ {LLAMA2_7B}, head = value }}

workload @ppo {{
  algorithm = ppo
  roles = [@actor, @critic, @ref, @reward]
  global_batch = 512
  prompt_len_mean = 512
  prompt_len_max = 1024
  response_len_mean = 1024
  response_len_max = 2048
  ppo_epochs = 1
  mini_batch = 128
  micro_batch = 4
  steps = 1000
  stage generate {{ kind = generate, models = [@actor] }}
  stage infer {{ kind = infer, models = [@actor, @critic, @ref, @reward] }}
  stage train {{ kind = train, models = [@actor, @critic] }}
}}

// Generation replicates the actor widely (TP 2 x DP 8); the four inference model-stages
// each take a quarter of the GPUs; actor and critic train side by side with TP 4 x PP 2.
plan @ppo_p0 {{
  workload = @ppo
  cluster = @h100x16
{_layout_line("actor.generate", 2, 1, 8, 32, "0..15")}\
{_layout_line("actor.infer", 2, 1, 2, 32, "0..3")}\
{_layout_line("critic.infer", 2, 1, 2, 32, "4..7")}\
{_layout_line("ref.infer", 2, 1, 2, 32, "8..11")}\
{_layout_line("reward.infer", 2, 1, 2, 32, "12..15")}\
{_layout_line("actor.train", 4, 2, 1, 32, "0..7", ", micro_batches = 16, zero = 1, recompute = true")}\
{_layout_line("critic.train", 4, 2, 1, 32, "8..15", ", micro_batches = 16, zero = 1, recompute = true")}\
}}
"""
    return _with_emus(text, "ppo_p0", "actor.train", "ppo_8b_16gpu.nir")


def grpo_7b_8gpu() -> str:
    text = f"""\
// GRPO on a Qwen2-7B-class model (Llama-style with GQA), one node of 8 H100-80GB.
// The actor generates with TP 2 x DP 4 and trains with TP 4 x DP 2; the frozen reference
// model shares the GPUs with the actor's inference pass and is offloaded between steps.
// Responses are long-tailed (response_len_dist: the lengths of eighths of them); the training
// and inference passes use sequence parallelism with their TP.
cluster @h100x8 {{
  nodes = 1
  gpus_per_node = 8
{H100}
}}

model @actor {{ {QWEN2_7B}, trained = true }}
model @ref {{ {QWEN2_7B} }}

workload @grpo {{
  algorithm = grpo
  roles = [@actor, @ref]
  global_batch = 128
  group_size = 8
  prompt_len_mean = 512
  prompt_len_max = 1024
  response_len_mean = 1536
  response_len_max = 4096
  response_len_dist = [512, 768, 1024, 1280, 1536, 1792, 2048, 3328]
  mini_batch = 256
  micro_batch = 4
  steps = 500
  stage generate {{ kind = generate, models = [@actor] }}
  stage infer {{ kind = infer, models = [@actor, @ref] }}
  stage train {{ kind = train, models = [@actor] }}
}}

plan @grpo_p0 {{
  workload = @grpo
  cluster = @h100x8
  colocate = [[actor.infer, ref.infer]]
{_layout_line("actor.generate", 2, 1, 4, 28, "0..7")}\
{_layout_line("actor.infer", 4, 1, 2, 28, "0..7", ", sp = true")}\
{_layout_line("ref.infer", 4, 1, 2, 28, "0..7", ", sp = true, offload = [weights]")}\
{_layout_line("actor.train", 4, 1, 2, 28, "0..7", ", micro_batches = 8, recompute = true, sp = true")}\
}}
"""
    return _with_emus(text, "grpo_p0", "actor.generate", "grpo_7b_8gpu.nir")


def ppo_70b(gpus: int = 1024, with_emus: bool = True) -> str:
    """The 70B PPO job on ``gpus`` H100s (a multiple of 64): actor and critic train with TP 8 x PP 4
    on every GPU, colocated; generation uses TP 8 x DP gpus/8; each inference model-stage a quarter."""
    assert gpus % 64 == 0, "the 70B job needs a multiple of 64 GPUs"
    nodes, q = gpus // 8, gpus // 4
    text = f"""\
// PPO on Llama-3-70B-class models (actor, critic, reference and reward all 70B) on
// {nodes} nodes x 8 H100-80GB = {gpus} GPUs.
cluster @h100x{gpus} {{
  nodes = {nodes}
  gpus_per_node = 8
{H100}
}}

model @actor {{ {LLAMA3_70B}, trained = true }}
model @critic {{ {LLAMA3_70B}, head = value, trained = true }}
model @ref {{ {LLAMA3_70B} }}
model @reward {{ {LLAMA3_70B}, head = value }}

workload @ppo70b {{
  algorithm = ppo
  roles = [@actor, @critic, @ref, @reward]
  global_batch = {gpus * 2}
  prompt_len_mean = 1024
  prompt_len_max = 2048
  response_len_mean = 2048
  response_len_max = 8192
  mini_batch = {gpus // 2}
  micro_batch = 1
  steps = 1000
  stage generate {{ kind = generate, models = [@actor] }}
  stage infer {{ kind = infer, models = [@actor, @critic, @ref, @reward] }}
  stage train {{ kind = train, models = [@actor, @critic] }}
}}

plan @ppo70b_p0 {{
  workload = @ppo70b
  cluster = @h100x{gpus}
  colocate = [[actor.train, critic.train]]
{_layout_line("actor.generate", 8, 1, gpus // 8, 80, f"0..{gpus - 1}")}\
{_layout_line("actor.infer", 8, 1, q // 8, 80, f"0..{q - 1}")}\
{_layout_line("critic.infer", 8, 1, q // 8, 80, f"{q}..{2 * q - 1}")}\
{_layout_line("ref.infer", 8, 1, q // 8, 80, f"{2 * q}..{3 * q - 1}")}\
{_layout_line("reward.infer", 8, 1, q // 8, 80, f"{3 * q}..{gpus - 1}")}\
{_layout_line("actor.train", 8, 4, gpus // 32, 80, f"0..{gpus - 1}", TRAIN_70B)}\
{_layout_line("critic.train", 8, 4, gpus // 32, 80, f"0..{gpus - 1}", TRAIN_70B)}\
}}
"""
    if not with_emus:
        return print_ir(parse(text))
    return _with_emus(text, "ppo70b_p0", "actor.train", f"ppo_70b_{gpus}gpu.nir")


def grpo_moe(gpus: int = 1024) -> str:
    """GRPO on Qwen3-235B-A22B (128 experts, top 8) on ``gpus`` H100s (a multiple of 64), at DAPO's
    scale of a step (512 prompts x 16 responses). The actor trains as NeMo-RL's Qwen3-235B recipe
    lays it out (TP 4 x PP 8 with EP 16 carved from its data parallelism: each expert split over
    the TP ranks); it generates with vLLM engines of TP 8 x PP 2 with expert parallelism over each
    stage's TP ranks (whole experts: ETP 1); the actor's and the reference's inference passes
    share the GPUs, TP 4 x PP 8, the reference offloaded between steps."""
    assert gpus % 64 == 0, "the MoE job needs a multiple of 64 GPUs"
    nodes = gpus // 8
    # 94 layers over 8 stages: 12 on the first six, 11 on the last two (the head's stage)
    eight = "0..11, 12..23, 24..35, 36..47, 48..59, 60..71, 72..82, 83..93"
    train = "micro_batches = 16, zero = 1, recompute = true"

    def layout(ms: str, attrs: str) -> str:
        return f"  layout {ms} {{ {attrs}, mesh = [0..{gpus - 1}] }}"

    text = f"""\
// GRPO on Qwen3-235B-A22B (a mixture of 128 experts, 8 per token) on {nodes} nodes x 8
// H100-80GB = {gpus} GPUs: a frozen reference model beside the trained actor.
cluster @h100x{gpus} {{
  nodes = {nodes}
  gpus_per_node = 8
{H100}
}}

model @actor {{ {QWEN3_235B_A22B}, trained = true }}
model @ref {{ {QWEN3_235B_A22B} }}

workload @grpo_moe {{
  algorithm = grpo
  roles = [@actor, @ref]
  global_batch = 512
  group_size = 16
  prompt_len_mean = 1024
  prompt_len_max = 2048
  response_len_mean = 2048
  response_len_max = 8192
  mini_batch = 2048
  micro_batch = 1
  steps = 1000
  stage generate {{ kind = generate, models = [@actor] }}
  stage infer {{ kind = infer, models = [@actor, @ref] }}
  stage train {{ kind = train, models = [@actor] }}
}}

plan @grpo_moe_p0 {{
  workload = @grpo_moe
  cluster = @h100x{gpus}
  colocate = [[actor.infer, ref.infer]]
{layout("actor.generate", f"tp = 8, pp = 2, dp = {gpus // 16}, ep = 8, etp = 1, layers = [0..46, 47..93]")}
{layout("actor.infer", f"tp = 4, pp = 8, dp = {gpus // 32}, layers = [{eight}]")}
{layout("ref.infer", f"tp = 4, pp = 8, dp = {gpus // 32}, layers = [{eight}], offload = [weights]")}
{layout("actor.train", f"tp = 4, pp = 8, dp = {gpus // 32}, ep = 16, layers = [{eight}], {train}")}
}}
"""
    return print_ir(parse(text, f"grpo_moe_{gpus}gpu.nir"))


EXAMPLES = {
    "ppo_8b_16gpu.nir": ppo_8b_16gpu,
    "grpo_7b_8gpu.nir": grpo_7b_8gpu,
    "ppo_70b_1024gpu.nir": ppo_70b,
    "grpo_moe_1024gpu.nir": grpo_moe,
}


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m nereus.testing.jobs",
        description="Write the reference jobs of examples/ (" + ", ".join(EXAMPLES) + ").",
    )
    p.add_argument("out", nargs="?", default="examples", help="folder to write them to (default: examples)")
    out = Path(p.parse_args(argv).out)
    out.mkdir(parents=True, exist_ok=True)
    for name, build in EXAMPLES.items():
        (out / name).write_text(build())
        print(f"wrote {out / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
