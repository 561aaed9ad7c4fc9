"""Nereus runtime layer (docs/ARCHITECTURE.md): collective programs executed on live sharded state.

``execute(program, state)`` on every rank of a process group (``init_from_env``); the state is
``{StateKey: tensor}`` as ``state.plan_layout`` describes it. Importing this package imports torch.
"""

from .execute import Fault, Stats, TransitionError, execute
from .launch import init_from_env, run_local
from .state import LocalState, ShardSpec, StateKey, plan_layout

__all__ = [
    "Fault",
    "LocalState",
    "ShardSpec",
    "StateKey",
    "Stats",
    "TransitionError",
    "execute",
    "init_from_env",
    "plan_layout",
    "run_local",
]
