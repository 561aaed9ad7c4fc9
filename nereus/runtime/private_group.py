"""A gloo process group of processes that belong to different torch.distributed worlds.

A framework that runs its trainer and its rollout workers as separate jobs (verl: a Ray worker
group each, every one with a default process group of its own) has no torch.distributed group
that spans both: ``new_group`` carves groups out of the caller's world only. verl's NCCL
checkpoint engine builds such a group outside torch (a cupy communicator over a rendezvous of
its own); this is the same on gloo: a ``ProcessGroupGloo`` on a ``TCPStore`` that its rank 0
hosts, registered nowhere, so that it leaves every default group as it is.

``execute(..., group=PrivateGroup(...))`` runs a program on it: its point-to-point messages go
through the group's own ``send`` and ``recv`` (``runtime.execute`` asks ``is_private``), and its
broadcasts point to point or in chains (``lower``'s ``"auto"``, ``"p2p"`` or ``"chain"``).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


class PrivateGroup:
    """Rank ``rank`` of ``size`` processes meeting at ``host:port`` (rank 0 hosts the store)."""

    backend = "gloo"

    def __init__(self, host: str, port: int, rank: int, size: int, timeout: float = 60.0):
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not a rank of {size} processes")
        bound = datetime.timedelta(seconds=timeout)
        self.rank, self.size, self.timeout = rank, size, bound
        self.store = dist.TCPStore(host, port, size, is_master=rank == 0, timeout=bound, wait_for_workers=False)
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore("nereus", self.store), rank, size, bound)

    def isend(self, tensor: torch.Tensor, peer: int, tag: int = 0):
        return self.pg.send([tensor], peer, tag)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int = 0):
        return self.pg.recv([tensor], peer, tag)

    def close(self) -> None:
        """Drop the group (its connections close with it) and the store."""
        self.pg = None
        self.store = None


def is_private(group) -> bool:
    return isinstance(group, PrivateGroup)
