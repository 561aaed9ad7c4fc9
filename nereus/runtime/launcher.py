"""``nereus launch``: start a job's worker processes as torchrun does, except that a worker that
dies does not take the others down, and that more workers can join the running job.

torchrun's agent (``LocalElasticAgent``) treats any worker failure as the group's: it stops
every worker and, with ``--max-restarts``, starts them all again, which then load the last
checkpoint. Its elastic mode (``--nnodes=MIN:MAX``) does the same on a membership change: a node
that joins or leaves makes every agent restart its workers in a new rendezvous round. Live state
cannot survive either. This launcher keeps torchrun's contract for the workers (the same
environment: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, and the agent's store, ``TORCHELASTIC_USE_AGENT_STORE``: ``init_process_group``
connects to the store this process hosts), and only reports a worker that dies: the survivors
find out through their collectives and the store (``runtime.liveness``) and the Controller
moves the job onto them. ``--join HOST:PORT`` starts workers that join the job whose store is at
``HOST:PORT`` (``NEREUS_JOIN=1``, no ``RANK``: ``Controller.join`` takes them in).

The store lives as long as this process: the launcher that started the job must outlive every
worker, joiners included (it waits for its own workers, then for ``--linger`` seconds while
any heartbeat in the store still moves). Under Slurm, run one ``nereus launch`` on the first node
with the job's ranks and ``--join`` launchers elsewhere; a multi-node start needs ``--nnodes``
and ``--node-rank`` with ``--master HOST:PORT``, as torchrun's static rendezvous.
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import torch.distributed as dist

from .liveness import ALL, report_dead
from .regroup import PREFIX

ALL_BEATS = PREFIX + ALL  # every heartbeat of the job adds to it (the store's raw key)


@dataclass
class Worker:
    rank: int | None  # None: a joiner
    proc: subprocess.Popen

    @property
    def name(self) -> str:
        return f"rank {self.rank}" if self.rank is not None else f"joiner (pid {self.proc.pid})"


def _env(master: tuple[str, int], rank: int | None, world: int, local: int, local_world: int) -> dict:
    env = dict(os.environ)
    env.update(
        MASTER_ADDR=master[0],
        MASTER_PORT=str(master[1]),
        TORCHELASTIC_USE_AGENT_STORE="True",
        TORCHELASTIC_RESTART_COUNT="0",
        LOCAL_RANK=str(local),
        LOCAL_WORLD_SIZE=str(local_world),
    )
    if rank is None:
        env["NEREUS_JOIN"] = "1"
        for key in ("RANK", "WORLD_SIZE", "GROUP_RANK"):
            env.pop(key, None)
    else:
        env.update(RANK=str(rank), WORLD_SIZE=str(world))
    return env


def address(text: str, what: str) -> tuple[str, int | None]:
    """``HOST:PORT`` (or ``HOST``, ``:PORT``) as (host, port); a ``ValueError`` saying what is wrong."""
    host, colon, port = text.rpartition(":")
    if not colon:
        host, port = text, ""
    if port and not (port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"{what} {text!r}: the port must be a number from 1 to 65535 (HOST:PORT)")
    return host or "127.0.0.1", int(port) if port else None


def _heartbeats_moving(store: dist.Store, seconds: float) -> bool:
    """Whether any Nereus heartbeat in the job's store beat within ``seconds`` (``liveness.ALL``)."""
    try:
        before = store.add(ALL_BEATS, 0)
        time.sleep(seconds)
        return store.add(ALL_BEATS, 0) != before
    except Exception:  # noqa: BLE001 - the store went away
        return False


def launch(
    command: list[str],
    nproc: int,
    *,
    join: str | None = None,
    master: str | None = None,
    nnodes: int = 1,
    node_rank: int = 0,
    linger: float = 5.0,
    say=print,
) -> int:
    """Run ``command`` (``script.py args`` or ``-m module args``, with this Python) in ``nproc``
    workers; returns the launcher's exit status: 0 where every worker that ended by itself ended
    with 0 and at least one did (workers killed by a signal are reported, not counted), else the
    first failing worker's status. ``join``: ``HOST:PORT`` of a running job's store (the workers
    join it). ``master``: where the store is (default ``127.0.0.1`` and a free port, hosted here
    on node 0)."""
    argv = [sys.executable, *command]
    store = None
    if join is not None:
        host, port = address(join, "--join")
        if port is None:
            raise ValueError(f"--join {join!r}: give the job's store as HOST:PORT (the job's launcher prints it)")
        where = (host, port)
        ranks: list[int | None] = [None] * nproc
    else:
        from .launch import free_port

        host, port = address(master or "", "--master")
        where = (host, port if port is not None else free_port())
        world = nproc * nnodes
        if node_rank == 0:  # the job's store, hosted here as torchrun's agent hosts it
            store = dist.TCPStore(
                where[0],
                where[1],
                world,
                is_master=True,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=60),
            )
            at = f"{where[0]}:{where[1]}"
            say(f"nereus launch: job store at {at} (join with: nereus launch --join {at} ...)")
        ranks = [node_rank * nproc + i for i in range(nproc)]
    world = nproc * nnodes
    hosted = store is not None
    workers = [
        Worker(rank, subprocess.Popen(argv, env=_env(where, rank, world, i, nproc))) for i, rank in enumerate(ranks)
    ]

    def forward(sig, _frame):  # the launcher's own stop goes to every worker
        for w in workers:
            if w.proc.poll() is None:
                w.proc.send_signal(sig)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    status, finished = 0, 0
    try:
        pending = list(workers)
        while pending:
            for w in list(pending):
                code = w.proc.poll()
                if code is None:
                    continue
                pending.remove(w)
                if code and w.rank is not None:  # the survivors need not wait for its heartbeat to stop
                    try:
                        if store is None:
                            store = dist.TCPStore(*where, is_master=False, timeout=datetime.timedelta(seconds=10))
                        report_dead(dist.PrefixStore(PREFIX, store), w.rank)
                    except Exception:  # noqa: BLE001 - the job's store is gone: nobody is left to tell
                        pass
                if code < 0:
                    say(f"nereus launch: {w.name} died ({signal.Signals(-code).name}); the others go on")
                elif code:
                    say(f"nereus launch: {w.name} failed with exit status {code}")
                    status = status or code
                else:
                    finished += 1
            time.sleep(0.1)
        if store is not None and hosted:  # joiners may still use the job's store
            while _heartbeats_moving(store, linger):
                pass
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    return status if status or finished else 1
