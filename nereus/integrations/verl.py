"""verl's checkpoint engine backed by a Nereus push: ``checkpoint_engine.backend = nereus``.

verl (0.9.1) moves the actor's weights to its rollout replicas through a pluggable checkpoint
engine (``verl/checkpoint_engine/base.py``). Its ``CheckpointEngineManager`` calls, at every
weight update, ``prepare`` on every trainer and rollout worker, the backend's
``build_topology``, ``init_process_group``, then ``send_weights`` on the trainer workers (fed
by the training engine's ``get_per_tensor_param``: every tensor whole, by Hugging Face name, on
every trainer rank) and ``receive_weights`` on the rollout workers (whose server adapter loads
whole tensors), and ``finalize``. A backend out of verl's tree is loaded by
``checkpoint_engine.custom_backend_module``:

    actor_rollout_ref:
      rollout:
        checkpoint_engine:
          backend: nereus
          custom_backend_module: nereus.integrations.verl
          engine_kwargs:
            nereus:
              model: ${actor_rollout_ref.model.path}   # its config.json: the tensors and their shapes

This backend plans the weights' move as a Nereus transition: plan A, the trainer's layout as
verl hands it over (every tensor on every trainer rank: TP 1, DP over the trainer ranks); plan
B, every rollout worker holding every tensor (TP 1, DP over the rollout workers). The planner
gives each rollout worker exactly the bytes it lacks and spreads the sending over every trainer
rank (each cell from the least loaded holder), where verl's NCCL engine broadcasts from trainer
rank 0 alone; a cell that several rollout workers need goes out once and is passed on
(``lower``'s broadcasts as point-to-point chains). It runs on gloo in a process group of its own
over the trainer and rollout workers (``runtime.private_group``: they are separate Ray worker
groups, each with a default group of its own), with the executor's checksums, agreement and
rollback. The program is planned and lowered once per pair of world sizes; the group is made
at the first ``init_process_group`` and kept for the updates after it while the ranks stay the
same, as verl's NCCL engine keeps its group (``rebuild_group: true`` drops it at every
``finalize``).

What stock verl does not allow, and an upstream change would add: verl hands a backend whole
tensors on every trainer rank (``get_per_tensor_param``); its sharded export
(``get_per_tensor_param_shard``) is offered only to a backend named ``delta_sharded``, and the
rollout side's loaders take whole tensors. With the trainer's shards as plan A and each rollout
worker's TP shard as plan B, the transition would move each worker only its shard, from the
trainer ranks that hold it, without gathering whole tensors first.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import torch
from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry
from verl.workers.rollout.utils import ensure_async_iterator

from ..ir import Layout, Model
from ..ir.hf_config import model_from_hf_config
from ..runtime.launch import free_port
from ..runtime.private_group import PrivateGroup
from .hf_checkpoint import ir_name
from .weight_push import WeightPush


@CheckpointEngineRegistry.register("nereus")
class NereusCheckpointEngine(CheckpointEngine):
    """verl's checkpoint engine interface over a Nereus push (see the module docstring).

    ``model``: the model's directory or ``config.json`` (the IR model, ``import-hf``'s, plans
    the move); ``dtype``: the dtype verl hands over (``fp32``, ``bf16``; default the config's).
    ``sent`` and ``received``: bytes of the last update on this worker; ``seconds`` its push."""

    def __init__(
        self,
        bucket_size: int,
        is_master: bool = False,
        model: str | None = None,
        dtype: str | None = None,
        timeout: float = 120.0,
        rebuild_group: bool = False,
    ) -> None:
        if model is None:
            raise ValueError(
                "checkpoint_engine.engine_kwargs.nereus.model: the model's path (its config.json) is needed "
                "to plan the move"
            )
        path = Path(model)
        self.ir: Model = model_from_hf_config(path / "config.json" if path.is_dir() else path, "actor")
        if dtype is not None:
            self.ir.dtype = dtype
        self.bucket_size, self.is_master, self.timeout = bucket_size, is_master, timeout
        self.rebuild_group = rebuild_group
        self.group: PrivateGroup | None = None
        self.meta: dict[str, Any] | None = None  # what ``prepare`` offered while the group is kept
        self.joined: tuple | None = None  # (rank, world, master, trainers) of the group kept
        self.rank = self.world = self.trainers = 0
        self.pushes: dict[tuple[int, int], WeightPush] = {}
        self.sent = self.received = 0
        self.seconds = 0.0

    # -- topology ------------------------------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        """Where this worker would host the group's store (the first trainer worker's is used):
        while a group is kept, where it already is."""
        if self.group is None or self.meta is None:
            self.meta = {"host": socket.gethostbyname(socket.gethostname()), "port": free_port()}
        return self.meta

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Trainer worker i is rank i, rollout worker j rank ``trainers + j`` of one group."""
        a, r = actor_wg_world_size, rollout_world_size
        world, master = a + r, metadata[0]

        def kwargs(ranks):
            n = len(ranks)
            return {"rank": ranks, "world_size": [world] * n, "master_metadata": [master] * n, "trainers": [a] * n}

        return kwargs(list(range(a))), kwargs(list(range(a, world)))

    def init_process_group(self, rank: int, world_size: int, master_metadata: dict, trainers: int) -> None:
        """Join the group; a group kept from the last update with the same ranks is reused (verl's
        NCCL engine keeps its group too unless ``rebuild_group``)."""
        joined = (rank, world_size, master_metadata["host"], master_metadata["port"], trainers)
        if self.group is not None and joined == self.joined:
            return
        if self.group is not None:
            self.group.close()
        self.rank, self.world, self.trainers, self.joined = rank, world_size, trainers, joined
        self.group = PrivateGroup(
            master_metadata["host"], master_metadata["port"], rank, world_size, timeout=self.timeout
        )

    def finalize(self) -> None:
        """After an update: the group is kept for the next one, or dropped with ``rebuild_group``."""
        if self.rebuild_group and self.group is not None:
            self.group.close()
            self.group, self.meta, self.joined = None, None, None

    # -- the push ------------------------------------------------------------------------------
    def push_plan(self) -> WeightPush:
        """The push from every trainer rank holding every tensor to every rollout worker holding
        every tensor, planned and lowered once per (trainers, world)."""
        key = (self.trainers, self.world)
        push = self.pushes.get(key)
        if push is None:
            a, world = self.trainers, self.world
            held = Layout(
                model_stage=f"{self.ir.name}.train",
                tp=1,
                pp=1,
                dp=a,
                layers=[(0, self.ir.layers - 1)],
                mesh=list(range(a)),
            )
            push = self.pushes[key] = WeightPush(self.ir, held, list(range(a, world)), world, timeout=self.timeout)
        push.group = self.group
        return push

    def _run(self, state: dict) -> dict[str, torch.Tensor]:
        push = self.push_plan()
        t0 = time.perf_counter()
        new = push.push_state(state)
        self.seconds = time.perf_counter() - t0
        self.sent, self.received = push.stats.bytes_sent, push.stats.bytes_received
        return new

    async def send_weights(self, weights, global_steps: int | None = None) -> dict:
        """A trainer worker: every tensor verl hands over (consumed whole: under FSDP its gathers
        are collectives of the trainer ranks), then its part of the push."""
        if self.group is None:
            raise RuntimeError("send_weights before init_process_group")
        params: dict[str, torch.Tensor] = {}
        async for name, tensor in ensure_async_iterator(weights):
            params[ir_name(name)] = tensor.detach().to("cpu")
        push = self.push_plan()
        self._run(push.state_of_params(params))
        self.sent = push.stats.bytes_sent
        return {}

    async def receive_weights(self, global_steps: int | None = None):
        """A rollout worker: every tensor whole, by Hugging Face name, as the push delivers them."""
        if self.group is None:
            raise RuntimeError("receive_weights before init_process_group")
        for name, tensor in self._run({}).items():
            yield name, tensor
