"""Optimizer passes over the IR and the pass manager that runs pipelines of them.

``PASSES`` holds this layer's passes; ``nereus.registry.get_all_passes()`` adds the backend's.
"""

from . import (  # noqa: F401  (registers the passes)
    admit,
    calibrate,
    derive_emus,
    estimate,
    plan_search,
    plan_transition,
    remap,
    schedule_transfers,
)
from .cost_model import Candidates, CostModel
from .pass_manager import PASSES, ModulePass, PipelineError, Ref, Size, parse_pipeline, register, run_pipeline

__all__ = ["Candidates", "CostModel", "PASSES", "ModulePass", "PipelineError", "Ref", "Size", "parse_pipeline", "register",
           "run_pipeline"]
