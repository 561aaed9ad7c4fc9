"""The simulator's largest moves, taken out of a run and timed alone: `remap`, `plan-transition`
and `schedule-transfers` on exactly the module the decision core built at those steps, so that
two versions of the passes can be timed against each other, alternated, on the same input.

    python benchmarks/simulator_moves.py dump nereus/sim/traces/combined.jsonl --steps 933,934 --dir /tmp/moves
    python benchmarks/simulator_moves.py time /tmp/moves --steps 933,934

`dump` runs the Nereus policy alone (`nereus simulate --policies nereus --jobs 1`) up to the
last step named and, at each, pickles the module and the pass the decision core's pipeline
applies for `remap` (plan-search done), for `plan-transition` (remap done, with the lower bound
remap left in the module's analyses, which a pickle does not carry) and for
`schedule-transfers`; it stops there. A
plan search stops at a wall-clock limit, so on a loaded machine a dump can hold another plan B
than a run on an idle one: time two versions on the same dump. `time` prints one JSON line per
pass and step: seconds; for remap its bytes before and after and a hash of plan B's meshes; for the
others operations, their dependencies, bytes moved, and a hash of every operation (kind, slices, endpoints, bytes,
dependencies, and after scheduling start and duration) that two versions must share. To
time another checkout's passes, run `time` with PYTHONPATH pointing at that checkout.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pickle
import sys
import time
from pathlib import Path


def _hash(t, scheduled: bool) -> str:
    h = hashlib.sha256()
    for op in t.ops:
        row = (
            op.id,
            op.kind,
            op.state,
            op.family,
            op.layers,
            op.box,
            [str(r) for r in op.src],
            [str(r) for r in op.dst],
            op.bytes,
            op.link,
            op.deps,
        ) + ((op.start, op.duration) if scheduled else ())
        h.update(repr(row).encode())
    return h.hexdigest()[:16]


def dump(trace_path: str, steps: set[int], out: Path) -> None:
    import nereus.control.decide as decide
    from nereus.cli import _trace_job
    from nereus.passes.schedule.schedule_transfers import ScheduleTransfers
    from nereus.passes.transition.plan_transition import PlanTransition
    from nereus.passes.transition.remap import Remap
    from nereus.sim.simulate import simulate
    from nereus.sim.trace import read_trace

    out.mkdir(parents=True, exist_ok=True)
    at = {"step": None}
    replan = decide.DecisionCore._replan

    def replan_at(self, step, *args):
        at["step"] = step
        return replan(self, step, *args)

    def keeping(cls, kind):
        apply = cls.apply

        def apply_and_keep(self, m):
            if at["step"] in steps:
                bound = None
                if kind == "plan":  # remap's bytes after, which the pass finds in the module's analyses
                    source, target = self.source, self.to
                    bound = m.analyses.find(m, "lower-bound", (source, target), frozenset(self.lost or ()))
                with open(out / f"{kind}{at['step']}.pkl", "wb") as f:
                    pickle.dump((m, self, bound), f, protocol=5)
                if kind == "schedule":
                    t = m.transitions[self.transition]
                    print(f"dumped step {at['step']}: {len(t.ops):,} operations", flush=True)
                    if at["step"] == max(steps):
                        raise SystemExit(0)
            return apply(self, m)

        cls.apply = apply_and_keep

    applies = [(cls, cls.apply) for cls in (Remap, PlanTransition, ScheduleTransfers)]
    decide.DecisionCore._replan = replan_at
    keeping(Remap, "remap")
    keeping(PlanTransition, "plan")
    keeping(ScheduleTransfers, "schedule")
    try:
        trace = read_trace(trace_path)
        simulate(_trace_job(trace, trace_path), trace, ["nereus"], progress=False, jobs=1)
    finally:  # the passes as they were, for a `time` in the same process
        decide.DecisionCore._replan = replan
        for cls, apply in applies:
            cls.apply = apply
    sys.exit(f"no move at steps {sorted(steps)}: nothing dumped for the steps without one")


def time_passes(where: Path, steps: list[int]) -> None:
    """Each dumped pass applied to its dumped module, as the decision core's pipeline applies it."""
    missing = [
        str(where / f"{kind}{step}.pkl")
        for step in steps
        for kind in ("remap", "plan", "schedule")
        if not (where / f"{kind}{step}.pkl").exists()
    ]
    if missing:
        sys.exit(f"no dump of these steps: {', '.join(missing)} (run `dump` for them first)")
    for step in steps:
        with open(where / f"remap{step}.pkl", "rb") as f:
            m, p, _ = pickle.load(f)
        target = p.to
        t0 = time.perf_counter()
        p.apply(m)
        rec = m.plans[target].remap
        meshes = hashlib.sha256(repr(sorted((ms, lay.mesh) for ms, lay in m.plans[target].layouts.items())).encode())
        print(
            json.dumps(
                {
                    "step": step,
                    "pass": "remap",
                    "s": round(time.perf_counter() - t0, 2),
                    "bytes_before": rec.before,
                    "bytes_after": rec.after,
                    "hash": meshes.hexdigest()[:16],
                }
            ),
            flush=True,
        )
        del m
        with open(where / f"plan{step}.pkl", "rb") as f:
            m, p, bound = pickle.load(f)
        if bound is not None:
            m.analyses.put(m, "lower-bound", (p.source, p.to), frozenset(p.lost or ()), bound)
        t0 = time.perf_counter()
        p.apply(m)
        t = m.transitions[p.into]
        print(
            json.dumps(
                {
                    "step": step,
                    "pass": "plan-transition",
                    "s": round(time.perf_counter() - t0, 2),
                    "ops": len(t.ops),
                    "deps": sum(len(op.deps) for op in t.ops),
                    "bytes_moved": t.bytes_moved,
                    "hash": _hash(t, False),
                }
            ),
            flush=True,
        )
        del m, t
        with open(where / f"schedule{step}.pkl", "rb") as f:
            m, p, _ = pickle.load(f)
        t = m.transitions[p.transition]
        t0 = time.perf_counter()
        p.apply(m)
        print(
            json.dumps(
                {
                    "step": step,
                    "pass": "schedule-transfers",
                    "s": round(time.perf_counter() - t0, 2),
                    "ops": len(t.ops),
                    "makespan_s": t.makespan,
                    "port_bound_s": t.port_bound,
                    "hash": _hash(t, True),
                }
            ),
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump", help="run Nereus on a trace and pickle the passes' inputs at the steps")
    d.add_argument("trace")
    d.add_argument("--steps", required=True, help="comma-separated steps whose re-plan moves")
    d.add_argument("--dir", required=True)
    t = sub.add_parser("time", help="time remap, plan-transition and schedule-transfers on the dumped inputs")
    t.add_argument("dir")
    t.add_argument("--steps", required=True)
    args = ap.parse_args()
    steps = [int(s) for s in args.steps.split(",")]
    if args.cmd == "dump":
        dump(args.trace, set(steps), Path(args.dir))
    else:
        time_passes(Path(args.dir), steps)


if __name__ == "__main__":
    main()
