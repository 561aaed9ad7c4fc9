"""The survivors' agreement (``runtime.liveness``) on a real TCPStore, ranks as threads: a member
whose heartbeat stops is dead; a member that keeps beating is waited for, however late it marks
itself; every caller gets the same set; the wait is bounded. And ``runtime.dcp.uncovered`` (what
only the dead held) against a brute-force mask."""

from __future__ import annotations

import datetime
import random
import threading
import time

import numpy as np
import pytest
import torch.distributed as dist

from nereus.runtime.dcp import uncovered
from nereus.runtime.launch import free_port
from nereus.runtime.liveness import Heartbeat, report_dead, survivors


@pytest.fixture
def store():
    master = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, timeout=datetime.timedelta(seconds=10))
    yield master


def agree(store, members, callers, **kw) -> dict:
    out: dict = {}

    def call(me, delay):
        time.sleep(delay)
        try:
            out[me] = survivors(store.clone(), members, me, 0, **kw)
        except Exception as e:  # noqa: BLE001 - reported to the test
            out[me] = e

    threads = [threading.Thread(target=call, args=(me, delay)) for me, delay in callers.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return out


def test_a_member_whose_heartbeat_stops_is_dead_and_a_late_live_one_is_waited_for(store):
    beats = {g: Heartbeat(store, g, interval=0.05) for g in range(4)}
    beats[3].stop()  # GPU 3 dies: its beat stands still from now on
    # GPU 2 saw the failure late (a collective that waited), but beat all along
    out = agree(store, [0, 1, 2, 3], {0: 0.0, 1: 0.0, 2: 1.5}, timeout=10, stale=0.5)
    assert out == {0: [0, 1, 2], 1: [0, 1, 2], 2: [0, 1, 2]}
    for b in beats.values():
        b.stop()


def test_a_member_its_launcher_reports_dead_is_dead_at_once_and_a_new_heartbeat_takes_it_back(store):
    """``report_dead`` (``nereus launch``, ``run_local``: the process that reaped it) decides
    without waiting for the beat to stand still; a process that joins on that GPU later beats
    afresh, and is alive in the next failure."""
    beats = {g: Heartbeat(store, g, interval=0.05) for g in range(3)}
    beats[2].stop()
    report_dead(store, 2)
    t0 = time.monotonic()
    out = agree(store, [0, 1, 2], {0: 0.0, 1: 0.0}, timeout=10, stale=5.0)
    assert out == {0: [0, 1], 1: [0, 1]}
    assert time.monotonic() - t0 < 2.5  # not the 5 s a still beat would take
    beats[2] = Heartbeat(store, 2, interval=0.05)  # a joiner on GPU 2
    out = {}
    threads = [
        threading.Thread(
            target=lambda me=me: out.__setitem__(me, survivors(store.clone(), [0, 1, 2], me, 1, stale=5.0))
        )
        for me in (0, 1, 2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert out == {0: [0, 1, 2], 1: [0, 1, 2], 2: [0, 1, 2]}
    for b in beats.values():
        b.stop()


def test_the_wait_is_bounded(store):
    beats = {g: Heartbeat(store, g, interval=0.05) for g in range(2)}  # GPU 1 beats but never marks itself
    t0 = time.monotonic()
    out = agree(store, [0, 1], {0: 0.0}, timeout=1.0, stale=0.5)
    assert isinstance(out[0], TimeoutError) and "GPUs [1]" in str(out[0])
    assert time.monotonic() - t0 < 5
    for b in beats.values():
        b.stop()


def test_uncovered_is_exactly_the_cells_no_other_box_covers():
    rng = random.Random(0)
    for _ in range(400):
        shape = [rng.randint(1, 7) for _ in range(rng.randint(1, 3))]

        def box():
            spans = []
            for n in shape:
                lo = rng.randint(0, n - 1)
                spans.append((lo, rng.randint(lo + 1, n)))
            return tuple(spans)

        mine, others = box(), [box() for _ in range(rng.randint(0, 4))]
        want = np.zeros(shape, dtype=int)
        want[tuple(slice(lo, hi) for lo, hi in mine)] = 1
        for o in others:
            want[tuple(slice(lo, hi) for lo, hi in o)] = 0
        got = np.zeros(shape, dtype=int)
        for part in uncovered(mine, others):
            got[tuple(slice(lo, hi) for lo, hi in part)] += 1  # the parts do not overlap
        assert (got == want).all(), (mine, others)
