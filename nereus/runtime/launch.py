"""Process groups from the standard launcher environment, and a local launcher for tests and benchmarks.

``init_from_env`` joins the default process group from what ``torchrun`` (or Slurm, or Ray with
the same variables) sets: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and, when
present, ``LOCAL_RANK``. The backend follows the device: NCCL when CUDA is available, gloo
otherwise. Nothing in the runtime knows how its processes were started.

``run_local(fn, world, *args)`` starts ``world`` processes on this machine with that same
environment (a free port on loopback, gloo bound to ``lo``), runs ``fn(rank, world, *args)`` in
each, and returns every rank's result, or raises ``LaunchError`` with the errors of the ranks
that failed. A rank that neither returns nor fails within ``timeout`` seconds is killed: a hung
collective fails a test instead of eating CI's time.
"""

from __future__ import annotations

import datetime
import os
import queue as queue_mod
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .liveness import report_dead
from .regroup import PREFIX


class LaunchError(RuntimeError):
    def __init__(self, errors: dict[int, str], results: dict[int, Any]):
        self.errors, self.results = errors, results
        lines = [
            f"rank {r}: {e.strip().splitlines()[-1] if e.strip() else 'failed'}" for r, e in sorted(errors.items())
        ]
        super().__init__("; ".join(lines))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_from_env(timeout: float = 60.0, backend: str | None = None) -> torch.device:
    """Join the default process group from the launcher's environment; return this rank's device."""
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(
            backend, timeout=datetime.timedelta(seconds=timeout), device_id=device if backend == "nccl" else None
        )
    return device


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, queue, threads: int) -> None:
    if rank < world:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    else:  # a process that joins the running job (Controller.join): no rank of it yet
        os.environ.update(NEREUS_JOIN="1")
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        GLOO_SOCKET_IFNAME="lo",
        # the store is the launcher's (as torchrun's agent store is): a rank may die and it stays
        TORCHELASTIC_USE_AGENT_STORE="True",
        TORCHELASTIC_RESTART_COUNT="0",
    )
    torch.set_num_threads(threads)
    try:
        queue.put((rank, "ok", fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - report every failure, SystemExit included
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except RuntimeError:  # a group broken by a failed peer: nothing left to tidy
                pass


def run_local(
    fn: Callable,
    world: int,
    *args,
    timeout: float = 120.0,
    threads: int = 1,
    dies: tuple[int, ...] = (),
    joiners: int = 0,
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` in ``world`` fresh processes; every rank's return value, in rank order.

    ``fn`` must be importable (a module-level function) and its results picklable. Ranks that
    exit without reporting (``os._exit``, a crash) or outlive ``timeout`` count as failed, except
    the ranks of ``dies`` (tests of a rank killed without notice): they must die by a signal
    without reporting, and their result is None. This process hosts the job's rendezvous store
    (as torchrun's agent does), so any rank may die.

    ``joiners``: that many more processes, started with the others, that are no rank of the
    job: they have its ``MASTER_ADDR``/``MASTER_PORT`` and ``NEREUS_JOIN=1`` but no ``RANK``
    (``Controller.join`` takes them into the running job); ``fn`` gets ``rank = world + i`` and
    their results follow the ranks'.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    # the job's rendezvous store, hosted here (torchrun's agent does the same): the ranks are its
    # clients, so that none of them is the job's store and any of them may die
    _store = dist.TCPStore("127.0.0.1", port, world, is_master=True, wait_for_workers=False)
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, fn, args, queue, threads), daemon=True)
        for r in range(world + joiners)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    pending = set(range(world + joiners))
    reported: set[int] = set()
    while pending:
        left = (deadline - datetime.datetime.now()).total_seconds()
        if left <= 0:
            break
        try:
            rank, status, value = queue.get(timeout=min(left, 0.05))
        except queue_mod.Empty:  # see whether someone died without a word
            for r in list(pending):
                if not procs[r].is_alive() and procs[r].exitcode not in (None,):
                    if (procs[r].exitcode or 0) < 0 and r < world and r not in reported:
                        # killed by a signal: the job's survivors hear it now (``liveness.report_dead``),
                        # not when its heartbeat has stood still
                        report_dead(dist.PrefixStore(PREFIX, _store), r)
                        reported.add(r)
                    # give its last message a moment to arrive before calling it dead
                    try:
                        rank, status, value = queue.get(timeout=0.5)
                    except queue_mod.Empty:
                        errors[r] = f"process exited with code {procs[r].exitcode} without reporting"
                        pending.discard(r)
                        continue
                    pending.discard(rank)
                    (results if status == "ok" else errors)[rank] = value
            continue
        pending.discard(rank)
        (results if status == "ok" else errors)[rank] = value
    for r in pending:
        errors[r] = f"timed out after {timeout:.0f} s"
    for r in dies:  # killed by a signal (a negative exit code), as the test meant
        if r in errors and r not in results and (procs[r].exitcode or 0) < 0:
            del errors[r]
            results[r] = None
        elif r in results:
            errors[r] = f"rank {r} was to die but reported {results.pop(r)!r}"
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
    if errors:
        raise LaunchError(errors, results)
    return [results[r] for r in range(world + joiners)]
