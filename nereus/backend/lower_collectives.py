"""``lower-collectives{transition=@t}``: check that a transition lowers to a collective program.

The backend's pass, registered in the backend's ``PASSES`` (``nereus.registry`` gathers every
layer's); the lowering itself is ``lower.lower``, and ``nereus lower FILE`` prints or renders
the program.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ir import Module
from ..passes.infra.pass_manager import ModulePass, Ref, Size
from .lower import DEFAULT_BUCKET, lower, pick_transition

PASSES: dict[str, type[ModulePass]] = {}
"""The backend's passes, by name."""


@dataclass(frozen=True)
class LowerCollectives(ModulePass):
    """Checks that every destination byte of the transition is delivered exactly once and every
    piece reads and writes inside the shards of its rank. Options: ``transition`` (``@name``;
    default: the module's only transition), ``bucket`` (bytes), ``broadcast`` (auto, p2p, chain,
    collective)."""

    name = "lower-collectives"
    transition: Ref = ""
    bucket: Size = DEFAULT_BUCKET
    broadcast: str = "auto"

    def apply(self, module: Module) -> None:
        lower(module, pick_transition(module, self.transition), bucket_bytes=self.bucket, broadcast=self.broadcast)


PASSES[LowerCollectives.name] = LowerCollectives
