"""``nereus bench reshard``: live state moved between layouts by real processes, Nereus vs its peers.

Every case of ``nereus.testing.cases`` (TP 4 -> 2 x DP 2 and back, TP 4 -> 2 on half the GPUs, PP 2 -> 4,
DP 4 -> 2 under ZeRO-1, a training layout -> full replication for generation; a mixture of
experts from EP 4 to EP 2, and to generation's TP 2 x EP 2), on 4 and 8
gloo processes of this machine, each method in turn on the same synthetic state:

- ``nereus``: the transition planned by ``plan-transition``, lowered by ``lower-collectives``
  and run by ``runtime.execute`` (checksums and commit included);
- ``nereus+remap``: the same after ``remap`` renamed plan B's GPUs to keep the most state in
  place (the same layout on other GPUs: the peers' cost does not depend on which GPU plays which
  part, since they move whole tensors);
- ``dcp``: PyTorch DCP save under plan A, then load into plan B's boxes (``runtime.dcp``);
- ``allgather``: every rank all-gathers every tensor, then slices (verl's resharding);
- ``gather+bcast``: rank 0 gathers every tensor, then broadcasts it (OpenRLHF's weight sync);
- ``holder-bcast``: every distinct source box broadcast whole by one of its holders (the
  broadcast of whole experts that slime and NeMo-RL sync experts with);
- ``floor`` (not a peer): an unchecked minimal point-to-point exchange of the same bytes
  (``testing.peers.p2p_floor``), what safety is held against: ``nereus / floor``.

Wall time is the slowest rank's, between barriers, best of 2 runs (5 with ``--quick``). CPU
seconds (``cpu_s``: ``time.process_time`` of every rank in the method's call, summed over the
ranks, the least over the runs) are the stable measure on a shared machine: ``cpu_over_floor``
is Nereus's safety (checksums, digest and commit collectives) against the unchecked floor;
``packed_per_byte`` and ``hashed_per_byte`` the bytes Nereus copied into or out of message
buffers and checksummed, per byte it sent (all ranks).
``best peer / floor`` is the most any exchange of the same bytes could show against the peers
here: where it is under 2x, so is Nereus's ratio, whatever its overhead. Every method's result is checked bit for bit
against the full tensors (outside the timing). The peers plan inside their timed region (which
rank sends which box, the buckets); Nereus plans before it: ``plan-transition`` and
``lower-collectives`` (``remap`` too for ``nereus+remap``) are timed on their own, on rank 0
while the other ranks wait (each rank of a job plans on its own CPU; here 4-8 processes share 2
cores), and reported beside the transfer with their sum ("total"). Both ratios to the best peer
are given: transfer only, and total. The EMUs of both plans (derived when a case is built) are
the layouts every method starts from and are not timed for anyone.

Nereus's bytes are its counter (``Stats.sent``, the program's payload); beside it, what its
processes wrote to their sockets during ``execute`` (``/proc/self/io`` ``wchar``): the payload
plus 8-byte checksums, gloo's 48-byte rendezvous notices and the digest and commit collectives
(``tests/runtime/test_nereus_socket_bytes.py`` checks that account to the byte). The lower bound on time: the bytes
the busiest
rank must receive (what it lacks under plan B: the planner's lower bound, per rank) over the
bandwidth every rank gets when all send at once, measured in the same run with a ring of
simultaneous sends (``ring_bandwidth``) before every case; the bound uses the best measurement,
so that a busy moment of the machine cannot flatter the ratio.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from ..backend.lower import lower
from ..passes import run_pipeline
from ..runtime.execute import Stats, execute
from ..runtime.launch import init_from_env, run_local
from ..runtime.state import cut, full_tensor, synthetic_state
from ..testing.cases import CASES, case_module

METHODS = ("nereus", "nereus+remap", "floor", "dcp", "allgather", "gather+bcast", "holder-bcast")
PEERS = METHODS[3:]


def _exact(dst_specs, new) -> bool:
    return set(new) == {s.key for s in dst_specs} and all(
        torch.equal(new[s.key].cpu(), cut(full_tensor(s), s.box)) for s in dst_specs
    )


def _written() -> int:
    """Bytes this process has passed to write-like system calls (0 where /proc/self/io is missing)."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))
    except OSError:
        return 0


