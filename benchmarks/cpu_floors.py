"""What any resharding method pays on this machine before it does anything clever: the floors
behind `nereus bench reshard`'s full-replication case.

    python benchmarks/cpu_floors.py [--procs 4] [--mb 231] [--alloc-mb 309]

On `--procs` gloo processes at once (best of 3, slowest rank, between barriers):
- wire, all-to-all: every rank sends MB / (procs - 1) to every other rank (preallocated, touched
  buffers: no packing, no checksums, no allocation);
- wire, ring: every rank sends MB to its neighbour;
- allocate and first-touch ALLOC_MB on every rank (torch.empty + fill): the kernel zeroes the
  pages of a fresh destination, which every method that builds plan B's tensors pays.

TP 4 -> TP 1 x DP 4 on 4 processes receives 231 MiB per rank into 309 MiB of new weights.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from nereus.runtime.launch import init_from_env, run_local


def _best(fn, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        t = time.perf_counter()
        fn()
        dist.barrier()
        best = min(best, time.perf_counter() - t)
    return best


def worker(rank: int, world: int, mb: int, alloc_mb: int) -> dict:
    init_from_env(timeout=300)
    n = mb * 2**20
    per = n // (world - 1)
    out_a2a = torch.ones(per, dtype=torch.uint8)
    in_a2a = [torch.ones(per, dtype=torch.uint8) for _ in range(world)]
    out_ring, in_ring = torch.ones(n, dtype=torch.uint8), torch.ones(n, dtype=torch.uint8)
    peers = [p for p in range(world) if p != rank]

    def a2a():
        ops = [dist.P2POp(dist.irecv, in_a2a[p], p) for p in peers] + [
            dist.P2POp(dist.isend, out_a2a, p) for p in peers
        ]
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    def ring():
        ops = [
            dist.P2POp(dist.irecv, in_ring, (rank - 1) % world),
            dist.P2POp(dist.isend, out_ring, (rank + 1) % world),
        ]
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    def alloc():
        torch.empty(alloc_mb * 2**20, dtype=torch.uint8).fill_(1)

    return {"wire all-to-all": _best(a2a), "wire ring": _best(ring), "allocate + first touch": _best(alloc)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--mb", type=int, default=231, help="MiB each rank receives")
    ap.add_argument("--alloc-mb", type=int, default=309, help="MiB each rank allocates for plan B")
    args = ap.parse_args()
    results = run_local(worker, args.procs, args.mb, args.alloc_mb, timeout=600)
    for what in results[0]:
        print(f"{what:24s} {max(r[what] for r in results):.3f} s")


if __name__ == "__main__":
    main()
