"""``lower-collectives{transition=@t}``: check that a transition lowers to a collective program.

The lowering itself lives in ``nereus.backend.lower`` (it needs torch, imported only when the
pass runs); ``nereus lower FILE`` prints or renders the program.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ir import Module
from .pass_manager import ModulePass, register


@register
@dataclass(frozen=True)
class LowerCollectives(ModulePass):
    """Checks that every destination byte of the transition is delivered exactly once and every
    piece reads and writes inside the shards of its rank. Options: ``transition`` (``@name``;
    default: the module's only transition), ``bucket`` (bytes), ``broadcast`` (auto, p2p, chain,
    collective)."""

    name = "lower-collectives"
    transition: str = ""
    bucket: int = 64 * 2**20
    broadcast: str = "auto"

    def apply(self, module: Module) -> None:
        from ..backend.lower import lower, pick_transition

        lower(module, pick_transition(module, self.transition), bucket_bytes=self.bucket, broadcast=self.broadcast)
