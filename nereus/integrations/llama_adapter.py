"""The Controller's adapters for live HF Llamas + AdamW (``hf_llama.LiveLlama``).

``JobAdapter({"actor.train": actor, "ref.infer": ref, "critic.train": critic}, module, plan)``
holds every model of an RL job, one live model per model-stage of the plan. It has ``move``:
on a transition the controller calls it on every rank (building plan B's models creates process
groups, a collective) and it runs ``reshard_job``: one transition, one program, every model
moved together, and on failure every model left as it was. ``LlamaAdapter(live, module, plan)``
is the one-model case (``adapter.live``). Neither has ``export`` / ``load``: building plan B's
models is collective over the default group, which the controller's load (on plan B's ranks
only) is not.

With ``engines`` (``engine_stage.EngineStage``, the live ``actor.generate``), a move also moves
the generation engines: their plan-B layout is checked with every model's before anything moves,
the models move by ``reshard_job`` (the engines' model-stage ``elsewhere``: their weights come
from the push), and then the engines take their new layout (a restart where the TP changes,
measured: ``engine_restart_s``). A failed transition leaves the engines as they were too.

A training loop must read ``adapter.lives`` (``adapter.live``) after every step: the objects
change on a move (``model`` is None on a rank that a model's plan-B layout does not use).
"""

from __future__ import annotations

import dataclasses
import gc

import torch.distributed as dist

from ..ir import Module, bare_name
from ..runtime import dcp
from .hf_llama import LiveLlama
from .llama_reshard import reshard_job
from .llama_state import check_layout, export_states, shard_specs


class JobAdapter:
    def __init__(
        self,
        lives: dict[str, LiveLlama],
        module: Module,
        plan: str,
        *,
        seed: int = 0,
        engines=None,
        group: dist.ProcessGroup | None = None,
    ):
        self.lives, self.module, self.plan, self.seed = dict(lives), module, bare_name(plan), seed
        self.engines = engines
        self.moves = 0
        self.restarts = 0
        # the process group the models were built on (None: the default group; a caller's group:
        # ``build(group=)``) and the GPU id of each of its ranks (None: rank == GPU)
        self.group = group
        self.gpus: list[int] | None = None
        self.regroups = 0
        self._held: tuple | None = None  # (state, steps) kept by ``detach`` for the next move

    @property
    def regroupable(self) -> bool:
        """Whether the Controller may re-form the default group under these models (``regroup``):
        not with generation engines, whose vLLM groups were made over the job's first world."""
        return self.engines is None

    def regroup(self, module: Module, plan: str, gpus: list[int], group: dist.ProcessGroup | None = None) -> None:
        """After ``runtime.regroup.reform`` over ``gpus`` (every rank of the new default group
        calls it), or in a new ``group`` of a caller's world whose ranks are ``gpus``: every live
        model rebuilt under its same layout on the new group's ranks (the old models' process
        groups went with the old group), its state carried by the transition from the plan to
        itself: every shard stays on its GPU, a local copy."""
        self.gpus, self.group = list(gpus), group
        self.regroups += 1
        own = dataclasses.replace(module, transitions=dict(module.transitions))  # the caller's module untouched
        self.lives = reshard_job(
            self.lives,
            own,
            plan,
            plan,
            transition=f"{bare_name(plan)}_regroup_{len(gpus)}",
            seed=self.seed,
            gpus=self.gpus,
            exported=self._held,
            group=self.group,
        )
        self._held = None

    def detach(self, module: Module, plan: str) -> None:
        """After ranks died, before the group is re-formed: this rank's state under ``plan`` kept
        as plain local tensors and the live models (modules, optimizers, DDP, meshes) dropped, so
        that the process groups they hold are freed and close their connections: a rank still
        waiting on this one in a collective fails at once instead of at its group's timeout
        (gloo's waits cannot be aborted). The next ``move`` (or ``regroup``) starts from that
        state; nothing else can run on these models any more."""
        self._held = export_states(self.lives, module, plan)
        for live in self.lives.values():  # in place: a training loop may still hold these objects
            live.model = live.optimizer = live.runner = live.mesh = None
            live.named, live.schedules, live.loss_fn = {}, {}, None
        gc.collect()

    def exported(self, module: Module, plan: str) -> tuple:
        """This rank's state under ``plan`` and each model's AdamW step: the live models', or what
        ``detach`` kept of them."""
        return self._held if self._held is not None else export_states(self.lives, module, plan)

    def save(self, module: Module, plan: str, path: str) -> int:
        """Every model's shards on this rank under ``plan`` into the DCP checkpoint at ``path``
        (every rank of the job's group calls it); the bytes this rank wrote."""
        state, _ = export_states(self.lives, module, plan)
        specs = [s for live in self.lives.values() if live.model is not None for s in shard_specs(live, module, plan)]
        g = self.group
        return dcp.save(state, specs, path, dist.get_rank(g), dist.get_world_size(g), group=g)

    @property
    def engine_restart_s(self) -> float | None:
        """What restarting the generation engines costs on this job (measured), or None without
        engines: the Controller hands it to admission."""
        return None if self.engines is None else self.engines.restart_s

    def move(
        self,
        module: Module,
        source: str,
        target: str,
        *,
        transition: str | None = None,
        timeout: float = 60.0,
        faults: tuple = (),
        gpus: list[int] | None = None,
        restore: str | None = None,
    ) -> None:
        """Plan A -> plan B on every rank; on failure (``TransitionError``, ``DiagnosticError``,
        a collective broken by a rank that died) ``self.lives`` are plan A's models, untouched,
        and the engines too. ``gpus``: the GPU of each rank of the default group, where it was
        re-formed over the ranks that survived a failure (plan A's models were built on the old).
        ``restore``: the DCP checkpoint the parts no survivor holds come from (``reshard_job``);
        ``self.restored`` says what was read, by FQN."""
        if gpus is not None:
            self.gpus = list(gpus)
        self.restored: dict[str, int] = {}
        elsewhere: frozenset[str] = frozenset()
        if self.engines is not None:
            for ms in self.lives:  # every model-stage is checked before the engines or any state moves
                check_layout(module, target, ms)
            self.engines.check(module, target)
            elsewhere = frozenset({self.engines.model_stage})
        self.lives = reshard_job(
            self.lives,
            module,
            source,
            target,
            transition=transition,
            timeout=timeout,
            faults=faults,
            seed=self.seed,
            elsewhere=elsewhere,
            gpus=self.gpus,
            restore=restore,
            restored=self.restored,
            exported=self._held,
            group=self.group,
        )
        self._held = None
        if self.engines is not None and self.engines.move(module, target):
            self.restarts += 1
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
