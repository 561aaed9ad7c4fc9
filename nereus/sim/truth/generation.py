"""Generation as continuous batching, request by request, for the event truth.

One engine replica (vLLM's scheduler, simplified) serves its share of the step's requests:

- **Admission**: each iteration first gives every running request the block for its next token,
  then waiting requests start first come, first served, while the blocks left hold their prompt
  and fewer than ``max_num_seqs`` run (vLLM V1's order: running requests first). A started
  request's prompt is prefilled in the iteration it joins (chunks of at most
  ``max_num_batched_tokens``).
- **Decode**: every iteration adds one token to every running request. Its time is the slower
  of its GEMMs at the batch's tokens (``kernels.gemm_seconds``: small batches are memory-bound)
  and its reads from HBM (the GPU's weights once, of a mixture of experts only the experts the
  batch touches, and the KV cache of every running request),
  plus the per-layer launches and TP all-reduces.
- **Preemption**: when a running request needs a new KV block and none is free, the request that
  started last is preempted (vLLM's recompute mode): its blocks are freed and it waits again at
  the head of the queue, its prompt now prompt plus what it generated.
- A request ends after its response's tokens and frees its blocks.

The loop jumps from event to event (a request ending, a block boundary that no longer fits):
between two events the batch is the same, so the iterations' times are summed in closed form.
The number of events grows with the requests, not with their tokens.

Assumptions, stated: blocks of 16 tokens; ``max_num_seqs`` 256 (vLLM's default); no prefix
sharing between a prompt's samples; lengths drawn from the step's distribution (``draw``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

BLOCK = 16
MAX_NUM_SEQS = 256
MAX_BATCHED_TOKENS = 8192


def draw(dist: tuple[int, ...] | list[int], n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` response lengths from a step's distribution: its equal shares' lengths read as
    quantiles, linearly interpolated between them (at least 1 token)."""
    d = np.sort(np.asarray(dist, dtype=float))
    u = rng.random(n) * len(d) - 0.5
    return np.maximum(np.rint(np.interp(u, np.arange(len(d)), d)), 1).astype(np.int64)


@dataclass
class Engine:
    """One replica's costs: ``decode(n, kv_tokens)`` is built from these (see ``iteration``)."""

    kv_capacity: int  # tokens of KV cache the replica holds (its free memory / KV bytes per token)
    weights_s: float  # seconds to read the replica's weights on one GPU from HBM
    kv_s: float  # seconds to read one token's KV (every layer on one GPU)
    fixed_s: float  # per iteration: kernel launches and TP all-reduce latencies
    gemm_s: object  # tokens -> seconds of one iteration's GEMMs and their all-reduce bytes at that batch
    prefill_s: object  # (tokens, mean prompt) -> seconds to prefill that many prompt tokens
    max_num_seqs: int = MAX_NUM_SEQS
    context_factor: object = None  # mean context -> decode slowdown (a misspecified truth's); None: 1
    experts_s: object = None  # tokens -> seconds to read the experts a batch touches (a mixture of experts)


@dataclass
class Served:
    seconds: float
    iterations: int
    preemptions: int
    peak_running: int


def _blocks(ctx: np.ndarray) -> int:
    return int(np.sum((ctx + BLOCK - 1) // BLOCK))


def _sum_max(a: float, b: float, c: float, k: int) -> float:
    """sum_{j=0}^{k-1} max(a + b j, c)."""
    if k <= 0:
        return 0.0
    if b <= 0:
        return k * max(a, c)
    # j < j0: c dominates
    j0 = min(k, max(0, math.ceil((c - a) / b))) if c > a else 0
    tail = k - j0
    return j0 * c + tail * a + b * (j0 + k - 1) * tail / 2


def serve(prompts: np.ndarray, responses: np.ndarray, engine: Engine) -> Served:
    """Seconds until the last of the requests (``prompts[i]`` then ``responses[i]`` tokens) ends."""
    capacity = engine.kv_capacity // BLOCK
    waiting = list(range(len(prompts)))
    prompt = prompts.astype(np.int64).copy()
    left = responses.astype(np.int64).copy()
    run_ids: list[int] = []
    ctx = np.zeros(0, dtype=np.int64)
    rem = np.zeros(0, dtype=np.int64)
    t, iterations, preempted, peak = 0.0, 0, 0, 0
    while waiting or run_ids:
        # the running requests' next tokens first: where their blocks do not fit, the request that
        # started last is preempted (recompute: it waits again, its prompt what it has so far)
        while run_ids and _blocks(ctx + 1) > capacity:
            i = run_ids.pop()
            prompt[i], left[i] = int(ctx[-1]), int(rem[-1])
            ctx, rem = ctx[:-1], rem[:-1]
            waiting.insert(0, i)
            preempted += 1
        # then admission, with the blocks left
        used = _blocks(ctx + 1)
        new: list[int] = []
        while waiting and len(run_ids) + len(new) < engine.max_num_seqs:
            i = waiting[0]
            need = (prompt[i] + 1 + BLOCK - 1) // BLOCK
            if used + need > capacity:
                break
            waiting.pop(0)
            new.append(i)
            used += need
        if not run_ids and not new:
            raise MemoryError(f"a request of {int(prompt[waiting[0]])} prompt tokens does not fit the KV cache")
        if new:
            tokens = int(np.sum(prompt[new]))
            t += engine.prefill_s(tokens, tokens / len(new))  # type: ignore[operator]
            run_ids += new
            ctx = np.concatenate([ctx, prompt[new]])
            rem = np.concatenate([rem, left[new]])
        peak = max(peak, len(run_ids))
        n = len(run_ids)
        # the iterations until the next event: a request ends, or the next block does not fit (k >= 1:
        # every running request's next token fits, by the two steps above)
        k = int(rem.min())
        if _blocks(ctx + k) > capacity:  # the largest k whose blocks fit
            lo, hi = 1, k
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if _blocks(ctx + mid) <= capacity:
                    lo = mid
                else:
                    hi = mid - 1
            k = lo
        kv = float(np.sum(ctx))
        weights = engine.weights_s + (engine.experts_s(n) if engine.experts_s is not None else 0.0)  # type: ignore[operator]
        decode = _sum_max(weights + engine.kv_s * kv, engine.kv_s * n, engine.gemm_s(n), k)  # type: ignore[operator]
        if engine.context_factor is not None:  # at the segment's mean context, midway
            decode *= engine.context_factor((kv + n * (k - 1) / 2) / n)  # type: ignore[operator]
        t += decode
        t += k * engine.fixed_s
        iterations += k
        ctx += k
        rem -= k
        done = rem == 0
        if done.any():
            run_ids = [i for i, d in zip(run_ids, done) if not d]
            ctx, rem = ctx[~done], rem[~done]
    return Served(t, iterations, preempted, peak)
