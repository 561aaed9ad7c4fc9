"""Optimizer passes over the IR and the pass manager that runs pipelines of them."""

from . import derive_emus  # noqa: F401  (registers the pass)
from .pass_manager import PASSES, ModulePass, PipelineError, parse_pipeline, register, run_pipeline

__all__ = ["PASSES", "ModulePass", "PipelineError", "parse_pipeline", "register", "run_pipeline"]
