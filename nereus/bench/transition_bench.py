"""``nereus bench transition``: planning and scheduling a transition of the 70B job, against the
bytes and modeled time of the strategies peers use.

Cases, on the 70B PPO job (actor and critic train with TP 8 x PP 4, colocated on every GPU):
1. both trained models from TP 8 x PP 4 to TP 4 x PP 8 (weights, fp32 master and Adam moments);
2. 64 GPUs (8 whole nodes) are reclaimed with notice: every layout keeps TP and PP and shrinks
   its DP to the GPUs left; the leaving GPUs still send their state. (Had they failed, ZeRO-1's
   optimizer shards on them would be lost: the planner reports exactly that, since no other
   GPU holds those shards.)
3. case 1 with no memory to spare: each GPU's memory is the larger of its state under plan A
   and under plan B, as when activations and the KV cache fill the rest. No GPU can hold its
   old and new shards at once: what does not fit beside the old state is staged through host
   memory (``unstage``), which the time to beat includes.

Peers, costed with the same links (per-GPU NVLink inside a node, NIC across) and efficiencies:
- all-gather then slice (verl's resharding of training weights): every destination GPU
  gathers the whole state of each tensor it needs, then keeps its slice;
- gather to one rank then broadcast (OpenRLHF's weight sync): rank 0 of each model receives
  the whole state, then broadcasts all of it to every GPU of the model's destination layout;
- DCP save and load: every source byte written once to shared storage, every destination slice
  read back; storage bandwidth assumed ``STORAGE_GBPS`` aggregate for writes and reads (a fast
  parallel file system for a 1,024-GPU cluster; state the figure you have).
Nereus's time is the scheduled makespan; the peers' times are port-bound estimates (the busiest
GPU's bytes over its link), which flatters them. A last column gives the bytes after ``remap``
renames plan B's GPUs (nodes kept together) to keep the most state in place, and its time.
"""

from __future__ import annotations

import copy
import time
from collections import defaultdict

from rich.console import Console
from rich.table import Table

from ..ir import parse, verify
from ..ir.model import state_dtype_bytes
from ..testing.jobs import ppo_70b
from ..passes import CostModel, run_pipeline
from ..passes.derive_emus import derive_missing_emus
from ..passes.plan_transition import plan_holdings, state_bytes

STORAGE_GBPS = 400.0  # aggregate shared-storage bandwidth assumed for DCP (GB/s)
TARGET_PLAN_S = 5.0
TARGET_RATIO = 1.10


def cases(gpus: int):
    base = parse(ppo_70b(gpus, with_emus=False))
    a = base.plans["ppo70b_p0"]
    m1 = copy.deepcopy(base)
    b = copy.deepcopy(a)
    b.name = "tp4pp8"
    for ms in ("actor.train", "critic.train"):
        lay = b.layouts[ms]
        lay.tp, lay.pp = 4, 8
        lay.layers = [(i * 10, i * 10 + 9) for i in range(8)]
    m1.plans[b.name] = b
    tight = copy.deepcopy(m1)
    yield "TP8 PP4 -> TP4 PP8", m1, "ppo70b_p0", "tp4pp8"
    m2 = copy.deepcopy(base)
    after = copy.deepcopy(m2.clusters[a.cluster])
    after.name = "after_loss"
    lost = list(range(gpus - 64, gpus))  # the last 8 nodes
    after.unavailable = lost
    m2.clusters[after.name] = after
    c = copy.deepcopy(a)
    c.name = "dp_shrunk"
    c.cluster = after.name
    alive = [g for g in range(gpus) if g not in set(lost)]
    # every layout keeps its TP and PP and shrinks its DP to the survivors; the four inference
    # model-stages still split the GPUs in four
    w = m2.workloads[c.workload]
    for st in w.stages:
        mss = st.model_stages()
        share = len(alive) // len(mss) if st.kind == "infer" else len(alive)
        for i, ms in enumerate(mss):
            lay = c.layouts[ms]
            per = lay.tp * lay.pp
            lay.dp = share // per
            first = i * share if st.kind == "infer" else 0
            lay.mesh = alive[first:first + lay.dp * per]
    m2.plans[c.name] = c
    yield "DP 32 -> 30: 64 GPUs reclaimed", m2, "ppo70b_p0", "dp_shrunk"
    for plan in ("ppo70b_p0", "tp4pp8"):
        derive_missing_emus(tight, plan)
    before, after_ = state_bytes(tight, "ppo70b_p0"), state_bytes(tight, "tp4pp8")
    tight.clusters[a.cluster].gpu_memory = max(max(before.get(g, 0), after_.get(g, 0)) for g in set(before) | set(after_))
    yield "TP8 PP4 -> TP4 PP8, no memory to spare", tight, "ppo70b_p0", "tp4pp8"


