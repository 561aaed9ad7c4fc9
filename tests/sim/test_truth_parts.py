"""The event truth's parts against independent computations: the pipeline schedule against a
tick-by-tick simulation and the known closed forms, continuous batching's event jumps against an
iteration-by-iteration loop and Graham's bounds, the kernel curves against their published
points, the collectives against their algorithms."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from nereus.sim.truth import generation as gen
from nereus.sim.truth.kernels import FA3_H100, GEMM_LEVEL, H100_PEAK, attention_efficiency, gemm_efficiency
from nereus.sim.truth.network import collective_seconds
from nereus.sim.truth.pipeline import order, play, sweep


def ticks(forward, backward, m, send, schedule, scale):
    """Integer times, one tick at a time: each idle rank starts its next operation when its
    inputs have arrived (an independent reading of the schedule's rules)."""
    p, v = len(forward), len(forward[0])
    ops = [order(schedule, p, v, m, s) for s in range(p)]
    done: dict = {}
    at, busy_until = [0] * p, [0] * p
    running: list = [None] * p
    t = 0
    while any(at[s] < len(ops[s]) for s in range(p)) or any(running):
        for s in range(p):
            if running[s] is not None and busy_until[s] == t:
                done[running[s]] = t
                running[s] = None
        for s in range(p):
            if running[s] is not None or at[s] >= len(ops[s]):
                continue
            kind, c, mb = ops[s][at[s]]
            j = c * p + s
            if kind == "F":
                need = [] if j == 0 else [("F", j - 1, mb, send * scale[mb])]
                length = forward[s][c] * scale[mb]
            else:
                need = [("F", j, mb, 0)] + ([] if j == p * v - 1 else [("B", j + 1, mb, send * scale[mb])])
                length = backward[s][c] * scale[mb]
            if all((k, jj, b) in done and done[(k, jj, b)] + d <= t for k, jj, b, d in need):
                running[s] = (kind, j, mb)
                busy_until[s] = t + length
                at[s] += 1
        t += 1
    return max(done.values())


@pytest.mark.parametrize("p, v, m", [(2, 1, 3), (4, 1, 8), (3, 1, 2), (2, 2, 4), (4, 2, 8)])
def test_the_schedule_played_equals_a_tick_by_tick_simulation_on_uneven_stages(p, v, m):
    rng = random.Random(p * 100 + v * 10 + m)
    for _ in range(5):
        fwd = [[rng.randint(1, 4) for _ in range(v)] for _ in range(p)]
        bwd = [[rng.randint(1, 6) for _ in range(v)] for _ in range(p)]
        scale = [rng.choice([1, 2]) for _ in range(m)]
        send = rng.randint(0, 2)
        schedule = "1f1b" if v == 1 else "interleaved"
        assert play(fwd, bwd, m, send, scale=scale).makespan == ticks(fwd, bwd, m, send, schedule, scale)
        assert play(fwd, None, m, send, scale=scale).makespan == ticks(fwd, None, m, send, "forward", scale)


@pytest.mark.parametrize(
    "schedule, p, v, m",
    [("1f1b", 1, 1, 3), ("1f1b", 4, 1, 8), ("1f1b", 5, 1, 2), ("interleaved", 2, 2, 4), ("interleaved", 4, 3, 8)]
    + [("forward", 3, 1, 5), ("forward", 2, 2, 4)],
)
def test_the_sweep_runs_each_rank_in_its_order_and_every_operation_after_its_inputs(schedule, p, v, m):
    """``sweep``: the one order ``play`` times the operations in. Each rank's operations appear
    once, in the schedule's order; a forward after the previous virtual stage's forward of its
    micro-batch, a backward after its own forward and the next virtual stage's backward."""
    ops = sweep(schedule, p, v, m)
    for s in range(p):
        mine = [(("F" if fwd else "B"), c, mb) for r, fwd, c, _, mb in ops if r == s]
        assert tuple(mine) == order(schedule, p, v, m, s)
    seen: set = set()
    for s, fwd, c, j, mb in ops:
        assert j == c * p + s
        if fwd:
            assert j == 0 or ("F", j - 1, mb) in seen
        else:
            assert ("F", j, mb) in seen and (j == p * v - 1 or ("B", j + 1, mb) in seen)
        seen.add(("F" if fwd else "B", j, mb))


def test_even_stages_give_the_known_bubbles_and_activations():
    one = play([[1.0]] * 4, [[2.0]] * 4, 8)
    assert one.makespan == (8 + 4 - 1) * 3.0  # 1F1B: (m + p - 1)(f + b)
    assert one.in_flight == [4, 3, 2, 1]  # stage s holds p - s micro-batches at its peak
    two = play([[0.5, 0.5]] * 4, [[1.0, 1.0]] * 4, 8)
    assert two.makespan == 8 * 3.0 + (4 - 1) * 3.0 / 2  # interleaved: the bubble over v
    assert two.in_flight[0] / 2 == pytest.approx(4 * (1 + 3 / 8))  # Korthikanti et al.: (1 + (p-1)/(p v)) times
    assert play([[1.0]] * 4, None, 8).makespan == 8 + 4 - 1  # forward only
    assert play([[0.5, 0.5]] * 4, None, 8).makespan == 8 + (4 - 1) / 2  # forward only, interleaved


def iterate(prompts, responses, engine: gen.Engine) -> float:
    """Continuous batching one iteration at a time (the event loop's brute force)."""
    capacity = engine.kv_capacity // gen.BLOCK
    waiting, prompt, left = list(range(len(prompts))), list(prompts), list(responses)
    run: list[list[int]] = []  # [id, ctx, left]
    t = 0.0

    def blocks(extra=0):
        return sum((c + extra + gen.BLOCK - 1) // gen.BLOCK for _, c, _ in run)

    while waiting or run:
        while run and blocks(1) > capacity:  # running requests' next tokens first
            i, c, r = run.pop()
            prompt[i], left[i] = c, r
            waiting.insert(0, i)
        used, new = blocks(1), []
        while waiting and len(run) + len(new) < engine.max_num_seqs:
            need = (prompt[waiting[0]] + 1 + gen.BLOCK - 1) // gen.BLOCK
            if used + need > capacity:
                break
            new.append(waiting.pop(0))
            used += need
        if new:
            tokens = sum(prompt[i] for i in new)
            t += engine.prefill_s(tokens, tokens / len(new))
            run += [[i, prompt[i], left[i]] for i in new]
        kv = sum(c for _, c, _ in run)
        t += max(engine.weights_s + engine.kv_s * kv, engine.gemm_s(len(run))) + engine.fixed_s
        for r in run:
            r[1] += 1
            r[2] -= 1
        run = [r for r in run if r[2] > 0]
    return t


@pytest.mark.parametrize("capacity, seqs", [(10**6, 256), (10**6, 5), (700, 256), (400, 3)])
def test_continuous_batching_by_events_equals_it_iteration_by_iteration(capacity, seqs):
    rng = np.random.default_rng(capacity + seqs)
    prompts = rng.integers(5, 40, 24)
    responses = rng.integers(1, 90, 24)
    engine = gen.Engine(
        kv_capacity=capacity,
        weights_s=1.0,
        kv_s=0.01,
        fixed_s=0.05,
        gemm_s=lambda n: 0.2 * n,
        prefill_s=lambda tokens, mean: 0.001 * tokens,
        max_num_seqs=seqs,
    )
    served = gen.serve(prompts, responses, engine)
    assert served.seconds == pytest.approx(iterate(prompts, responses, engine), rel=1e-9)
    if (capacity, seqs) == (700, 256):  # the cache, not max_num_seqs, limits the batch: requests are preempted
        assert served.preemptions > 0


def test_decode_iterations_lie_within_grahams_bounds():
    rng = np.random.default_rng(3)
    responses = gen.draw([100, 200, 300, 500, 700, 900, 1300, 2000], 500, rng)
    slots = 64
    engine = gen.Engine(10**9, 0.0, 0.0, 0.0, lambda n: 1.0, lambda t, m: 0.0, max_num_seqs=slots)
    served = gen.serve(np.full(500, 10), responses, engine)
    total, top = int(responses.sum()), int(responses.max())
    assert max(top, total / slots) <= served.iterations <= total / slots + top
    assert served.seconds == served.iterations  # one second an iteration


def test_kernel_curves_pass_through_their_published_points():
    assert gemm_efficiency(8192, 8192, 8192) == pytest.approx(GEMM_LEVEL)
    assert gemm_efficiency(2048, 2048, 2048) == pytest.approx(GEMM_LEVEL * 1006 / 1610)
    sizes = [64, 256, 1024, 2048, 3000, 4096, 8192, 16384]
    effs = [gemm_efficiency(s, s, s) for s in sizes]
    assert effs == sorted(effs)  # larger GEMMs run closer to the peak
    for seq, tflops in FA3_H100:
        assert attention_efficiency(seq) * H100_PEAK == pytest.approx(tflops * 1e12)


def test_collectives_follow_their_algorithms():
    gb = 1e9
    ring = collective_seconds("all_reduce", gb, 8, 100e9, 1e-5)
    assert ring == pytest.approx(2 * 7 / 8 * gb / 100e9 + 14 * 1e-5)
    small = collective_seconds("all_reduce", 1e3, 512, 100e9, 1e-5)  # a small message over many GPUs: the tree
    assert small == pytest.approx(2 * 1e3 / 100e9 + 2 * math.ceil(math.log2(512)) * 1e-5)
    assert collective_seconds("all_gather", gb, 4, 100e9, 0, share=2) == pytest.approx(2 * 3 / 4 * gb / 100e9)
    assert collective_seconds("all_reduce", gb, 1, 100e9, 1e-5) == 0.0
