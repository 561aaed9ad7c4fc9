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
- ``gpipe`` (v = 1): every forward, then every backward (GPipe; torch's ``ScheduleGPipe``).
- ``zero_bubble`` and ``zbv``: torch's zero-bubble schedules (``torch_schedules``), whose
  backward is two operations: ``I``, the input gradient the previous stage waits for, and
  ``W``, the weight gradient no one waits for. ``zbv`` places chunk 1 of rank ``s`` at virtual
  stage ``2 p - 1 - s`` (a V): a hop between chunks of one rank sends nothing.

A micro-batch's activations are held from its forward until its backward (``B``) or its weight
gradient (``W``) ends.

``play`` returns the makespan, each rank's busy seconds, and the most micro-batches each rank
held at once (forwards done whose backward has not finished): its activations as they peak.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from .torch_schedules import TORCH_CLASSES, actions, stage_of


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
    """Rank ``s``'s operations in order: ("F" | "B" | "I" | "W", chunk, micro-batch)."""
    if schedule in TORCH_CLASSES:
        return list(actions(schedule, p, v, m)[s])
    if schedule == "gpipe" and v == 1:
        return [("F", 0, mb) for mb in range(m)] + [("B", 0, mb) for mb in range(m)]
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
def sweep(schedule: str, p: int, v: int, m: int) -> tuple[tuple[int, str, int, int, int], ...]:
    """Every rank's operations in one order in which each comes after its inputs: (rank, kind,
    chunk, virtual stage, micro-batch), as sweeps over the ranks meet them, each rank running
    its operations in order until one's input is missing. Which inputs exist does not depend on
    the times, so ``play`` times the operations in this order in one pass (the same for every
    step of a trace). A forward needs the previous virtual stage's forward; a backward (``B`` or
    ``I``) its own forward and the next virtual stage's backward; ``W`` its own ``I``. Raises
    RuntimeError where the schedule deadlocks."""
    ops = [order(schedule, p, v, m, s) for s in range(p)]
    last = p * v - 1
    f_done = [[False] * m for _ in range(p * v)]
    b_done = [[False] * m for _ in range(p * v)]  # B or I: the input gradient sent back
    at = [0] * p
    out: list[tuple[int, str, int, int, int]] = []
    remaining = sum(len(o) for o in ops)
    while remaining:
        progressed = False
        for s in range(p):
            mine, i = ops[s], at[s]
            while i < len(mine):
                kind, c, mb = mine[i]
                j = stage_of(schedule, p, s, c)
                if kind == "F":
                    if j and not f_done[j - 1][mb]:
                        break
                    f_done[j][mb] = True
                elif kind == "W":
                    if not b_done[j][mb]:
                        break
                else:
                    if not f_done[j][mb] or (j != last and not b_done[j + 1][mb]):
                        break
                    b_done[j][mb] = True
                out.append((s, kind, c, j, mb))
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
    weight: list[list[float]] | None = None,
    blocking: bool = False,
) -> Played:
    """``forward[s][c]`` (and ``backward[s][c]``): seconds of chunk ``c`` of rank ``s`` on one
    micro-batch; ``m`` micro-batches; ``send``: seconds of a transfer between ranks.
    ``schedule``: ``1f1b`` or ``interleaved`` (by ``v``) with a backward, ``forward`` without,
    or one named (``gpipe``, ``zero_bubble``, ``zbv``). ``weight[s][c]``: the part of
    ``backward[s][c]`` that is the weight gradient (``W``; the rest is ``I``), for the
    zero-bubble schedules. ``scale[mb]``: micro-batch ``mb``'s size against the one the times
    are for (its tokens: the computation and the send scale with them). ``blocking``: a rank waits
    for each of its sends to another rank to complete before its next operation (Megatron's 1F1B,
    whose send and receive pairs are waited on); otherwise it posts the send and computes on
    (``Layout.pp_overlap``), and only the receiver waits for the data."""
    p, v = len(forward), len(forward[0])
    if schedule is None:
        schedule = "forward" if backward is None else ("1f1b" if v == 1 else "interleaved")
    if schedule in TORCH_CLASSES and weight is None:
        raise ValueError(f"{schedule} splits the backward: give the weight gradient's seconds")
    size = [1.0] * m if scale is None else list(scale)
    last = p * v - 1
    f_done = [[0.0] * m for _ in range(p * v)]  # when virtual stage j's forward of micro-batch mb ended
    b_done = [[0.0] * m for _ in range(p * v)]  # ... its backward (B or I)
    free = [0.0] * p
    busy = [0.0] * p
    held, peak = [0] * p, [0] * p
    home = [0] * (p * v)  # the rank of each virtual stage: a hop between two stages of one rank is free
    for s in range(p):
        for c in range(v):
            home[stage_of(schedule, p, s, c)] = s
    for s, kind, c, j, mb in sweep(schedule, p, v, m):
        t = free[s]
        if kind == "F":
            ready = f_done[j - 1][mb] + (send * size[mb] if home[j - 1] != s else 0.0) if j else 0.0
            seconds = forward[s][c] * size[mb]
            t = (t if t > ready else ready) + seconds
            f_done[j][mb] = t
            if blocking and j < last and home[j + 1] != s:
                t += send * size[mb]
            if backward is not None:
                held[s] += 1
                if held[s] > peak[s]:
                    peak[s] = held[s]
        elif kind == "W":
            assert weight is not None
            seconds = weight[s][c] * size[mb]
            t = (t if t > b_done[j][mb] else b_done[j][mb]) + seconds
            held[s] -= 1
        else:
            own = f_done[j][mb]
            if j == last:
                ready = own
            else:
                ready = b_done[j + 1][mb] + (send * size[mb] if home[j + 1] != s else 0.0)
                ready = own if own > ready else ready
            assert backward is not None
            seconds = (backward[s][c] - (weight[s][c] if kind == "I" and weight is not None else 0.0)) * size[mb]
            t = (t if t > ready else ready) + seconds
            b_done[j][mb] = t
            if blocking and j > 0 and home[j - 1] != s:
                t += send * size[mb]
            if kind == "B":
                held[s] -= 1
        busy[s] += seconds
        free[s] = t
    if backward is None:
        peak = [1] * p
    return Played(max(free), busy, peak)
