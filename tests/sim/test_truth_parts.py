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


def placed(schedule: str, p: int, s: int, c: int) -> int:
    """The virtual stage of rank ``s``'s chunk ``c``: a V for ZBV (rank 0 holds the first and
    the last), else looped over the ranks."""
    if schedule == "zbv":
        return s if c == 0 else 2 * p - 1 - s
    return c * p + s


def ticks(forward, backward, m, send, schedule, scale, weight=None):
    """Integer times, one tick at a time: each idle rank starts its next operation when its
    inputs have arrived (an independent reading of the schedule's rules)."""
    p, v = len(forward), len(forward[0])
    ops = [order(schedule, p, v, m, s) for s in range(p)]
    rank = {placed(schedule, p, s, c): s for s in range(p) for c in range(v)}
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
            j = placed(schedule, p, s, c)

            def hop(k):
                return send * scale[mb] if rank[k] != s else 0

            if kind == "F":
                need = [] if j == 0 else [("F", j - 1, mb, hop(j - 1))]
                length = forward[s][c] * scale[mb]
            elif kind == "W":  # the weight gradient: after its own input gradient
                need = [("B", j, mb, 0)]
                length = weight[s][c] * scale[mb]
            else:  # B, or I (the input gradient, without the weight's)
                need = [("F", j, mb, 0)] + ([] if j == p * v - 1 else [("B", j + 1, mb, hop(j + 1))])
                length = (backward[s][c] - (weight[s][c] if kind == "I" else 0)) * scale[mb]
            if all((k, jj, b) in done and done[(k, jj, b)] + d <= t for k, jj, b, d in need):
                running[s] = ("F" if kind == "F" else "W" if kind == "W" else "B", j, mb)
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
    [("gpipe", 3, 1, 4), ("zero_bubble", 2, 1, 4), ("zero_bubble", 4, 1, 3), ("zero_bubble", 4, 2, 8)]
    + [("zero_bubble", 3, 3, 5), ("zbv", 2, 2, 4), ("zbv", 3, 2, 7), ("zbv", 4, 2, 9)],
)
def test_gpipe_and_torchs_zero_bubble_schedules_played_equal_a_tick_by_tick_simulation(schedule, p, v, m):
    """torch's own action lists (``torch_schedules``), timed by ``play`` as by the ticks: the
    weight gradient apart from the input gradient, ZBV's V without a send between a rank's two
    stages."""
    rng = random.Random(hash((schedule, p, v, m)) % 1000)
    for _ in range(5):
        fwd = [[rng.randint(1, 4) for _ in range(v)] for _ in range(p)]
        bwd = [[rng.randint(2, 6) for _ in range(v)] for _ in range(p)]
        wgt = [[rng.randint(1, b - 1) for b in row] for row in bwd]  # I and W each at least a tick
        scale = [rng.choice([1, 2]) for _ in range(m)]
        send = rng.randint(0, 2)
        split = wgt if schedule != "gpipe" else None
        played = play(fwd, bwd, m, send, schedule=schedule, scale=scale, weight=split)
        assert played.makespan == ticks(fwd, bwd, m, send, schedule, scale, split)


@pytest.mark.parametrize(
    "schedule, p, v, m",
    [("1f1b", 1, 1, 3), ("1f1b", 4, 1, 8), ("1f1b", 5, 1, 2), ("interleaved", 2, 2, 4), ("interleaved", 4, 3, 8)]
    + [("forward", 3, 1, 5), ("forward", 2, 2, 4), ("gpipe", 3, 1, 4)]
    + [("zero_bubble", 4, 1, 6), ("zero_bubble", 4, 2, 8), ("zbv", 4, 2, 7)],
)
def test_the_sweep_runs_each_rank_in_its_order_and_every_operation_after_its_inputs(schedule, p, v, m):
    """``sweep``: the one order ``play`` times the operations in. Each rank's operations appear
    once, in the schedule's order; a forward after the previous virtual stage's forward of its
    micro-batch, a backward (or input gradient) after its own forward and the next virtual
    stage's backward, a weight gradient after its own input gradient. Every micro-batch passes
    every virtual stage forward and back once."""
    ops = sweep(schedule, p, v, m)
    for s in range(p):
        mine = [(kind, c, mb) for r, kind, c, _, mb in ops if r == s]
        assert tuple(mine) == order(schedule, p, v, m, s)
    seen: set = set()
    for s, kind, c, j, mb in ops:
        assert j == placed(schedule, p, s, c)
        if kind == "F":
            assert j == 0 or ("F", j - 1, mb) in seen
        elif kind == "W":
            assert ("I", j, mb) in seen
        else:
            assert ("F", j, mb) in seen and (j == p * v - 1 or {("B", j + 1, mb), ("I", j + 1, mb)} & seen)
        seen.add((kind, j, mb))
    forwards = {(j, mb) for k, j, mb in seen if k == "F"}
    assert forwards == {(j, mb) for j in range(p * v) for mb in range(m)}
    if schedule != "forward":
        assert {(j, mb) for k, j, mb in seen if k in "BI"} == forwards
        assert {(j, mb) for k, j, mb in seen if k == "W"} == ({(j, mb) for k, j, mb in seen if k == "I"})


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