def peers(m, source: str, target: str) -> dict[str, tuple[int, float]]:
    """(bytes over links, modeled seconds) for each peer strategy."""
    cluster = m.clusters[m.plans[target].cluster]
    eff = CostModel(cluster).efficiency
    nic = cluster.inter_node.bandwidth * eff.nic
    src, dst = plan_holdings(m, source), plan_holdings(m, target)
    full: dict[tuple, int] = {}
    for key, pieces in src.items():
        model = m.models[key[0]]
        spec = model.tensors[key[2]]
        n = spec.numel() * (model.layers if spec.per_layer else 1)
        full[key] = n * state_dtype_bytes(model, key[1])
    # all-gather then slice: each destination GPU receives each needed tensor whole (less what it has)
    ag_recv: dict[int, int] = defaultdict(int)
    held: dict[tuple, int] = defaultdict(int)
    for key, pieces in src.items():
        per_gpu = defaultdict(int)
        for p in pieces:
            per_gpu[p.gpu] += _vol(p.region)
        for g, v in per_gpu.items():
            held[(key, g)] = v * state_dtype_bytes(m.models[key[0]], key[1])
    for key, pieces in dst.items():
        for g in {p.gpu for p in pieces}:
            ag_recv[g] += max(full[key] - held[(key, g)], 0)
    ag_bytes = sum(ag_recv.values())
    ag_time = max(ag_recv.values(), default=0) / nic
    # gather to rank 0, then broadcast to every destination GPU of the model
    gb_bytes, gb_time_per_model = 0, defaultdict(float)
    by_model: dict[str, int] = defaultdict(int)
    gpus_of: dict[str, set] = defaultdict(set)
    for key, pieces in dst.items():
        by_model[key[0]] += full[key]
        gpus_of[key[0]] |= {p.gpu for p in pieces}
    for model_name, nbytes in by_model.items():
        gb_bytes += nbytes + nbytes * (len(gpus_of[model_name]) - 1)
        gb_time_per_model[model_name] = 2 * nbytes / nic  # receive it all, then a pipelined broadcast
    gb_time = sum(gb_time_per_model.values())  # one model after another through its rank 0
    # DCP: write every source byte once, read every destination slice
    written = sum(_vol(p.region) * state_dtype_bytes(m.models[k[0]], k[1]) for k, ps in src.items() for p in ps
                  if p.ref.dp == 0)  # one replica's copy is saved
    read = sum(_vol(p.region) * state_dtype_bytes(m.models[k[0]], k[1]) for k, ps in dst.items() for p in ps)
    dcp_time = written / (STORAGE_GBPS * 1e9) + read / (STORAGE_GBPS * 1e9)
    return {"all-gather + slice": (ag_bytes, ag_time), "gather + broadcast": (gb_bytes, gb_time),
            "DCP save + load": (written + read, dcp_time)}


def _vol(region) -> int:
    n = 1
    for lo, hi in region:
        n *= hi - lo
    return n


