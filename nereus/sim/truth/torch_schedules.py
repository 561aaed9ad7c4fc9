"""The zero-bubble pipeline schedules as PyTorch runs them, for the event truth.

``torch.distributed.pipelining`` (what torchtitan trains with) computes every rank's actions of
its multi-stage schedules up front, in ``_calculate_single_rank_operations``; its runtime then
runs exactly those actions. ``actions`` asks torch's own classes for them, so that the truth
plays the order torch would, not one written again here:

- ``zero_bubble``: ``ScheduleInterleavedZeroBubble`` (ZB1P of Qi et al. 2024, "Zero Bubble
  Pipeline Parallelism"; with one stage per rank, their ZB-H1): the backward split into the
  input gradient (``I``), which the previous stage waits for, and the weight gradient (``W``),
  which no one waits for and which fills the bubbles. Stages loop over the ranks (stage
  ``c p + s`` on rank ``s``), as Megatron's interleaving.
- ``zbv``: ``ScheduleZBVZeroBubble``, two stages per rank in a V (rank ``s`` holds stages ``s``
  and ``2 p - 1 - s``: the first and the last stage on rank 0).

The classes' constructors need live pipeline stages on a process group of ``p`` ranks; the
action lists depend only on the counts, so ``actions`` sets the counts the constructors would
set (``__init__`` of each, torch 2.13) and calls the method that makes them. torch is imported
only when one of them is played.
"""

from __future__ import annotations

import functools

# the schedules torch computes the actions of (its class names), imported where one is played:
# the simulator's other schedules do not load torch
TORCH_CLASSES = {"zero_bubble": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble"}


def stage_of(schedule: str, p: int, s: int, c: int) -> int:
    """The virtual stage of rank ``s``'s chunk ``c``: in a V for ``zbv``, else looped (``c p + s``)."""
    if schedule == "zbv":
        return s if c == 0 else 2 * p - 1 - s
    return c * p + s


@functools.lru_cache(maxsize=256)
def actions(schedule: str, p: int, v: int, m: int) -> tuple[tuple[tuple[str, int, int], ...], ...]:
    """Every rank's compute actions in torch's order: (``F`` | ``I`` | ``W`` | ``B``, chunk,
    micro-batch), torch's no-op slots dropped (the truth waits for inputs, not for slots; ZBV
    plans at least ``2 p - 1`` micro-batches and blanks the ones beyond ``m``)."""
    from torch.distributed.pipelining import schedules

    cls = getattr(schedules, TORCH_CLASSES[schedule])
    if schedule == "zbv" and v != 2:
        raise ValueError(f"zbv runs exactly two stages per rank, not {v}")
    sched = cls.__new__(cls)
    sched.pp_group_size, sched.n_local_stages, sched._n_microbatches = p, v, m
    sched._num_stages = sched.num_stages = p * v
    sched.number_of_rounds = max(1, m // p)
    sched.microbatches_per_round = m // sched.number_of_rounds
    if schedule == "zero_bubble" and m % sched.number_of_rounds:
        raise ValueError(f"{schedule}: {m} micro-batches is not a multiple of the {sched.number_of_rounds} rounds")
    sched.pipeline_order = {r: sched._calculate_single_rank_operations(r) for r in range(p)}
    if schedule == "zero_bubble":
        sched.pipeline_order = sched._add_bubbles_to_actions(p * v)
    chunk = {stage_of(schedule, p, s, c): c for s in range(p) for c in range(v)}
    out = []
    for r in range(p):
        mine = []
        for a in sched.pipeline_order[r]:
            if a is None:
                continue
            kind = a.computation_type.value
            if kind not in ("F", "I", "W", "B"):
                continue
            mine.append((kind, chunk[a.stage_index], a.microbatch_index))
        out.append(tuple(mine))
    return tuple(out)
