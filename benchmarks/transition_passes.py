"""The planning and scheduling of `nereus bench transition`'s cases, without its peers, remap
and verifier: the same `plan-transition` and `schedule-transfers` calls `run()` makes, so that
two versions of the passes can be timed against each other, alternated, on one case at a time.

    python benchmarks/transition_passes.py [--gpus 1024] [--cases 3,5]

Prints one JSON line per case: operations (unstages among them), plan and schedule seconds,
makespan, port bound, bytes moved and lower bound. To time another checkout's passes, run this
file with PYTHONPATH pointing at that checkout.
"""

from __future__ import annotations

import argparse
import collections
import json
import time

from nereus.bench.transition_bench import apply_passes, cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=1024)
    ap.add_argument("--cases", default="1,2,3,4,5", help="1-based case numbers, comma-separated")
    ap.add_argument("--time-limit", type=float, default=3.0, help="schedule-transfers' (as the bench's default)")
    args = ap.parse_args()
    which = {int(x) for x in args.cases.split(",")}
    for i, (label, m, source, target) in enumerate(cases(args.gpus), 1):
        if i not in which:
            continue
        t0 = time.perf_counter()
        apply_passes(m, f"plan-transition{{source=@{source},to=@{target},into=@t,drain=true}}")
        t1 = time.perf_counter()
        apply_passes(m, f"schedule-transfers{{transition=@t,time_limit={args.time_limit}}}")
        t2 = time.perf_counter()
        t = m.transitions["t"]
        kinds = collections.Counter(op.kind for op in t.ops)
        print(
            json.dumps(
                {
                    "case": i,
                    "label": label,
                    "gpus": args.gpus,
                    "ops": len(t.ops),
                    "unstages": kinds.get("unstage", 0),
                    "plan_s": round(t1 - t0, 2),
                    "schedule_s": round(t2 - t1, 2),
                    "makespan_s": t.makespan,
                    "port_bound_s": t.port_bound,
                    "bytes_moved": t.bytes_moved,
                    "lower_bound": t.lower_bound,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
