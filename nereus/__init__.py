"""Nereus: adaptive parallelism for RL post-training, as a compiler toolkit.

The public API, one line each (README, "Python API"). ``import nereus`` loads the IR and the
pass manager only; the names that need torch or the solvers are imported when first used.

- ``parse``, ``parse_file``, ``print_ir``, ``verify``, ``Module``, ``DiagnosticError``: the IR.
- ``run_pipeline``, ``get_all_passes``: passes, run through the pass manager.
- ``DecisionCore``: measurements in, decisions (stay, transition) out (``nereus.control``).
- ``Controller``: the decision core inside a live torch.distributed job (``nereus.integrations``).
- ``lower``: a transition to its collective program (``nereus.backend``).
- ``execute``: run a lowered program on this rank's live tensors (``nereus.runtime``).
- ``export_plan``: a plan as verl, Megatron-LM or vLLM settings (``nereus.export``).
- ``reshard``, ``reshard_shards``: one model's sharded state between two layouts, on every rank.
"""

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version

from .ir import DiagnosticError, Module, parse, parse_file, print_ir, verify
from .registry import get_all_passes, run_pipeline

try:
    __version__ = version("nereus")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

_LAZY = {
    "DecisionCore": "nereus.control.decide",
    "Controller": "nereus.integrations.controller",
    "lower": "nereus.backend.lower",
    "execute": "nereus.runtime.execute",
    "export_plan": "nereus.export",
    "reshard": "nereus.integrations.move_state",
    "reshard_shards": "nereus.integrations.move_state",
}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'nereus' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "Controller",
    "DecisionCore",
    "DiagnosticError",
    "Module",
    "execute",
    "export_plan",
    "get_all_passes",
    "lower",
    "parse",
    "parse_file",
    "print_ir",
    "reshard",
    "reshard_shards",
    "run_pipeline",
    "verify",
    "__version__",
]
