"""The reshard cases on NVIDIA GPUs with NCCL: the prepared check for a machine with 4 or 8 GPUs.

    torchrun --nproc-per-node 4 benchmarks/gpu_reshard.py            # or 8
    torchrun --nproc-per-node 8 benchmarks/gpu_reshard.py --hidden 2048

Each rank runs on cuda:LOCAL_RANK; the shards of plan A are cut from deterministic full tensors
on the GPU; every case is lowered, executed by ``nereus.runtime.execute`` on NCCL (best of
``--repeats``), and every destination shard is compared bit for bit with the full tensor. Rank 0
prints one line per case: wall seconds, GB this rank group sent, and the ratio to a bound of
the busiest rank's bytes over the NCCL ring bandwidth measured in the same run.

It needs one GPU per rank (NCCL refuses two ranks on one device). This project's CI machines
have no GPU: until a run of this script is recorded in docs/PERFORMANCE.md, the NCCL path is
untested.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from nereus.backend.lower import lower
from nereus.passes.transition.plan_transition import plan_transition
from nereus.runtime.execute import execute
from nereus.runtime.launch import init_from_env
from nereus.runtime.state import cut, full_tensor
from nereus.testing.cases import CASES, case_module


def ring_bandwidth(nbytes: int, device, repeats: int = 3) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    send = torch.ones(nbytes, dtype=torch.uint8, device=device)
    recv = torch.empty_like(send)
    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        ops = [dist.P2POp(dist.isend, send, (rank + 1) % world), dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        torch.cuda.synchronize(device)
        t = torch.tensor([time.perf_counter() - t0], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        best = min(best, t.item())
    return nbytes / best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=None, help="model width (default: the CPU benchmark's sizes)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    device = init_from_env(timeout=300, backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    bw = ring_bandwidth(256 * 2**20, device)
    if rank == 0:
        print(f"NCCL ring bandwidth per rank: {bw / 1e9:.1f} GB/s ({world} GPUs)")
    for case in CASES:
        m = case_module(case, world, hidden=args.hidden)
        m.transitions["t"] = plan_transition(m, "a", "b", "t")
        prog = lower(m, "t")
        src = {s.key: cut(full_tensor(s), s.box).clone().to(device) for s in prog.src.get(rank, [])}
        best = float("inf")
        for _ in range(args.repeats):
            dist.barrier()
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            new = execute(prog, src, device=device, timeout=300)
            torch.cuda.synchronize(device)
            dist.barrier()
            best = min(best, time.perf_counter() - t0)
        bad = sum(not torch.equal(new[s.key].cpu(), cut(full_tensor(s), s.box)) for s in prog.dst.get(rank, []))
        flags = torch.tensor([bad], device=device)
        dist.all_reduce(flags)
        bound = max(prog.received_bytes(r) for r in range(world)) / bw
        sent = sum(prog.sent_bytes(r) for r in range(world))
        if rank == 0:
            print(
                f"{case:10s} x{world}: {best:.4f} s, {sent / 1e9:.2f} GB sent, {best / bound:.2f} x bound, "
                f"{'bit-exact' if flags.item() == 0 else f'{int(flags.item())} WRONG shards'}",
                flush=True,
            )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
