"""A pipeline schedule played micro-batch by micro-batch, for the event truth.

Each rank runs its operations in the schedule's order, one at a time; an operation starts when
its rank is free and its input has arrived: a forward needs the previous virtual stage's forward
of the same micro-batch (and its send), a backward the next virtual stage's backward (and its
send) and its own forward. Stages may be uneven: every rank and chunk has its own times. Rank
``s`` holds chunks ``c = 0 .. v-1``, virtual stages ``c p + s`` (Megatron's interleaving).

- ``1f1b`` (v = 1): ``p - s - 1`` warm-up forwards, then one forward and one backward in turn,
  then the remaining backwards (PipeDream-Flush, Megatron's default).
- ``interleaved`` (v > 1): Megatron's interleaved 1F1B, whose micro-step ``k`` on a rank is
  chunk ``(k mod p v) div p`` of micro-batch ``(k div p v) p + k mod p`` (backwards take the
  chunks in reverse); ``(p - s - 1) 2 + (v - 1) p`` warm-up forwards. ``m`` must be a multiple
  of ``p``, as Megatron asks.
- ``forward`` (inference): every forward in order, no backward; interleaved as above, ``p``
  micro-batches through a chunk before the next chunk.

``play`` returns the makespan, each rank's busy seconds, and the most micro-batches each rank
held at once (forwards done whose backward has not finished): its activations as they peak.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass
class Played:
    makespan: float
    busy: list[float]  # seconds each rank computed
    in_flight: list[int]  # the most micro-batches whose activations a rank held at once (per chunk summed)


@functools.lru_cache(maxsize=4096)
def order(schedule: str, p: int, v: int, m: int, s: int) -> tuple[tuple[str, int, int], ...]:
    """Rank ``s``'s operations in order (``_order``; the same for every step of a trace)."""
    return tuple(_order(schedule, p, v, m, s))


def _order(schedule: str, p: int, v: int, m: int, s: int) -> list[tuple[str, int, int]]:
    """Rank ``s``'s operations in order: ("F" | "B", chunk, micro-batch)."""
    if schedule == "forward" and v == 1:
        return [("F", 0, mb) for mb in range(m)]
    if schedule == "forward":  # interleaved: p micro-batches through a chunk, then the next chunk
        if m % p:
            raise ValueError(f"interleaved schedule: {m} micro-batches is not a multiple of the {p} stages")
        return [("F", (k % (p * v)) // p, (k // (p * v)) * p + k % p) for k in range(m * v)]
    if schedule == "1f1b" and v == 1:
        warm = min(p - s - 1, m)
        ops = [("F", 0, mb) for mb in range(warm)]
        for i in range(m - warm):
            ops += [("F", 0, warm + i), ("B", 0, i)]
        return ops + [("B", 0, mb) for mb in range(m - warm, m)]
    if schedule == "interleaved":
        if m % p:
            raise ValueError(f"interleaved schedule: {m} micro-batches is not a multiple of the {p} stages")
        total = m * v

        def step(k: int, backward: bool) -> tuple[int, int]:
            c = (k % (p * v)) // p
            return (v - 1 - c if backward else c), (k // (p * v)) * p + k % p

        warm = min((p - s - 1) * 2 + (v - 1) * p, total)
        ops = [("F", *step(k, False)) for k in range(warm)]
        for i in range(total - warm):
            ops += [("F", *step(warm + i, False)), ("B", *step(i, True))]
        return ops + [("B", *step(k, True)) for k in range(total - warm, total)]
    raise ValueError(f"unknown schedule {schedule!r} (v = {v})")


@functools.lru_cache(maxsize=1024)
def sweep(schedule: str, p: int, v: int, m: int) -> tuple[tuple[int, bool, int, int, int], ...]:
    """Every rank's operations in one order in which each comes after its inputs: (rank, forward,
    chunk, virtual stage, micro-batch), as sweeps over the ranks meet them, each rank running
    its operations in order until one's input is missing. Which inputs exist does not depend on
    the times, so ``play`` times the operations in this order in one pass (the same for every
    step of a trace). Raises RuntimeError where the schedule deadlocks."""
    ops = [order(schedule, p, v, m, s) for s in range(p)]
    last = p * v - 1
    f_done = [[False] * m for _ in range(p * v)]
    b_done = [[False] * m for _ in range(p * v)]
    at = [0] * p
    out: list[tuple[int, bool, int, int, int]] = []
    remaining = sum(len(o) for o in ops)
    while remaining:
        progressed = False
        for s in range(p):
            mine, i = ops[s], at[s]
            while i < len(mine):
                kind, c, mb = mine[i]
                j = c * p + s  # the virtual stage
                if kind == "F":
                    if j and not f_done[j - 1][mb]:
                        break
                    f_done[j][mb] = True
                else:
                    if not f_done[j][mb] or (j != last and not b_done[j + 1][mb]):
                        break
                    b_done[j][mb] = True
                out.append((s, kind == "F", c, j, mb))
                i += 1
            if i != at[s]:
                remaining -= i - at[s]
                at[s] = i
                progressed = True
        if not progressed:
            raise RuntimeError(f"pipeline schedule {schedule} deadlocked (p={p}, v={v}, m={m})")
    return tuple(out)


def play(
    forward: list[list[float]],
    backward: list[list[float]] | None,
    m: int,
    send: float = 0.0,
    schedule: str | None = None,
    scale: list[float] | None = None,
) -> Played:
    """``forward[s][c]`` (and ``backward[s][c]``): seconds of chunk ``c`` of rank ``s`` on one
    micro-batch; ``m`` micro-batches; ``send``: seconds of a transfer between ranks.
    ``schedule``: ``1f1b`` or ``interleaved`` (by ``v``) with a backward, ``forward`` without.
    ``scale[mb]``: micro-batch ``mb``'s size against the one the times are for (its tokens: the
    computation and the send scale with them)."""
    p, v = len(forward), len(forward[0])
    if schedule is None:
        schedule = "forward" if backward is None else ("1f1b" if v == 1 else "interleaved")
    size = [1.0] * m if scale is None else list(scale)
    last = p * v - 1
    f_done = [[0.0] * m for _ in range(p * v)]  # when virtual stage j's forward of micro-batch mb ended
    b_done = [[0.0] * m for _ in range(p * v)]
    free = [0.0] * p
    busy = [0.0] * p
    held, peak = [0] * p, [0] * p
    hop = send if p > 1 else 0.0
    for s, fwd, c, j, mb in sweep(schedule, p, v, m):
        t = free[s]
        if fwd:
            ready = f_done[j - 1][mb] + hop * size[mb] if j else 0.0
            seconds = forward[s][c] * size[mb]
            t = (t if t > ready else ready) + seconds
            f_done[j][mb] = t
            if backward is not None:
                held[s] += 1
                if held[s] > peak[s]:
                    peak[s] = held[s]
        else:
            own = f_done[j][mb]
            if j == last:
                ready = own
            else:
                ready = b_done[j + 1][mb] + hop * size[mb]
                ready = own if own > ready else ready
            assert backward is not None
            seconds = backward[s][c] * size[mb]
            t = (t if t > ready else ready) + seconds
            b_done[j][mb] = t
            held[s] -= 1
        busy[s] += seconds
        free[s] = t
    if backward is None:
        peak = [1] * p
    return Played(max(free), busy, peak)