def _method(method: str, prog, src, rank: int, world: int, path: str):
    """Run one method on this rank: (its plan-B state, bytes it sent, bytes written to sockets or
    None, and for Nereus the bytes it packed and hashed, else None)."""
    from ..runtime.dcp import dcp_reshard
    from .baselines.peers import allgather_slice, gather_broadcast, holder_broadcast, p2p_floor

    if method.startswith("nereus"):
        stats = Stats()
        before = _written()
        new = execute(prog, src, timeout=600, stats=stats)
        return new, stats.sent, _written() - before, (stats.packed, stats.hashed)
    if method == "dcp":  # writes files too: its wchar is not socket traffic
        return *dcp_reshard(src, prog.src, prog.dst, rank, world, path), None, None
    if method == "floor":  # planned outside the timing, as Nereus's program is
        return *p2p_floor(src, _floor_plan(prog, rank, world)), None, None
    if method == "allgather":
        return *allgather_slice(src, prog.src, prog.dst, rank, world), None, None
    if method == "holder-bcast":
        return *holder_broadcast(src, prog.src, prog.dst, rank, world), None, None
    return *gather_broadcast(src, prog.src, prog.dst, rank, world), None, None


_FLOOR_PLANS: dict = {}


def _floor_plan(prog, rank: int, world: int):
    from .baselines.peers import p2p_floor_plan

    key = (id(prog), rank)
    if key not in _FLOOR_PLANS:
        _FLOOR_PLANS[key] = (prog, p2p_floor_plan(prog.src, prog.dst, rank, world))  # prog kept: ids stay unique
    return _FLOOR_PLANS[key][1]


def _plan(case: str, world: int, hidden: int | None, remap: bool):
    """Nereus's planning and lowering of ``case`` (the module with both plans' EMUs is built first,
    untimed): (program, seconds)."""
    m = case_module(case, world, hidden=hidden)
    t0 = time.perf_counter()
    run_pipeline(m, ("remap{to=@b}," if remap else "") + "plan-transition{to=@b,into=@t}")
    prog = lower(m, "t")
    return prog, time.perf_counter() - t0


def _fixed_cost(case: str, world: int, hidden: int | None, rank: int, repeats: int = 20) -> float:
    """Seconds of a transition that moves nothing (plan A to plan A: the digest exchange, the
    commit agreement, keeping every shard), slowest rank between barriers, best of ``repeats``."""
    m = case_module(case, world, hidden=hidden)
    run_pipeline(m, "plan-transition{source=@a,to=@a,into=@same}")
    prog = lower(m, "same")
    src = synthetic_state(prog.src.get(rank, []))
    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        execute(prog, src, timeout=60)
        dist.barrier()
        best = min(best, time.perf_counter() - t0)
    return best


