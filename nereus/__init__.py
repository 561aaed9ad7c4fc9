"""Nereus: adaptive parallelism for RL post-training, as a compiler toolkit."""

from .ir import DiagnosticError, Module, parse, parse_file, print_ir, verify
from .registry import get_all_passes, run_pipeline

__version__ = "0.1.0"


def reshard(state, model, src, dst, **kwargs):
    """Move one model's sharded state between two layouts on every rank of the default process
    group (``nereus.integrations.move_state``): ``reshard(state, {"layers": 32, ...}, {"tp": 4},
    {"tp": 2, "dp": 2})`` returns this rank's shards under the second layout."""
    from .integrations.move_state import reshard as _reshard

    return _reshard(state, model, src, dst, **kwargs)


def reshard_shards(model, layout, rank, world=None):
    """What ``rank`` holds under ``layout``: tensor name -> ``ShardSpec`` (box in the full tensor, dtype)."""
    from .integrations.move_state import reshard_shards as _shards

    return _shards(model, layout, rank, world)

__all__ = ["DiagnosticError", "Module", "parse", "parse_file", "print_ir", "get_all_passes", "reshard", "reshard_shards",
           "run_pipeline", "verify", "__version__"]
