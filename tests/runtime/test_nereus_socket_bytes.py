"""Nereus's bytes sent, checked the way the peers' are: against what each process writes to its
sockets (``/proc/self/io`` ``wchar``) while ``execute`` runs, on real gloo processes.

The counter is ``Program.sent_bytes(rank)``, the payload the program sends. What a rank writes
during ``execute`` is that payload plus, and nothing else:

- a checksum per data message: 8 bytes (an int64, sent as one vector per peer and round);
- gloo's tcp rendezvous, 48 bytes per notice (one ``Op`` preamble: six 64-bit fields): a send
  writes a send-ready notice and the data's own preamble (96 bytes), a receive writes a
  receive-ready notice (48 bytes); data messages and checksum vectors alike;
- a fixed part per call: the program-digest all-gather before the first message and the commit
  agreement (an all-reduce) after the last. It does not depend on the program: it is measured
  here as what ``execute`` writes for a transition that moves nothing (plan A to plan A).

The check is exact: written == payload + checksums + notices + fixed part, on every rank. The
cases use the default lowering (``broadcast=auto``) and ``p2p``; neither creates broadcast
subgroups on these cases (asserted), whose tree broadcasts and group set-up would need their
own accounting.
"""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from nereus.backend.lower import lower
from nereus.passes import run_pipeline
from nereus.runtime.execute import Stats, execute
from nereus.runtime.launch import init_from_env, run_local
from nereus.runtime.state import synthetic_state
from nereus.testing.cases import CASES, case_module

CHECKSUM = 8
NOTICE = 48  # gloo/transport/tcp: sizeof(Op::preamble)

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs /proc/self/io (Linux)")


def _written() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))


def _measure(prog, rank: int) -> tuple[int, int]:
    """(bytes this process wrote during ``execute``, the counter ``Stats.sent``)."""
    src = synthetic_state(prog.src.get(rank, []))
    stats = Stats()
    dist.barrier()
    before = _written()
    execute(prog, src, timeout=60, stats=stats)
    return _written() - before, stats.sent


def worker(rank: int, world: int, cases: tuple[str, ...], modes: tuple[str, ...]) -> list[dict]:
    init_from_env(timeout=60)
    m = case_module(cases[0], world, hidden=64, layers=4)
    run_pipeline(m, "plan-transition{source=@a,to=@a,into=@same}")
    nothing = lower(m, "same")
    assert all(s.kind not in ("round", "broadcast") for s in nothing.steps.get(rank, []))
    fixed = [_measure(nothing, rank)[0] for _ in range(2)]
    out = []
    for case in cases:
        m = case_module(case, world, hidden=64, layers=4)
        run_pipeline(m, "plan-transition{to=@b,into=@t}")
        for mode in modes:
            prog = lower(m, "t", broadcast=mode)
            rounds = [s for s in prog.steps.get(rank, []) if s.kind == "round"]
            data_sends = sum(len(s.sends) for s in rounds)
            data_recvs = sum(len(s.recvs) for s in rounds)
            sum_sends = sum(len({msg.receiver for msg in s.sends}) for s in rounds)  # checksum vectors out
            sum_recvs = sum(len({msg.sender for msg in s.recvs}) for s in rounds)  # and in
            written, counted = _measure(prog, rank)
            out.append(
                {
                    "case": case,
                    "mode": mode,
                    "written": written,
                    "counter": prog.sent_bytes(rank),
                    "stats_sent": counted,
                    "groups": len(prog.groups),
                    "fixed": fixed,
                    "overhead": CHECKSUM * data_sends
                    + 2 * NOTICE * (data_sends + sum_sends)
                    + NOTICE * (data_recvs + sum_recvs),
                }
            )
    return out


def _check(results: list[list[dict]]) -> None:
    for rank, rows in enumerate(results):
        for row in rows:
            fixed = row["fixed"]
            # the same every call, and small: a few notices and 8-byte values per peer
            assert fixed[0] == fixed[1] and 0 < fixed[0] < 1024 * len(results), (rank, fixed)
            assert row["groups"] == 0, row
            assert row["stats_sent"] == row["counter"], (rank, row)
            want = row["counter"] + row["overhead"] + fixed[0]
            assert row["written"] == want, (rank, row["case"], row["mode"], row["written"] - want, row)


@pytest.mark.slow
def test_bytes_written_to_sockets_are_the_counter_plus_stated_overhead_on_4_ranks():
    _check(run_local(worker, 4, CASES, ("auto", "p2p"), timeout=300))


@pytest.mark.slow
def test_scale_in_on_8_ranks():
    # half the ranks leave (they only send), and DP replicas in plan A (a choice of senders)
    _check(run_local(worker, 8, ("tp4-tp2", "tp4-tp2x2"), ("auto",), timeout=300))
