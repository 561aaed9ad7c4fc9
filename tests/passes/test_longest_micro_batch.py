"""Training and inference activations are sized for the longest micro-batch a replica can see,
not the mean sequence: RL responses are long-tailed, and a micro-batch holding the longest of
them must fit (OpenRLHF #887: OOM at 32k responses on plans sized at the mean). Time stays at the
mean length. With a token budget (``micro_batch_tokens``, verl's dynamic batching) a micro-batch
holds up to the budget, or one longer sequence.
"""

import dataclasses

import pytest

from nereus.ir import DiagnosticError, parse
from nereus.passes import run_pipeline
from nereus.testing import jobs


def _workload(**kw):
    m = parse(jobs.grpo_7b_8gpu())
    w = m.workloads["grpo"]
    return m, dataclasses.replace(w, **kw) if kw else w


def test_longest_micro_batch_tokens_by_hand():
    """micro_batch 4 of 64 samples, prompts up to 1k: the longest response (16k), then three from
    the top eighth of the distribution (8 responses of 6k, one of them the longest)."""
    _, w = _workload(
        global_batch=8,
        group_size=8,
        prompt_len_mean=512,
        prompt_len_max=1024,
        response_len_max=16384,
        response_len_mean=2000,
        response_len_dist=[500, 800, 1000, 1500, 1700, 2000, 2500, 6000],
        micro_batch=4,
    )
    assert w.longest_micro_batch_tokens() == (1024 + 16384) + 3 * (1024 + 6000)
    # without a distribution every sample of the micro-batch may be the longest
    assert dataclasses.replace(w, response_len_dist=[]).longest_micro_batch_tokens() == 4 * (1024 + 16384)
    # 12 samples: the top eighth has 7 more, then the next eighth (2,500)
    big = dataclasses.replace(w, micro_batch=12)
    assert big.longest_micro_batch_tokens() == (1024 + 16384) + 7 * (1024 + 6000) + 4 * (1024 + 2500)
    # a token budget packs micro-batches up to it; a longer sequence goes alone
    assert dataclasses.replace(w, micro_batch_tokens=32768).longest_micro_batch_tokens() == 32768
    assert dataclasses.replace(w, micro_batch_tokens=4096).longest_micro_batch_tokens() == 1024 + 16384


def _job(response_len_max: int, recompute: bool = True, **workload):
    """The hand GRPO job (7B on 8 H100) with its responses' longest length set, and no distribution."""
    m = parse(jobs.grpo_7b_8gpu())
    w = m.workloads["grpo"]
    w.response_len_dist, w.response_len_max = [], response_len_max
    for k, v in workload.items():
        setattr(w, k, v)
    m.plans["grpo_p0"].layouts["actor.train"].recompute = recompute
    return m


def test_activations_scale_with_the_longest_micro_batch_and_time_with_the_mean():
    """Without a distribution the longest micro-batch is micro_batch x the longest sequence:
    doubling that sequence doubles the estimated activations (linear in tokens with flash
    attention); the time, costed at the mean, does not move."""
    short, long = _job(3072), _job(2 * (1024 + 3072) - 1024)
    for m in (short, long):
        run_pipeline(m, "estimate{oom=warn}")
    ws, wl = short.workloads["grpo"], long.workloads["grpo"]
    assert ws.longest_micro_batch_tokens() == 4 * (1024 + 3072)
    assert wl.longest_micro_batch_tokens() == 2 * ws.longest_micro_batch_tokens()
    a, b = (m.plans["grpo_p0"].layouts["actor.train"] for m in (short, long))
    assert b.memory_breakdown.activations == pytest.approx(2 * a.memory_breakdown.activations, abs=2**21)
    assert b.time == a.time


def test_a_plan_that_fit_at_the_mean_does_not_fit_the_longest_micro_batch():
    """Training without recomputation fits at 63 GiB with responses up to 4k. At 8k (the mean
    unchanged, as a long tail does) a micro-batch of the four longest needs more than the GPU's
    80 GiB, and the diagnostic names the model-stage; sized at the mean it would still "fit".
    A token budget of 8k per micro-batch (dynamic batching) makes it fit again."""
    run_pipeline(_job(4096, recompute=False), "estimate")
    with pytest.raises(DiagnosticError, match=r"actor\.train needs 82\.\d+ GiB on GPU 0, [\d,]+ bytes more"):
        run_pipeline(_job(8192, recompute=False), "estimate")
    run_pipeline(_job(8192, recompute=False, micro_batch_tokens=8192), "estimate")
