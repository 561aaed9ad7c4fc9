"""Generation under long-tailed response lengths: ``decode_iterations`` against a simulation of
continuous batching written here (first come first served into the free KV-cache slots, random
order), and the IR's response-length distribution through ``estimate``."""

import heapq

import numpy as np
import pytest

import nereus
from nereus.ir import DiagnosticError
from nereus.passes.cost.cost_model import decode_iterations

from ..support import ROOT


def simulate(lengths, samples, slots, seed) -> float:
    rng = np.random.default_rng(seed)
    order = rng.permutation(np.resize(np.array(lengths, dtype=float), samples))
    free = [0.0] * min(slots, samples)
    for length in order:
        heapq.heappush(free, heapq.heappop(free) + length)
    return max(free)


DISTS = [
    [256, 512, 1024, 4096],
    [100, 200, 300, 400, 500, 600, 700, 8000],
    [1000] * 8,
    [50, 60, 70, 2000],
    [300, 400, 500, 600],
]


@pytest.mark.parametrize("lengths", DISTS, ids=lambda d: f"{d[0]}-{d[-1]}x{len(d)}")
@pytest.mark.parametrize("samples,slots", [(512, 64), (512, 500), (512, 1000), (2048, 100), (100, 7), (1024, 256)])
def test_decode_iterations_match_a_continuous_batching_simulation(lengths, samples, slots):
    model, draining = decode_iterations(np.array(lengths), samples, slots)
    sim = np.mean([simulate(lengths, samples, slots, seed) for seed in range(10)])
    assert float(model) == pytest.approx(sim, rel=0.10)
    assert 0 <= float(draining) <= float(model)


def _grpo(dist: str, mean: int) -> str:
    text = (ROOT / "examples" / "grpo_7b_8gpu.nir").read_text()
    text = "".join(line for line in text.splitlines(keepends=True) if "response_len_dist" not in line)
    return text.replace("  response_len_mean = 1536\n", f"  response_len_mean = {mean}\n  response_len_dist = {dist}\n")


def test_a_long_tail_slows_generation_and_shows_as_its_tail():
    """Same mean response length (1,536), one long-tailed: generation takes longer, and the
    breakdown says where (the tail: decode while the batch drains)."""

    def gen(text):
        m = nereus.run_pipeline(nereus.parse(text), "estimate")
        return next(lay for name, lay in m.plans["grpo_p0"].layouts.items() if name.endswith("generate"))

    flat, tailed = gen(_grpo("[1536]", 1536)), gen(_grpo("[512, 768, 1024, 1280, 1536, 1792, 2048, 3328]", 1536))
    assert tailed.time > flat.time
    assert tailed.time_breakdown.tail > flat.time_breakdown.tail
    assert tailed.time_breakdown.prefill == flat.time_breakdown.prefill > 0


@pytest.mark.parametrize(
    "dist,mean,message",
    [
        ("[512, 256, 1024]", 597, "response_len_dist is not a distribution"),
        ("[512, 1024, 8192]", 3243, "response_len_dist reaches 8192, beyond response_len_max = 4096"),
        ("[512, 1024, 2048]", 1536, "response_len_dist has mean 1194.67, but response_len_mean = 1536"),
    ],
)
def test_a_distribution_that_is_not_one_is_a_diagnostic_at_its_line(dist, mean, message):
    text = _grpo(dist, mean)
    with pytest.raises(DiagnosticError) as e:
        nereus.verify(nereus.parse(text))
    d = next(d for d in e.value.diagnostics if "response_len" in d.message)
    assert message in d.message
    assert "response_len_dist" in text.splitlines()[d.loc.line - 1]
