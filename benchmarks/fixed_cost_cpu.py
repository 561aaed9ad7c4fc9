"""The CPU seconds of a transition that moves nothing (plan A to plan A: the digest exchange, the
commit agreement, the set-up and commit of every shard the rank keeps), summed over the ranks and
per rank, on gloo processes of this machine; and of one exchange of the kind the digest and the
agreement make (``runtime.execute._share``, a value to every peer point to point).

    python benchmarks/fixed_cost_cpu.py [--world 4] [--case dp4-dp2] [--repeats 100]

``nereus bench reshard`` reports the same transition's wall time (slowest rank, best of 20);
this splits its CPU, which the wall time on a 2-core machine does not show.
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _worker(rank: int, world: int, port: int, case: str, repeats: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from nereus.backend.lower import lower
    from nereus.passes import run_pipeline
    from nereus.runtime.execute import _share, execute
    from nereus.runtime.state import synthetic_state
    from nereus.testing.cases import case_module

    m = case_module(case, world)
    run_pipeline(m, "plan-transition{source=@a,to=@a,into=@same}")
    prog = lower(m, "same")
    src = synthetic_state(prog.src.get(rank, []))
    for _ in range(5):  # connections made, caches warm
        execute(prog, src, timeout=60)
    dist.barrier()
    cpu = time.process_time()
    for _ in range(repeats):
        execute(prog, src, timeout=60)
    transition = (time.process_time() - cpu) / repeats
    dist.barrier()
    cpu = time.process_time()
    for _ in range(repeats):
        works, _ = _share(rank, rank, world, "cpu", 2)
        for w in works:
            w.wait()
    exchange = (time.process_time() - cpu) / repeats
    out.put((rank, transition, exchange, len(prog.src.get(rank, []))))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--case", default="dp4-dp2", help="a case of nereus.testing.cases")
    ap.add_argument("--repeats", type=int, default=100)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, args.world, port, args.case, args.repeats, out)) for r in range(args.world)
    ]
    for p in procs:
        p.start()
    rows = sorted(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    ms = 1e3
    print(f"{args.case} on {args.world} ranks, {rows[0][3]} shards on rank 0")
    print(
        f"transition that moves nothing: {sum(r[1] for r in rows) * ms:.2f} CPU ms summed over ranks "
        f"({', '.join(f'{r[1] * ms:.2f}' for r in rows)} per rank)"
    )
    print(f"one exchange to every peer: {sum(r[2] for r in rows) * ms:.2f} CPU ms summed over ranks")


if __name__ == "__main__":
    main()
