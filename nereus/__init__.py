"""Nereus: adaptive parallelism for RL post-training, as a compiler toolkit."""

from .ir import DiagnosticError, Module, parse, parse_file, print_ir, verify
from .passes import run_pipeline

__version__ = "0.1.0"

__all__ = ["DiagnosticError", "Module", "parse", "parse_file", "print_ir", "run_pipeline", "verify", "__version__"]
