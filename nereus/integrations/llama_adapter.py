"""``LlamaAdapter``: the Controller's adapter for a live HF Llama + AdamW (``hf_llama.LiveLlama``).

It has ``move``: on a transition the controller calls it on every rank (building plan B's model
creates process groups, a collective) and it runs ``reshard_llama``, keeping the new ``LiveLlama`` in
``adapter.live`` (``live.model`` is None on a rank plan B does not use). It has no ``export`` /
``load``: building plan B's model is collective over the default group, which the controller's
load (on plan B's ranks only) is not.

A training loop must read ``adapter.live`` after every step: the object changes on a move.
"""

from __future__ import annotations

from ..ir import Module, bare_name
from .hf_llama import LiveLlama
from .llama_reshard import reshard_llama


class LlamaAdapter:
    def __init__(self, live: LiveLlama, module: Module, plan: str, *, seed: int = 0):
        self.live, self.module, self.plan, self.seed = live, module, bare_name(plan), seed
        self.moves = 0

    def move(
        self,
        module: Module,
        source: str,
        target: str,
        *,
        transition: str | None = None,
        timeout: float = 60.0,
        faults: tuple = (),
    ) -> None:
        """Plan A -> plan B on every rank; on failure (``TransitionError``, ``DiagnosticError``)
        ``self.live`` is plan A's model, untouched."""
        self.live = reshard_llama(
            self.live, module, source, target, transition=transition, timeout=timeout, faults=faults, seed=self.seed
        )
        self.module, self.plan = module, target
        self.moves += 1