def run(quick: bool = False, json_output: bool = False, gpus: int | None = None, time_limit: float = 3.0) -> dict:
    gpus = gpus or (128 if quick else 1024)
    rows = []
    for label, m, source, target in cases(gpus):
        verify(m)
        # planning time counts deriving the EMUs the pass needs (derive-emus, run by the pipeline)
        t0 = time.perf_counter()
        run_pipeline(m, f"plan-transition{{source=@{source},to=@{target},into=@t,drain=true}}")  # reclaimed GPUs still send
        t1 = time.perf_counter()
        t = m.transitions["t"]
        run_pipeline(m, f"schedule-transfers{{transition=@t,time_limit={time_limit}}}")
        t2 = time.perf_counter()
        row = {"case": label, "gpus": gpus, "ops": len(t.ops), "plan_s": round(t1 - t0, 2), "schedule_s": round(t2 - t1, 2),
               "bytes_moved": t.bytes_moved, "lower_bound": t.lower_bound,
               "bytes_ratio": round(t.bytes_moved / t.lower_bound, 4) if t.lower_bound else 1.0,
               "makespan_s": t.makespan, "port_bound_s": t.port_bound,
               "makespan_ratio": round(t.makespan / t.port_bound, 3) if t.port_bound else 1.0,
               "schedule_status": t.schedule_status,
               "staged_bytes": sum(op.bytes for op in t.ops if op.kind == "unstage"), "peers": {}}
        for name, (nbytes, seconds) in peers(m, source, target).items():
            row["peers"][name] = {"bytes": nbytes, "seconds": round(seconds, 3),
                                  "bytes_vs_nereus": round(nbytes / max(t.bytes_moved, 1), 2),
                                  "time_vs_nereus": round(seconds / t.makespan, 2) if t.makespan else None}
        # what remap saves: plan B's GPUs renamed (node-preserving) before planning
        placed = copy.deepcopy(m)
        placed.transitions.clear()
        t3 = time.perf_counter()
        run_pipeline(placed, f"remap{{source=@{source},to=@{target},drain=true}}")
        row["remap_s"] = round(time.perf_counter() - t3, 2)
        rec = placed.plans[target].remap
        run_pipeline(placed, f"plan-transition{{source=@{source},to=@{target},into=@t,drain=true}}")
        row["remap_bytes"] = placed.transitions["t"].lower_bound
        assert row["remap_bytes"] == rec.after
        rows.append(row)
    result = {"benchmark": "transition", "gpus": gpus, "storage_gbps": STORAGE_GBPS, "rows": rows}
    if not json_output:
        console = Console(width=200)
        t = Table(title=f"transitions of the 70B PPO job on {gpus} GPUs", title_justify="left")
        for col in ("case", "ops", "plan s", "schedule s", "bytes moved", "vs lower bound", "staged", "makespan",
                    "vs port bound", "status", "after remap", "remap s"):
            t.add_column(col, justify="left" if col == "case" else "right")
        for r in rows:
            t.add_row(r["case"], f"{r['ops']:,}", f"{r['plan_s']:.2f}", f"{r['schedule_s']:.2f}", f"{r['bytes_moved'] / 2**30:,.1f} GiB",
                      f"{r['bytes_ratio']:.3f}", f"{r['staged_bytes'] / 2**30:,.1f} GiB", f"{r['makespan_s']:.3f} s",
                      f"{r['makespan_ratio']:.3f}", r["schedule_status"], f"{r['remap_bytes'] / 2**30:,.1f} GiB",
                      f"{r['remap_s']:.2f}")
        console.print(t)
        p = Table(title="peers, same links (bytes over links; modeled time)", title_justify="left")
        for col in ("case", "strategy", "bytes", "x Nereus bytes", "time", "x Nereus time"):
            p.add_column(col, justify="left" if col in ("case", "strategy") else "right")
        for r in rows:
            p.add_row(r["case"], "Nereus", f"{r['bytes_moved'] / 2**30:,.1f} GiB", "1.00", f"{r['makespan_s']:.3f} s", "1.00")
            for name, v in r["peers"].items():
                p.add_row("", name, f"{v['bytes'] / 2**30:,.1f} GiB", f"{v['bytes_vs_nereus']:.2f}", f"{v['seconds']:.3f} s",
                          f"{v['time_vs_nereus']:.2f}")
        console.print(p)
    return result
