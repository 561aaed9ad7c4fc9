"""The Nereus IR: typed nodes, the lark parser, the canonical printer and the verifier."""

from .attributes import Link
from .cluster import Cluster
from .diagnostics import Diagnostic, DiagnosticError, Loc, plural
from .emu import STATES, Emu, Shard, SliceEntry
from .model import Model, TensorSpec
from .module import Module, bare_name
from .parser import parse, parse_file
from .plan import Layout, Plan
from .printer import print_ir
from .transition import HostRef, Op, ShardRef, Transition
from .verifier import verify
from .workload import Stage, Workload

__all__ = [
    "Cluster",
    "Diagnostic",
    "DiagnosticError",
    "Emu",
    "HostRef",
    "Layout",
    "Link",
    "Loc",
    "Model",
    "Module",
    "Op",
    "Plan",
    "STATES",
    "Shard",
    "ShardRef",
    "SliceEntry",
    "Stage",
    "TensorSpec",
    "Transition",
    "Workload",
    "bare_name",
    "parse",
    "parse_file",
    "plural",
    "print_ir",
    "verify",
]
