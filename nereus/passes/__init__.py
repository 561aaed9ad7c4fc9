"""Optimizer passes over the IR and the pass manager that runs pipelines of them.

The package is cut along its ideas (``docs/ARCHITECTURE.md``): ``infra/`` the pass manager,
``cost/`` the cost model and the passes that read it (estimate, calibrate), ``search/``
plan-search and its search space, ``transition/`` EMU derivation, remap, plan-transition and
admission, ``schedule/`` schedule-transfers. ``PASSES`` holds this layer's passes;
``nereus.registry.get_all_passes()`` adds the backend's.
"""

from .cost import calibrate, estimate  # noqa: F401  (registers the passes)
from .cost.cost_model import Candidates, CostModel
from .infra.pass_manager import PASSES, ModulePass, PipelineError, Ref, Size, parse_pipeline, register, run_pipeline
from .schedule import schedule_transfers  # noqa: F401
from .search import plan_search  # noqa: F401
from .transition import admit, derive_emus, plan_transition, remap  # noqa: F401

__all__ = [
    "Candidates",
    "CostModel",
    "PASSES",
    "ModulePass",
    "PipelineError",
    "Ref",
    "Size",
    "parse_pipeline",
    "register",
    "run_pipeline",
]
