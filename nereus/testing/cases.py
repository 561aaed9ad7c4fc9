"""The resharding cases of ``nereus bench reshard``, the runtime tests and users' tests, as IR modules.

One Llama-style model on one node of ``n`` GPUs (4 or 8); each case is a pair of plans A -> B
of one model-stage, with the EMUs of both derived from the layouts:

- ``tp4-tp2x2``: TP 4 -> TP 2 x DP 2 (training state: bf16 weights, fp32 master, Adam moments);
- ``tp2x2-tp4``: and back;
- ``tp4-tp2``: TP 4 -> TP 2 on half the GPUs (a scale-in: the other half leaves);
- ``pp2-pp4``: PP 2 -> PP 4;
- ``dp4-dp2``: DP 4 -> DP 2 under ZeRO-1 (optimizer state sharded over DP), PP 1 -> 2;
- ``train-gen``: a training layout (TP 4) -> a generation layout that replicates the weights on
  every GPU (TP 1 x DP n): weights only.

``EP_CASES`` move a mixture of experts (8 experts, top 2) between expert-parallel layouts:

- ``ep4-ep2``: EP 4 -> EP 2 (expert-DP doubles: each GPU gains as many experts as it had), DP n,
  training state;
- ``ep4-tp2ep2``: training EP 4 -> a generation layout of TP 2 engines with EP 2 over their ranks
  (vLLM's expert parallelism: every expert whole), weights only.

``hidden`` sizes the model; the defaults hold about 440 MB of distinct state in the training
cases (hidden 512: 31.6 M parameters x 14 bytes) and 330 MB of bf16 weights in ``train-gen``
(hidden 1280); tests pass a small ``hidden``.
"""

from __future__ import annotations

from ..ir import Module, parse
from ..passes import run_pipeline

CASES = ("tp4-tp2x2", "tp2x2-tp4", "tp4-tp2", "pp2-pp4", "dp4-dp2", "train-gen")
EP_CASES = ("ep4-ep2", "ep4-tp2ep2")


def _layout_block(
    kind: str,
    tp: int,
    pp: int,
    dp: int,
    layers: int,
    gpus: list[int],
    zero: int = 0,
    ep: int = 1,
    etp: int | None = None,
) -> str:
    per = layers // pp
    bounds = ", ".join(f"{i * per}..{(i + 1) * per - 1 if i < pp - 1 else layers - 1}" for i in range(pp))
    extra = f"\n    zero = {zero}" if zero else ""
    extra += f"\n    ep = {ep}" if ep > 1 else ""
    extra += f"\n    etp = {etp}" if etp is not None else ""
    return (
        f"  layout actor.{kind} {{\n    tp = {tp}\n    pp = {pp}\n    dp = {dp}\n"
        f"    layers = [{bounds}]\n    mesh = [{', '.join(map(str, gpus))}]{extra}\n  }}\n"
    )


def job_text(
    n: int, kind: str, a: tuple, b: tuple, layers: int = 8, hidden: int = 1024, vocab: int = 8192, experts: int = 0
) -> str:
    """Cluster, model, workload and plans ``a`` and ``b``, each ``(tp, pp, dp, gpus, zero)`` (and
    ``ep, etp`` after them for a mixture of ``experts``, top 2, each of FFN ``hidden``). An
    optimizer step is 12 micro-batches, which DP 1, 2, 3, 4 and 6 split evenly (the controller's
    tests lose one of four ranks and go on with three)."""
    moe = f"\n  experts = {experts}\n  experts_per_token = 2\n  expert_ffn = {hidden}" if experts else ""
    stage = (
        "stage generate { kind = generate, models = [@actor] }"
        if kind == "generate"
        else "stage train { kind = train, models = [@actor] }"
    )
    head = f"""cluster @node {{
  nodes = 1
  gpus_per_node = {n}
  gpu_memory = 80GiB
  peak_flops = 989TFLOPs
  hbm_bandwidth = 3.35TB/s
  intra_node = link(bandwidth = 450GB/s, latency = 2us)
  inter_node = link(bandwidth = 50GB/s, latency = 5us)
}}

model @actor {{
  layers = {layers}
  hidden = {hidden}
  heads = 16
  kv_heads = 4
  ffn = {hidden * 11 // 4}
  vocab = {vocab}
  trained = true{moe}
}}

workload @job {{
  algorithm = grpo
  roles = [@actor]
  global_batch = 48
  group_size = 4
  prompt_len_mean = 256
  prompt_len_max = 512
  response_len_mean = 256
  response_len_max = 512
  mini_batch = 48
  micro_batch = 4
  steps = 100
  {stage}
}}
"""
    plans = ""
    for name, (tp, pp, dp, gpus, zero, *carving) in (("a", a), ("b", b)):
        plans += (
            f"\nplan @{name} {{\n  workload = @job\n  cluster = @node\n"
            + _layout_block(kind, tp, pp, dp, layers, gpus, zero, *carving)
            + "}\n"
        )
    return head + plans


def case_module(case: str, n: int, hidden: int | None = None, layers: int = 8) -> Module:
    """The module of ``case`` on ``n`` GPUs (n divisible by 4), with the EMUs of plans @a and @b."""
    if n % 4:
        raise ValueError("reshard cases need a multiple of 4 GPUs")
    q, all_gpus = n // 4, list(range(n))
    if case == "tp4-tp2x2":
        kind, a, b = "train", (4, 1, q, all_gpus, 0), (2, 1, 2 * q, all_gpus, 0)
    elif case == "tp2x2-tp4":
        kind, a, b = "train", (2, 1, 2 * q, all_gpus, 0), (4, 1, q, all_gpus, 0)
    elif case == "tp4-tp2":
        kind, a, b = "train", (4, 1, q, all_gpus, 0), (2, 1, q, all_gpus[: n // 2], 0)
    elif case == "pp2-pp4":
        kind, a, b = "train", (1, 2, 2 * q, all_gpus, 0), (1, 4, q, all_gpus, 0)
    elif case == "dp4-dp2":
        kind, a, b = "train", (q, 1, 4, all_gpus, 1), (q, 2, 2, all_gpus, 1)
    elif case == "train-gen":
        kind, a, b = "generate", (4, 1, q, all_gpus, 0), (1, 1, n, all_gpus, 0)
    elif case == "ep4-ep2":
        kind, a, b = "train", (1, 1, n, all_gpus, 0, 4, 1), (1, 1, n, all_gpus, 0, 2, 1)
    elif case == "ep4-tp2ep2":
        kind, a, b = "generate", (1, 1, n, all_gpus, 0, 4, 1), (2, 1, n // 2, all_gpus, 0, 2, 1)
    else:
        raise ValueError(f"unknown case {case!r}; known: {', '.join(CASES + EP_CASES)}")
    experts = 8 if case in EP_CASES else 0
    hidden = hidden or (1280 if kind == "generate" else 512) // (2 if experts else 1)
    m = parse(job_text(n, kind, a, b, layers=layers, hidden=hidden, experts=experts))
    return run_pipeline(m, "derive-emus{plan=@a},derive-emus{plan=@b}")
