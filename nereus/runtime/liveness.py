"""Which ranks of a job are alive, from the job's rendezvous store: failures without notice.

A rank killed without notice (SIGKILL, a lost node) breaks the collectives of the others: gloo
raises at once where a connection to it closes ("Connection reset by peer"), and any other
wait ends at the process group's timeout. Neither says *who* died, nor whether every other rank
saw it. torchft answers with a lighthouse process that collects heartbeats; here the job's own
rendezvous store (torchrun's agent store, or the ``MASTER_ADDR:MASTER_PORT`` server) does it:

- ``Heartbeat(store, gpu)``: a daemon thread that adds 1 to ``beat/{gpu}`` every
  ``interval`` seconds while the process lives (a counter, not a clock: hosts' clocks differ);
- ``survivors(store, members, me, event)``: called by every rank that saw a failure. It marks
  ``alive/{event}/{me}``, then waits until every member either marked itself too (alive:
  it saw the failure and got here), or was reported dead by the process that started it, or let
  its beat stand still for ``stale`` seconds (dead). A live rank still waiting in a collective
  keeps beating, so it is waited for, never dropped: every survivor returns the same set. The
  wait is bounded by ``timeout`` (a ``TimeoutError``).
- ``report_dead(store, gpu)``: what a launcher that reaps its workers says at once when one
  ends without finishing (``nereus launch``, ``run_local``): the survivors need not wait for its
  beat to stand still. torchrun's agent says nothing (it stops every worker instead), so under it
  the heartbeat alone decides. A new ``Heartbeat`` on that GPU (a process that joined on it)
  takes the report back.

``event`` names one failure of the job (the Controller's re-formation count): the same on every
survivor, new for each failure, so that marks of an earlier failure are never read.
"""

from __future__ import annotations

import atexit
import threading
import time

import torch.distributed as dist

BEAT = "beat/{}"
ALL = "beat/all"  # every beat of every rank adds 1 here too (a launcher sees the job is alive)
ALIVE = "alive/{}/{}"
DEAD = "dead/{}"


def report_dead(store: dist.Store, gpu: int) -> None:
    """GPU ``gpu``'s process ended without finishing (``store``: the job's, ``regroup.job_store``)."""
    store.set(DEAD.format(gpu), b"1")


class Heartbeat:
    """A daemon thread beating ``beat/{gpu}`` in ``store`` (``regroup.job_store``) every
    ``interval`` seconds, on a connection of its own (``store.clone()``: a store client is not safe across threads)."""

    def __init__(self, store: dist.Store, gpu: int, interval: float = 0.1):
        self.store, self.key, self.interval = store.clone(), BEAT.format(gpu), interval
        self.store.delete_key(DEAD.format(gpu))  # a process that died on this GPU before is not this one
        self._stop = threading.Event()
        self.store.add(self.key, 1)  # the first beat before the constructor returns
        self._thread = threading.Thread(target=self._run, name=f"nereus-heartbeat-{gpu}", daemon=True)
        self._thread.start()
        # stopped before the interpreter finalizes: a daemon thread caught inside the store's C++
        # call at exit is unwound by force there, which aborts the process (std::terminate)
        atexit.register(self.stop)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.store.add(self.key, 1)
                self.store.add(ALL, 1)
            except Exception:  # noqa: BLE001 - the store's host is gone: nothing to beat into
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.interval + 1)


def survivors(
    store: dist.Store,
    members: list[int],
    me: int,
    event: int,
    *,
    timeout: float = 60.0,
    stale: float = 1.5,
    poll: float = 0.05,
) -> list[int]:
    """The members (GPU ids) alive after a failure, ascending; see the module docstring. ``me``
    must be a member; every survivor calls this with the same ``members`` and ``event``."""
    if me not in members:
        raise ValueError(f"GPU {me} is not one of the job's members {members}")
    store.set(ALIVE.format(event, me), b"1")
    now = time.monotonic()
    deadline = now + timeout
    beats = {m: store.add(BEAT.format(m), 0) for m in members}
    moved = dict.fromkeys(members, now)  # when each member's beat last moved (as seen from here)
    alive: set[int] = set()
    while True:
        now = time.monotonic()
        dead = set()
        for m in members:
            if m in alive:
                continue
            if store.check([ALIVE.format(event, m)]):
                alive.add(m)
                continue
            if store.check([DEAD.format(m)]):  # its launcher saw it end
                dead.add(m)
                continue
            beat = store.add(BEAT.format(m), 0)
            if beat != beats[m]:
                beats[m], moved[m] = beat, now
            elif now - moved[m] > stale:
                dead.add(m)
        if len(alive) + len(dead) == len(members):
            return sorted(alive)
        if now > deadline:
            waiting = sorted(set(members) - alive - dead)
            raise TimeoutError(
                f"after {timeout:.0f} s GPUs {waiting} neither reported alive nor stopped beating (failure {event})"
            )
        time.sleep(poll)
