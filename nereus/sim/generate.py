"""Seeded trace generators, and the three traces shipped in ``nereus/sim/traces/``.

``python -m nereus.sim.generate`` rewrites the shipped traces (they are deterministic in their
seed). What each is built from, and what is assumed where no source gives a figure:

- **Response lengths** (``length_growth``): the mean grows linearly from 1,500 to 10,000
  tokens over the run, as DeepSeek-R1-Zero's average response length does over its RL training
  (DeepSeek-AI, arXiv:2501.12948, Fig. 3: from about 1.5k to about 10k tokens); the cap rises
  8k -> 16k -> 24k tokens at 40% and 70% of the run, as DeepScaleR raises its context
  (Luo et al. 2025, "DeepScaleR": 8k, then 16k, then 24k); DAPO's 20,480-token cap with 512
  prompts x 16 samples (Yu et al., arXiv:2503.14476) is the scale of a step. Within a step the
  lengths are log-normal (sigma 0.7: a long tail, the shape reported for reasoning RL
  rollouts), clipped at the cap, summarised as the means of 8 equal shares. Assumed: the shape
  and sigma, and that the distribution is updated every 10 steps (a smooth curve, sampled).
- **GPU availability** (``availability``): unplanned failures at the rate Meta reports for
  Llama 3 405B pre-training, 419 unexpected interruptions on 16,384 GPUs in 54 days (Llama
  Team, arXiv:2407.21783, section 3.3.4), i.e. 1.97e-5 per GPU-hour; a failure takes its node
  (8 GPUs) away without notice. Assumed: 120 s per step to turn the rate per hour into a rate
  per step (at that rate a 1,000-step run on 1,024 GPUs sees about 0.6 failures), repair after
  60 steps; the job starts on half the cluster and is granted the rest 8 nodes at a time in the
  first 40% of the run ("reaching 1,024 GPUs"); a shared cluster preempts 2 nodes with one
  step's notice about every 150 steps and returns them 50-150 steps later (no source gives a
  preemption rate for RL jobs: this is an assumption, and it is what makes the layout move).
- **combined**: both together.
- **moe_combined**: combined's lengths and GPUs, run by GRPO on Qwen3-235B-A22B
  (``nereus.testing.jobs.grpo_moe``) instead of PPO on four 70B models.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np

from .trace import Trace, TraceStep, write_trace

TRACES = Path(__file__).parent / "traces"
SHARES = 8
LLAMA3_FAILURES_PER_GPU_HOUR = 419 / (16384 * 54 * 24)
SOURCES_LENGTH = [
    "DeepSeek-AI, DeepSeek-R1 (arXiv:2501.12948), Fig. 3: R1-Zero's average response length grows from about 1.5k to "
    "about 10k tokens over RL training",
    "Luo et al., DeepScaleR (2025 blog and report): the context limit raised 8k -> 16k -> 24k tokens during RL",
    "Yu et al., DAPO (arXiv:2503.14476): responses capped at 20,480 tokens, 512 prompts x 16 samples per step",
]
SOURCES_GPUS = [
    "Llama Team, The Llama 3 Herd of Models (arXiv:2407.21783), sec. 3.3.4: 419 unexpected interruptions on 16,384 "
    "GPUs in 54 days",
]


def length_shares(mean: float, cap: int, sigma: float = 0.7, shares: int = SHARES, points: int = 64) -> tuple[int, ...]:
    """The means of ``shares`` equal shares of a log-normal length distribution with the given
    mean, clipped at ``cap`` (the median found so that the clipped mean is ``mean``)."""
    from statistics import NormalDist

    z = np.array([NormalDist().inv_cdf((k + 0.5) / (shares * points)) for k in range(shares * points)])
    mean = min(mean, 0.9 * cap)
    median = mean / math.exp(sigma**2 / 2)
    for _ in range(50):  # the clipped mean falls short of the target: raise the median
        x = np.minimum(median * np.exp(sigma * z), cap)
        got = float(x.mean())
        if abs(got - mean) < 0.5:
            break
        median *= mean / got
    return tuple(int(round(v)) for v in np.sort(x).reshape(shares, points).mean(axis=1))


def length_schedule(
    steps: int, start: float = 1500, end: float = 10000, caps=(8192, 16384, 24576), every: int = 10
) -> list[tuple[int, ...]]:
    """Per step, the shares of the response lengths (updated every ``every`` steps)."""
    out = []
    for i in range(steps):
        at = i // every * every
        frac = at / max(1, steps - 1)
        cap = caps[0] if frac < 0.4 else caps[1] if frac < 0.7 else caps[2]
        out.append(length_shares(start + (end - start) * frac, cap))
    return out


def availability_schedule(
    steps: int,
    gpus: int = 1024,
    per_node: int = 8,
    start: int | None = None,
    seed: int = 0,
    step_seconds: float = 120.0,
    repair_steps: int = 60,
    preempt_every: int = 150,
    ramp: float = 0.4,
    grant: int = 8,
) -> list[tuple[frozenset[int], frozenset[int]]]:
    """Per step, (GPUs unavailable, GPUs leaving after this step)."""
    rng = random.Random(seed)
    nodes = gpus // per_node
    start_nodes = (start if start is not None else gpus // 2) // per_node
    granted_at = {n: 0 for n in range(start_nodes)}
    later = list(range(start_nodes, nodes))
    for k in range(0, len(later), grant):  # granted a batch of ``grant`` nodes at a time over the ramp
        at = rng.randint(1, max(1, int(ramp * steps)))
        for n in later[k : k + grant]:
            granted_at[n] = at
    down_until: dict[int, int] = {}
    preempt: dict[int, tuple[int, int]] = {}  # node -> (leaves after step, back at step)
    p_fail = LLAMA3_FAILURES_PER_GPU_HOUR * step_seconds / 3600
    out = []
    for i in range(steps):
        up = [
            n
            for n in range(nodes)
            if granted_at[n] <= i
            and down_until.get(n, -1) <= i
            and not (n in preempt and preempt[n][0] < i < preempt[n][1])
        ]
        for n in up:  # failures without notice
            if rng.random() < 1 - (1 - p_fail) ** per_node:
                down_until[n] = i + repair_steps
        if preempt_every and i > 0 and rng.random() < 1 / preempt_every:
            busy = [n for n in up if n not in preempt and down_until.get(n, -1) <= i]
            for n in rng.sample(busy, min(2, len(busy))):
                preempt[n] = (i, i + 1 + rng.randint(50, 150))
        down, leaving = set(), set()
        for n in range(nodes):
            ids = range(n * per_node, (n + 1) * per_node)
            gone = (
                granted_at[n] > i or down_until.get(n, -1) > i or (n in preempt and preempt[n][0] < i < preempt[n][1])
            )
            if gone:
                down.update(ids)
            elif n in preempt and preempt[n][0] == i:
                leaving.update(ids)
        out.append((frozenset(down), frozenset(leaving)))
    return out


def make_trace(
    name: str,
    steps: int = 1000,
    gpus: int = 1024,
    seed: int = 0,
    lengths: bool = True,
    churn: bool = True,
    job: str = "ppo_70b_1024gpu",
    constant_mean: float = 2000,
) -> Trace:
    dists = length_schedule(steps) if lengths else [length_shares(constant_mean, 8192)] * steps
    avail = availability_schedule(steps, gpus, seed=seed) if churn else [(frozenset(), frozenset())] * steps
    sources = (SOURCES_LENGTH if lengths else []) + (SOURCES_GPUS if churn else [])
    what = {
        (True, True): "response-length growth and GPU churn together",
        (True, False): "response-length growth on a fixed cluster",
        (False, True): "GPU churn (failures, preemptions, a ramp to all GPUs) at a constant length distribution",
    }
    return Trace(
        name=name,
        job=job,
        gpus=gpus,
        seed=seed,
        description=f"{what[(lengths, churn)]}, {steps} steps; see nereus/sim/generate.py for the assumptions",
        sources=sources,
        steps=[TraceStep(i, dists[i], avail[i][0], avail[i][1]) for i in range(steps)],
    )


SHIPPED = {
    "length_growth": dict(lengths=True, churn=False),
    "availability": dict(lengths=False, churn=True),
    "combined": dict(lengths=True, churn=True),
    "moe_combined": dict(lengths=True, churn=True, job="grpo_moe_1024gpu"),
}


def main() -> None:
    TRACES.mkdir(exist_ok=True)
    for name, kw in SHIPPED.items():
        write_trace(make_trace(name, **kw), TRACES / f"{name}.jsonl")


if __name__ == "__main__":
    main()
