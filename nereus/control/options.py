"""The decision core's options: triggers, thresholds and search limits, typed and checked."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..passes.infra.pass_manager import VERIFY


@dataclass(frozen=True)
class ControlOptions:
    """Defaults a user can read (docs/embedding.md repeats them).

    - ``recalibrate_every``: refit the cost model's coefficients to the measured stage times
      every this many steps (0: never).
    - ``window``: how many recent steps the measurements are taken over.
    - ``response_drift``: re-plan when the mean response length of the window differs from the
      one the plan was made for (or a rejected re-plan last weighed) by more than this fraction.
    - ``memory_headroom``: re-plan when a model-stage's measured peak memory leaves less than
      this fraction of the GPU free (after a re-plan that kept the plan at a peak, only past half
      the way from that peak to the GPU's memory). Also what a re-plan's search keeps free once
      measured peaks have set the cost model's ``memory_slack``: a plan B that left less would
      fire this trigger at once. Before that, plan-search's own headroom (10%), which stands for
      what the cost model does not count.
    - ``slowdown``: re-plan when a model-stage's measured time exceeds the plan's estimate (after
      recalibration) by more than this fraction: it became a bottleneck the plan did not expect.
    - ``cooldown``: steps after a decision to re-plan before an optional trigger may fire again
      (GPU changes always fire).
    - ``search_time_limit`` (s) and ``seed``: plan-search's; ``schedule_time_limit`` (s).
    - ``deterministic``: both limits count CP-SAT's deterministic time, not the clock
      (``passes.infra.solver_budget``): the same job decides the same on a loaded machine. The
      simulator sets it; a live job wants the clock.
    - ``margin``, ``pg_init``, ``engine_restart``: admit's (a transition must pay back its cost
      times 1 + margin over the remaining steps).
    - ``max_pp`` (0: any), ``max_zero``, ``offload``: plan-search only proposes layouts the live
      job can take (a live model without pipeline stages: ``max_pp = 1``).
    - ``verify``: when the core's pipelines verify the job: after ``each`` pass (estimate and
      calibrate at every recalibration included), once at the ``end`` of a re-plan that planned
      a transition (the job with plans A and B and the transition, before the runtime may run
      it), or ``off``. ``end`` by default: at 1,024 GPUs a module holds a million slices and a
      transition half a million operations, one verification costs about a second, and after
      each pass it cost 52 of 63 s in 120 steps of the availability trace (``nereus simulate
      --policies nereus --steps 120``), more than planning.
    """

    recalibrate_every: int = 10
    window: int = 5
    response_drift: float = 0.25
    memory_headroom: float = 0.05
    slowdown: float = 0.25
    cooldown: int = 5
    search_time_limit: float = 5.0
    seed: int = 0
    schedule_time_limit: float = 2.0
    deterministic: bool = False
    margin: float = 0.1
    pg_init: float = 2.0
    engine_restart: float = 30.0
    max_pp: int = 0
    max_zero: int = 3
    offload: bool = True
    verify: str = "end"

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "str":
                if value not in VERIFY:
                    raise ValueError(f"ControlOptions.{f.name} is one of {', '.join(VERIFY)}, got {value!r}")
                continue
            if f.type == "bool":
                if not isinstance(value, bool):
                    raise TypeError(f"ControlOptions.{f.name} must be bool, got {type(value).__name__} {value!r}")
                continue
            want = {"int": int, "float": (int, float)}[f.type]
            if isinstance(value, bool) or not isinstance(value, want):
                raise TypeError(f"ControlOptions.{f.name} must be {f.type}, got {type(value).__name__} {value!r}")
            if value < 0:
                raise ValueError(f"ControlOptions.{f.name} must be >= 0, got {value}")
        if self.window < 1:
            raise ValueError("ControlOptions.window must be >= 1")
        if not 0 <= self.memory_headroom < 1:
            raise ValueError(f"ControlOptions.memory_headroom is a fraction of the GPU, got {self.memory_headroom}")
