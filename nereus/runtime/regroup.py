"""The default process group re-formed over the ranks that remain, in the running processes.

After ranks leave a job, torch's default group still counts them: a new subgroup (``new_group``,
which every member of the default group must call) or any collective over the world hangs on
them. torchelastic's answer is to restart every worker; ``reform`` keeps the processes (and the
live state in their memory) and re-initialises only the process group, by torch's own means:
the job's rendezvous store (the one ``init_process_group`` was given: torchrun's agent store, or
the ``MASTER_ADDR:MASTER_PORT`` server), under a fresh key prefix per generation, and
``init_process_group`` over the ranks that remain.

The GPUs keep their ids: the remaining GPUs ``gpus`` (ascending) become ranks ``0..len-1`` of
the new default group, GPU ``gpus[r]`` at rank ``r``. Everything that maps a plan's GPUs to
ranks takes ``gpus`` (``hf_llama.build``, ``reshard_job``, ``plan_move``, ``WeightPush``).

Every remaining rank calls ``reform`` at the same point; the ranks that left must not (they end
their loop and may call ``destroy_process_group`` on the old group, which is local). Every
subgroup made over the old default group is gone with it: live models must rebuild their meshes
(``JobAdapter.regroup``). The store's host must remain (torchrun's agent does; under
``run_local`` it is rank 0's process).
"""

from __future__ import annotations

import datetime

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


def reform(gpus: list[int], me: int, generation: int, timeout: float = 60.0) -> int:
    """Re-create the default group over ``gpus`` (this process is GPU ``me``); returns this
    process's new rank. ``generation`` must be the same on every remaining rank and new for each
    re-formation of the job (the store's keys of an old generation are never reused)."""
    gpus = sorted(gpus)
    if me not in gpus:
        raise ValueError(f"GPU {me} is not one of the GPUs that remain ({gpus})")
    store = c10d._get_default_store()  # the job's rendezvous store; the object outlives the group
    backend = dist.get_backend()
    dist.destroy_process_group()
    rank = gpus.index(me)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"nereus/regroup/{generation}", store),
        rank=rank,
        world_size=len(gpus),
        timeout=datetime.timedelta(seconds=timeout),
    )
    return rank
