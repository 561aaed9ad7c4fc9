"""The default process group re-formed in the running processes: over the ranks that remain
after some left or died, or over the job's ranks and new ones that join it.

After ranks leave a job, torch's default group still counts them: a new subgroup (``new_group``,
which every member of the default group must call) or any collective over the world hangs on
them; and no rank can enter a running group. torchelastic's answer is to restart every worker;
``reform`` keeps the processes (and the live state in their memory) and re-initialises only the
process group, by torch's own means: ``init_process_group`` over the job's rendezvous store
(``job_store``: a client of ``MASTER_ADDR:MASTER_PORT``, the store of torchrun's agent, of
``nereus launch`` or of ``run_local``) under a fresh key prefix per generation.

The GPUs keep their ids: the GPUs ``gpus`` (ascending) become ranks ``0..len-1`` of the new
default group, GPU ``gpus[r]`` at rank ``r``. Everything that maps a plan's GPUs to ranks takes
``gpus`` (``hf_llama.build``, ``reshard_job``, ``plan_move``, ``WeightPush``).

Every rank of ``gpus`` calls ``reform`` at the same point; the ranks that left must not. Every
subgroup made over the old default group is gone with it: live models must rebuild their meshes
(``JobAdapter.regroup``, or a move to a plan on the new group).

Joining: a new process (``nereus launch --join``, or any process with the job's ``MASTER_ADDR``
and ``MASTER_PORT``) calls ``request_join``: it takes a ticket (``nereus/join/count``) and waits,
bounded, for the job to admit it. The job's leader sees the tickets at a step's end
(``waiting``), and every rank of the job agrees on the GPU ids the joiners get; ``admit`` tells
each joiner its GPU, the job's new GPUs and the generation, and all of them, old and new,
``reform`` together.
"""

from __future__ import annotations

import datetime
import json
import os

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

PREFIX = "nereus/"  # Nereus's keys in the job's rendezvous store
JOIN_COUNT = "join/count"
JOIN_TICKET = "join/{}"


def job_store(timeout: float = 60.0) -> dist.Store:
    """Where Nereus keeps its keys (heartbeats, joins, re-formed groups): a client of the job's
    rendezvous store, under the prefix ``nereus/``; the same store for the ranks that started
    with the job and for those that join it. Without ``MASTER_ADDR``/``MASTER_PORT`` (a group
    initialised from an explicit store), the default group's store: no process can join then."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if addr and port:
        base: dist.Store = dist.TCPStore(
            addr, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False
        )
    else:
        base = c10d._get_default_store()
    return dist.PrefixStore(PREFIX, base)


def reform(gpus: list[int], me: int, generation: int, timeout: float = 60.0, store: dist.Store | None = None) -> int:
    """Re-create the default group over ``gpus`` (this process is GPU ``me``); returns this
    process's new rank. ``generation`` must be the same on every rank of ``gpus`` and new for
    each re-formation of the job (the store's keys of an old generation are never reused). A
    process that joins has no group yet: it only initialises one."""
    gpus = sorted(gpus)
    if me not in gpus:
        raise ValueError(f"GPU {me} is not one of the GPUs of the re-formed group ({gpus})")
    store = store if store is not None else job_store(timeout)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if dist.is_initialized():
        backend = dist.get_backend()
        dist.destroy_process_group()
    rank = gpus.index(me)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"regroup/{generation}/", store),
        rank=rank,
        world_size=len(gpus),
        timeout=datetime.timedelta(seconds=timeout),
    )
    return rank


def request_join(store: dist.Store, timeout: float) -> dict:
    """Ask the running job to take this process and wait (at most ``timeout`` seconds) for its
    answer: ``{"gpu", "gpus", "generation", "leader"}``, or a ``RuntimeError`` where the job
    refused it (no GPU of its cluster is free)."""
    ticket = store.add(JOIN_COUNT, 1)
    key = JOIN_TICKET.format(ticket)
    try:
        store.wait([key], datetime.timedelta(seconds=timeout))
    except Exception as e:  # noqa: BLE001 - DistStoreError: the job never answered
        raise TimeoutError(f"the job did not admit join request {ticket} within {timeout:.0f} s") from e
    answer = json.loads(store.get(key))
    if "refused" in answer:
        raise RuntimeError(f"the job refused join request {ticket}: {answer['refused']}")
    return answer


def waiting(store: dist.Store) -> int:
    """The join requests made so far (tickets ``1..n``)."""
    return int(store.add(JOIN_COUNT, 0))


def admit(store: dist.Store, ticket: int, answer: dict) -> None:
    """Answer join request ``ticket`` (``request_join`` returns ``answer``)."""
    store.set(JOIN_TICKET.format(ticket), json.dumps(answer))
