"""The adaptive decision core (docs/ARCHITECTURE.md): measurements in, decisions out.

A ``DecisionCore`` holds the job (cluster, models, workload) and the plan it runs under. The
training loop (through ``nereus.runtime``'s embedding) or the simulator feeds it one
``StepRecord`` per step; ``decide()`` recalibrates the cost model every few steps and, when a
trigger fires (GPUs joined, left or announced to leave; response lengths drifted; memory
headroom ran out; a model-stage became slower than the plan assumed), re-plans: ``plan-search``
under the conditions measured now, ``remap``, ``plan-transition``, ``schedule-transfers`` and
``admit``. The ``Decision`` says what to do and carries every number behind it.

No torch.distributed here (an import-linter contract says so): the same code runs in a live
loop and in the simulator.
"""

from .decide import Decision, DecisionCore
from .measurements import StepRecord
from .options import ControlOptions
from .triggers import Trigger

__all__ = ["ControlOptions", "Decision", "DecisionCore", "StepRecord", "Trigger"]