def _connect_all(rank: int, world: int, device) -> None:
    """A tiny message between every pair of ranks: gloo connects a pair at its first message, so
    without this the first method to talk to a peer would pay for the connection."""
    peers = [p for p in range(world) if p != rank]
    bufs = [torch.empty(8, dtype=torch.uint8, device=device) for _ in peers]
    ops = [dist.P2POp(dist.isend, torch.zeros(8, dtype=torch.uint8, device=device), p) for p in peers]
    ops += [dist.P2POp(dist.irecv, b, p) for b, p in zip(bufs, peers)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    dist.barrier()


def worker(
    rank: int, world: int, cases: list[str], hidden: int | None, ring_bytes: int, tmp: str, repeats: int
) -> dict:
    """On every rank: the ring bandwidth, then each case with each method (best of ``repeats``)."""
    from .baselines.peers import ring_bandwidth

    device = init_from_env(timeout=600)  # gloo on CPU; NCCL with one GPU per rank (untested here)
    _connect_all(rank, world, device)
    out = {"ring": ring_bandwidth(ring_bytes, rank, world), "fixed": _fixed_cost(cases[0], world, hidden, rank)}
    if rank == 0:  # warm-up, untimed: the first remap imports scipy's assignment solver (~0.3 s)
        _plan(cases[0], world, hidden, True)
    for case in cases:
        # the bound must hold in the worst case for us: the best bandwidth seen during the run
        out["ring"] = max(out["ring"], ring_bandwidth(ring_bytes, rank, world))
        # planning + lowering: every rank needs the program; rank 0's is timed while the others wait
        if rank != 0:
            prog, _ = _plan(case, world, hidden, False)
            programs = {"nereus+remap": _plan(case, world, hidden, True)[0]}
        dist.barrier()
        plan_s = [0.0, 0.0]
        if rank == 0:
            prog, plan_s[0] = _plan(case, world, hidden, False)
            remapped, plan_s[1] = _plan(case, world, hidden, True)
            programs = {"nereus+remap": remapped}
        dist.barrier()
        src = {k: v.to(device) for k, v in synthetic_state(prog.src.get(rank, [])).items()}
        for p in (prog, programs["nereus+remap"]):
            _floor_plan(p, rank, world)
        row = {
            "must_receive": prog.received_bytes(rank),
            "held": sum(s.nbytes for s in prog.src.get(rank, [])),
            "must_receive_remap": programs["nereus+remap"].received_bytes(rank),
            "plan_s": {"nereus": plan_s[0], "nereus+remap": plan_s[1]},
        }
        if case == cases[0]:
            # warm-up, untimed: every method once. A process's first large allocations are
            # slower (the allocator's thresholds adapt to the sizes it sees), and without this
            # whichever method runs first pays for it (measured: 0.70 s for Nereus on TP 4 ->
            # TP 2 x DP 2 as the first case, 0.26 s as a later one)
            for method in METHODS:
                dist.barrier()
                _method(method, programs.get(method, prog), src, rank, world, str(Path(tmp) / f"warm-{world}"))
        for method in METHODS:
            run_prog = programs.get(method, prog)
            dst_specs = run_prog.dst.get(rank, [])
            best = None
            cpu = []  # this rank's CPU seconds in each run (summed over ranks in ``run``)
            for i in range(repeats):
                path = str(Path(tmp) / f"{case}-{world}-{i}")
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                new, sent, written, work = _method(method, run_prog, src, rank, world, path)
                c1 = time.process_time()
                dist.barrier()
                secs = time.perf_counter() - t0
                cpu.append(c1 - c0)
                exact = _exact(dst_specs, new)
                del new
                if best is None or secs < best["seconds"]:
                    best = {"seconds": secs, "sent": sent, "written": written, "exact": exact, "work": work}
                best["exact"] = best["exact"] and exact
            best["cpu"] = cpu
            row[method] = best
        out[case] = row
    return out


def run(quick: bool = False, json_output: bool = False, cases: list[str] | None = None) -> dict:
    worlds = (4,) if quick else (4, 8)
    cases = cases or (["tp4-tp2x2", "train-gen"] if quick else list(CASES))
    hidden = 128 if quick else None
    ring_bytes = (4 if quick else 64) * 2**20
    results: dict = {"cases": {}, "ring_GBps": {}}
    with (
        Progress(transient=True, disable=json_output) as progress,
        tempfile.TemporaryDirectory(prefix="nereus-reshard-") as tmp,
    ):
        task = progress.add_task("reshard: 4 methods x cases on gloo processes", total=len(worlds))
        for world in worlds:
            per_rank = run_local(worker, world, cases, hidden, ring_bytes, tmp, 5 if quick else 2, timeout=3600)
            ring = min(r["ring"] for r in per_rank)
            results["ring_GBps"][world] = ring / 1e9
            results.setdefault("fixed_ms", {})[world] = 1e3 * max(r["fixed"] for r in per_rank)
            for case in cases:
                rows = [r[case] for r in per_rank]
                bound = max(r["must_receive"] for r in rows) / ring
                entry = {
                    "state_MB": sum(r["held"] for r in rows) / 1e6,
                    "bound_s": bound,
                    "bound_remap_s": max(r["must_receive_remap"] for r in rows) / ring,
                }
                for method in METHODS:
                    entry[method] = {
                        "seconds": max(r[method]["seconds"] for r in rows),
                        # CPU seconds of all ranks in one run, the least over the runs: stable where
                        # wall time is not (4-8 processes on 2 cores wait for each other)
                        "cpu_s": min(map(sum, zip(*(r[method]["cpu"] for r in rows)))),
                        "sent_MB": sum(r[method]["sent"] for r in rows) / 1e6,
                        "exact": all(r[method]["exact"] for r in rows),
                    }
                    if method.startswith("nereus"):
                        e = entry[method]
                        e["written_MB"] = sum(r[method]["written"] for r in rows) / 1e6
                        # per byte sent, over all ranks: bytes packed or unpacked, and checksummed
                        e["packed_per_byte"] = sum(r[method]["work"][0] for r in rows) / max(1e6 * e["sent_MB"], 1)
                        e["hashed_per_byte"] = sum(r[method]["work"][1] for r in rows) / max(1e6 * e["sent_MB"], 1)
                        e["plan_s"] = rows[0]["plan_s"][method]  # rank 0, alone
                        e["total_s"] = e["plan_s"] + e["seconds"]
                best_peer = min(entry[m]["seconds"] for m in PEERS)
                entry["best_peer_over_floor"] = best_peer / entry["floor"]["seconds"]  # what any exchange could show
                for method in ("nereus", "nereus+remap"):
                    entry[method]["over_floor"] = entry[method]["seconds"] / entry["floor"]["seconds"]
                    entry[method]["cpu_over_floor"] = entry[method]["cpu_s"] / entry["floor"]["cpu_s"]
                    entry[method]["best_peer_over_transfer"] = best_peer / entry[method]["seconds"]
                    entry[method]["best_peer_over_total"] = best_peer / entry[method]["total_s"]
                entry["planned_MB"] = sum(r["must_receive"] for r in rows) / 1e6
                entry["planned_remap_MB"] = sum(r["must_receive_remap"] for r in rows) / 1e6
                results["cases"][f"{case} x{world}"] = entry
            progress.advance(task)
    if not json_output:
        _table(results)
    return results


def _table(results: dict) -> None:
    t = Table(
        title="reshard: live state between layouts, gloo on this machine (wall s, MB; all bit-exact unless marked). "
        "plan = plan-transition + lower (+ remap) on rank 0; total = plan + transfer; the peers plan inside "
        "their transfer time",
        title_justify="left",
    )
    for col in (
        "case x procs",
        "state MB",
        "bound s",
        "plan s",
        "nereus s",
        "total s",
        "floor s",
        "nereus / floor",
        "CPU s: nereus / floor (all ranks)",
        "best peer / floor",
        "dcp s",
        "allgather s",
        "gather+bcast s",
        "holder-bcast s",
        "best peer / nereus (transfer)",
        "(total)",
        "nereus / bound",
        "nereus MB",
        "packed / hashed per byte",
        "socket MB",
        "planned MB",
        "+remap plan s",
        "+remap s",
        "+remap total s",
        "best peer / +remap (transfer)",
        "(total) ",
        "+remap MB",
    ):
        t.add_column(col, justify="right" if col != "case x procs" else "left")

    def cell(e, method):
        v = e[method]
        return f"{v['seconds']:.3f}" + ("" if v["exact"] else " WRONG")

    for name, e in results["cases"].items():
        n, r = e["nereus"], e["nereus+remap"]
        t.add_row(
            name,
            f"{e['state_MB']:.0f}",
            f"{e['bound_s']:.2f}",
            f"{n['plan_s']:.2f}",
            cell(e, "nereus"),
            f"{n['total_s']:.2f}",
            cell(e, "floor"),
            f"{n['over_floor']:.2f}",
            f"{n['cpu_s']:.3f} / {e['floor']['cpu_s']:.3f} = {n['cpu_over_floor']:.2f}",
            f"{e['best_peer_over_floor']:.1f}x",
            cell(e, "dcp"),
            cell(e, "allgather"),
            cell(e, "gather+bcast"),
            cell(e, "holder-bcast"),
            f"{n['best_peer_over_transfer']:.1f}x",
            f"{n['best_peer_over_total']:.1f}x",
            f"{n['seconds'] / e['bound_s']:.2f}",
            f"{n['sent_MB']:.0f}",
            f"{n['packed_per_byte']:.2f} / {n['hashed_per_byte']:.2f}",
            f"{n['written_MB']:.1f}",
            f"{e['planned_MB']:.0f}",
            f"{r['plan_s']:.2f}",
            cell(e, "nereus+remap"),
            f"{r['total_s']:.2f}",
            f"{r['best_peer_over_transfer']:.1f}x",
            f"{r['best_peer_over_total']:.1f}x",
            f"{r['sent_MB']:.0f}",
        )
    Console(width=max(260, Console().width)).print(t)
    rings = ", ".join(f"{w} procs {v:.2f} GB/s" for w, v in results["ring_GBps"].items())
    Console().print(f"ring bandwidth per rank, all sending at once: {rings}")
    fixed = ", ".join(f"{w} procs {v:.1f} ms" for w, v in results.get("fixed_ms", {}).items())
    Console().print(f"fixed cost per transition (one that moves nothing: digest, agreement), best of 20: {fixed}")
