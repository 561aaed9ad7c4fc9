"""verl's NCCL checkpoint engine, its algorithm on gloo: the peer of ``nereus bench verl``.

verl 0.9.1's ``NCCLCheckpointEngine`` (``verl/checkpoint_engine/nccl_checkpoint_engine.py``) is
how verl moves weights between a trainer and rollout workers that do not share GPUs. It needs
cupy and NCCL; this is the same algorithm over a gloo group (``runtime.private_group``), so that
it runs beside Nereus's backend on this CPU machine, driven by the same verl manager and workers:

- the group is trainer rank 0 (the source) and every rollout worker; the other trainer workers
  sit out (verl's single-sender mode, its default without NVLink relays on one node); it is
  kept across updates (verl's ``rebuild_group`` default, false);
- the source packs the tensors it is handed into buckets of ``bucket_size`` bytes, in order, and
  broadcasts each bucket's metadata (names, shapes, dtypes, offsets; verl sends them over zmq)
  and then the bucket, packing the next bucket while the last one is on the wire (verl's
  double buffer);
- a rollout worker receives each bucket and yields its tensors (copies, as verl's consumers copy
  them out of the bucket before the next one lands).

A tensor larger than a bucket is sent in a bucket of its own (verl splits it in chunks: the same
bytes). The other trainer workers consume their generator (under FSDP its gathers are
collectives) and send nothing.
"""

from __future__ import annotations

import pickle
import socket
import time
from typing import Any

import torch
import torch.distributed as dist
from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry
from verl.workers.rollout.utils import ensure_async_iterator

from ...runtime.launch import free_port
from ...runtime.private_group import PrivateGroup


@CheckpointEngineRegistry.register("verl-broadcast")
class BroadcastCheckpointEngine(CheckpointEngine):
    def __init__(
        self, bucket_size: int, is_master: bool = False, timeout: float = 120.0, rebuild_group: bool = False, **_: Any
    ) -> None:
        self.bucket_size, self.is_master, self.timeout = bucket_size, is_master, timeout
        self.rebuild_group = rebuild_group  # verl's default: the group kept across updates
        self.group: PrivateGroup | None = None
        self.meta: dict[str, Any] | None = None
        self.joined: tuple | None = None
        self.rank = -1
        self.sent = self.received = 0
        self.seconds = 0.0

    def prepare(self) -> dict[str, Any]:
        if self.group is None or self.meta is None:
            self.meta = {"host": socket.gethostbyname(socket.gethostname()), "port": free_port()}
        return self.meta

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]):
        """Trainer rank 0 is the source (rank 0); the other trainers are out (-1); rollout worker j
        is rank j + 1."""
        world = rollout_world_size + 1
        actor = {
            "rank": [0] + [-1] * (actor_wg_world_size - 1),
            "world_size": [world] * actor_wg_world_size,
            "master_metadata": [metadata[0]] * actor_wg_world_size,
        }
        rollout = {
            "rank": list(range(1, world)),
            "world_size": [world] * rollout_world_size,
            "master_metadata": [metadata[0]] * rollout_world_size,
        }
        return actor, rollout

    def init_process_group(self, rank: int, world_size: int, master_metadata: dict) -> None:
        joined = (rank, world_size, master_metadata["host"], master_metadata["port"])
        if joined == self.joined:
            return
        if self.group is not None:
            self.group.close()
            self.group = None
        self.rank, self.joined = rank, joined
        if rank >= 0:
            self.group = PrivateGroup(
                master_metadata["host"], master_metadata["port"], rank, world_size, timeout=self.timeout
            )

    def finalize(self) -> None:
        if self.rebuild_group:
            if self.group is not None:
                self.group.close()
            self.group, self.meta, self.joined = None, None, None

    def _broadcast(self, t: torch.Tensor):
        assert self.group is not None
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        return self.group.pg.broadcast([t], opts)

    def _post(self, metas: list, bucket: torch.Tensor, last: bool) -> list:
        """Post one bucket: its metadata's length, the metadata, then the bucket (all from rank 0)."""
        head = torch.tensor([bucket.numel(), 1 if last else 0], dtype=torch.int64)
        blob = torch.frombuffer(bytearray(pickle.dumps(metas)), dtype=torch.uint8)
        size = torch.tensor([blob.numel()], dtype=torch.int64)
        works = [self._broadcast(size), self._broadcast(head), self._broadcast(blob), self._broadcast(bucket)]
        self.sent += (bucket.numel() + blob.numel() + 24) * (self.group.size - 1)
        return works

    async def send_weights(self, weights, global_steps: int | None = None) -> dict:
        t0 = time.perf_counter()
        self.sent = 0
        if self.rank != 0:  # out of the group: the generator is consumed (its gathers are collectives)
            async for _ in ensure_async_iterator(weights):
                pass
            return {}
        metas: list = []
        parts: list[torch.Tensor] = []
        used = 0
        inflight: list = []

        def pack() -> torch.Tensor:
            return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)

        async for name, tensor in ensure_async_iterator(weights):
            flat = tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8)
            if used and used + flat.numel() > self.bucket_size:
                bucket = pack()
                for w in inflight:  # the previous bucket leaves before this one is posted (double buffer)
                    w.wait(self.group.timeout)
                inflight = self._post(metas, bucket, last=False)
                metas, parts, used = [], [], 0
            metas.append((name, tuple(tensor.shape), tensor.dtype, used, flat.numel()))
            parts.append(flat)
            used += flat.numel()
        bucket = pack()
        for w in inflight:
            w.wait(self.group.timeout)
        for w in self._post(metas, bucket, last=True):
            w.wait(self.group.timeout)
        self.seconds = time.perf_counter() - t0
        return {}

    async def receive_weights(self, global_steps: int | None = None):
        t0 = time.perf_counter()
        self.received = 0
        assert self.group is not None
        timeout = self.group.timeout
        while True:
            size = torch.empty(1, dtype=torch.int64)
            head = torch.empty(2, dtype=torch.int64)
            self._broadcast(size).wait(timeout)
            self._broadcast(head).wait(timeout)
            blob = torch.empty(int(size[0]), dtype=torch.uint8)
            self._broadcast(blob).wait(timeout)
            bucket = torch.empty(int(head[0]), dtype=torch.uint8)
            self._broadcast(bucket).wait(timeout)
            self.received += bucket.numel() + blob.numel() + 24
            for name, shape, dtype, offset, n in pickle.loads(blob.numpy().tobytes()):
                yield name, bucket[offset : offset + n].view(dtype).view(shape).clone()
            if head[1]:
                break
        self.seconds = time.perf_counter() - t0
