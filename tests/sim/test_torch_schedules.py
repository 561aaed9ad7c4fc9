"""The event truth's zero-bubble schedules are torch's: on ``p`` gloo processes, every rank builds
its real ``PipelineStage`` objects (loop or V placement) and torch's own schedule class over them,
and the actions torch will run are the ones ``torch_schedules.actions`` gives the truth."""

from __future__ import annotations

import pytest

from nereus.runtime.launch import run_local
from nereus.sim.truth.torch_schedules import actions, stage_of

CASES = [("zero_bubble", 3, 1, 3), ("zero_bubble", 3, 2, 6), ("zero_bubble", 3, 2, 4), ("zero_bubble", 3, 3, 9)]
CASES += [("zbv", 3, 2, 5), ("zbv", 3, 2, 8), ("zbv", 3, 2, 3), ("zbv", 3, 2, 2)]  # ZBV blanks beyond m


def worker(rank: int, world: int, cases) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, schedules

    from nereus.runtime.launch import init_from_env

    init_from_env(timeout=60, backend="gloo")
    out = {}
    for schedule, p, v, m in cases:
        assert p == world
        stages = [
            PipelineStage(torch.nn.Linear(4, 4), stage_of(schedule, p, rank, c), p * v, torch.device("cpu"))
            for c in range(v)
        ]
        cls = schedules.ScheduleZBVZeroBubble if schedule == "zbv" else schedules.ScheduleInterleavedZeroBubble
        sched = cls(stages, m, loss_fn=lambda y, t: (y - t).pow(2).mean())
        chunk = {s.stage_index: c for c, s in enumerate(stages)}
        mine = [
            (a.computation_type.value, chunk[a.stage_index], a.microbatch_index)
            for a in sched.pipeline_order[rank]
            if a is not None and a.computation_type.value in ("F", "I", "W", "B")
        ]
        out[(schedule, p, v, m)] = mine
    dist.destroy_process_group()
    return out


def test_the_truths_zero_bubble_actions_are_those_torch_builds_over_live_stages():
    results = run_local(worker, 3, CASES, timeout=120)
    for case in CASES:
        schedule, p, v, m = case
        expected = actions(schedule, p, v, m)
        for rank in range(p):
            assert tuple(results[rank][case]) == expected[rank], (case, rank)


def test_a_schedule_torch_would_not_run_is_refused():
    with pytest.raises(ValueError, match="exactly two stages"):
        actions("zbv", 3, 3, 9)
    with pytest.raises(ValueError, match="rounds"):
        actions("zero_bubble", 3, 1, 7)
