"""Rank functions for the Controller tests: the live state is a dict of real tensors cut from
deterministic full tensors (``synthetic_state``), so that bit-exactness is checkable anywhere."""

from __future__ import annotations

import torch

from nereus.backend.shards import plan_layout
from nereus.control import ControlOptions
from nereus.integrations.controller import Controller
from nereus.runtime.execute import Fault
from nereus.runtime.launch import init_from_env
from nereus.runtime.state import cut, full_tensor, synthetic_state
from nereus.testing.cases import case_module


class Shards:
    """A StateAdapter over a plain LocalState: what a model adapter does, without a model."""

    def __init__(self, module, plan: str, rank: int):
        self.rank = rank
        self.state = synthetic_state(plan_layout(module, plan).get(rank, []))
        self.loads = 0

    def export(self):
        return self.state

    def load(self, module, plan, state):
        want = {s.key for s in plan_layout(module, plan).get(self.rank, [])}
        assert set(state) == want, "the new state is not plan B's shards of this rank"
        self.state, self.loads = dict(state), self.loads + 1


def exact(ctl: Controller, adapter: Shards, rank: int) -> bool:
    specs = plan_layout(ctl.module, ctl.plan).get(rank, [])
    return bool(specs) and all(torch.equal(adapter.state[s.key], cut(full_tensor(s), s.box)) for s in specs)


def busy() -> None:
    """A stage that takes measurable time (StepRecords need positive stage times)."""
    torch.randn(64, 64) @ torch.randn(64, 64)


def run_loop(rank: int, world: int, scenario: str, steps: int = 3) -> dict:
    init_from_env(timeout=60)
    m = case_module("tp4-tp2x2", world, hidden=64, layers=4)
    adapter = Shards(m, "a", rank)
    quiet = dict(recalibrate_every=0, slowdown=1e9, search_time_limit=5.0, schedule_time_limit=1.0, cooldown=100)
    if scenario == "grow":  # longer responses; transitions cost only their makespan here
        options = ControlOptions(**quiet, pg_init=0.0, engine_restart=0.0, margin=0.0)
    else:
        options = ControlOptions(**quiet, response_drift=1e9)
    faults = (Fault("raise", rank=1),) if scenario == "fault" else ()
    ctl = Controller(
        m, "a", adapter, options=options, total_steps=1000, show=False, timeout=6 if faults else 30, faults=faults
    )
    actions, plans = [], []
    for step in range(steps):
        with ctl.step():
            with ctl.stage("actor.train"):
                busy()
            length = m.workloads["job"].response_len_mean * (3 if scenario == "grow" and step >= 1 else 1)
            ctl.responses([length] * 4)
            if scenario in ("leave", "fault") and step == 1 and rank == world - 1:
                ctl.leave()
        actions.append(ctl.last.action)
        plans.append(ctl.plan)
        if not ctl.active:
            break
    return {
        "actions": actions,
        "plans": plans,
        "active": ctl.active,
        "loads": adapter.loads,
        "exact": exact(ctl, adapter, rank) if ctl.active else None,
        "message": ctl.last.message,
    }
