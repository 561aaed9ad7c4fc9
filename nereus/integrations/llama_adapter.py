"""The Controller's adapters for live HF Llamas + AdamW (``hf_llama.LiveLlama``).

``JobAdapter({"actor.train": actor, "ref.infer": ref, "critic.train": critic}, module, plan)``
holds every model of an RL job, one live model per model-stage of the plan. It has ``move``:
on a transition the controller calls it on every rank (building plan B's models creates process
groups, a collective) and it runs ``reshard_job``: one transition, one program, every model
moved together, and on failure every model left as it was. ``LlamaAdapter(live, module, plan)``
is the one-model case (``adapter.live``). Neither has ``export`` / ``load``: building plan B's
models is collective over the default group, which the controller's load (on plan B's ranks
only) is not.

A training loop must read ``adapter.lives`` (``adapter.live``) after every step: the objects
change on a move (``model`` is None on a rank that a model's plan-B layout does not use).
"""

from __future__ import annotations

from ..ir import Module, bare_name
from .hf_llama import LiveLlama
from .llama_reshard import reshard_job


class JobAdapter:
    def __init__(self, lives: dict[str, LiveLlama], module: Module, plan: str, *, seed: int = 0):
        self.lives, self.module, self.plan, self.seed = dict(lives), module, bare_name(plan), seed
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
        ``self.lives`` are plan A's models, untouched."""
        self.lives = reshard_job(
            self.lives, module, source, target, transition=transition, timeout=timeout, faults=faults, seed=self.seed
        )
        self.module, self.plan = module, target
        self.moves += 1


class LlamaAdapter(JobAdapter):
    """A ``JobAdapter`` of a one-model job."""

    def __init__(self, live: LiveLlama, module: Module, plan: str, *, seed: int = 0):
        super().__init__({live.layout.model_stage: live}, module, plan, seed=seed)

    @property
    def live(self) -> LiveLlama:
        (only,) = self.lives.values()
        return only
