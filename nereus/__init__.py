"""Nereus: adaptive parallelism for RL post-training, as a compiler toolkit."""

from .ir import DiagnosticError, Module, parse, parse_file, print_ir, verify
from .registry import get_all_passes, run_pipeline

__version__ = "0.1.0"

__all__ = ["DiagnosticError", "Module", "parse", "parse_file", "print_ir", "get_all_passes", "run_pipeline", "verify",
           "__version__"]
