"""``nereus bench transition``: planning and scheduling a transition of the 70B job, against the
bytes and modeled time of the strategies peers use.

Cases, on the 70B PPO job (actor and critic train with TP 8 x PP 4, colocated on every GPU):
1. both trained models from TP 8 x PP 4 to TP 4 x PP 8 (weights, fp32 master and Adam moments);
2. 64 GPUs (8 whole nodes) are reclaimed with notice: every layout keeps TP and PP and shrinks
   its DP to the GPUs left; the leaving GPUs still send their state. (Had they failed, ZeRO-1's
   optimizer shards on them would be lost: the planner reports exactly that, since no other
   GPU holds those shards.)
3. both trained models from TP 8 x PP 4 with ZeRO-1 to TP 4 with ZeRO-3 over all the GPUs (DP
   256 at 1,024 GPUs): every weight, master and moment sliced 256 ways, each new slice gathered
   from the four pipeline stages that held its layers (the widest moves the simulator's decision
   core makes, at steps 810-934 of ``combined``);
4. case 1 with no memory to spare: each GPU's memory is the larger of its state under plan A
   and under plan B, as when activations and the KV cache fill the rest. No GPU can hold its
   old and new shards at once: what does not fit beside the old state is staged through host
   memory (``unstage``), which the time to beat includes.
5. case 3 backwards, with no memory to spare: out of ZeRO-3, every new slice gathered from the
   GPUs that each held 1/256 of it, and most of it staged through host memory (the move the
   simulator's decision core is forced into at step 934 of ``combined``, when GPUs leave).

Peers reshard only the model-stages whose pieces differ between plan A and plan B (a model-stage
with the same layout on the same GPUs stays put, as in any real system), each from its own
plan-A pieces, and are costed with Nereus's links: a send and a receive port per GPU and link
kind, NVLink inside a node and the NIC across, each at ``bandwidth x efficiency`` with the
efficiencies of the cluster's cost model (``schedule-transfers`` times its buckets with the
same); their time is the busiest port's, the bound Nereus's schedule is compared with.

- all-gather then slice (verl's resharding of training weights): every GPU of plan B assembles,
  for each tensor and each layer of it that it needs, the whole tensor of that layer, less what
  it already holds of it; each missing source box comes from a holder in its node over NVLink if
  there is one, else over the NIC (shared evenly among the holders);
- gather to one rank then broadcast (OpenRLHF's weight sync): the model-stage's plan-A rank 0
  assembles every tensor plan B holds (same sourcing), then a pipelined broadcast (a chain that
  crosses each node boundary once) hands all of it to every other GPU of plan B's layout;
- DCP save and load: every distinct plan-A piece written once (ZeRO shards included: each DP
  rank's is distinct; replicas written once, the writes balanced over their holders), every
  plan-B piece read back; each GPU's traffic goes through its NIC, and all of it through
  ``STORAGE_GBPS`` of aggregate storage bandwidth (a fast parallel file system for a
  1,024-GPU cluster; state the figure you have).

Nereus's time is its scheduled makespan; the peers' times are port bounds: no schedule of
their traffic is shorter. A last column gives the bytes after ``remap`` renames plan B's GPUs
(nodes kept together) to keep the most state in place, and its time.
"""

from __future__ import annotations

import copy
import time
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
from rich.console import Console
from rich.table import Table

from ..ir import parse, verify
from ..ir.model import state_dtype_bytes
from ..passes import CostModel, parse_pipeline
from ..passes.transition.derive_emus import derive_missing_emus
from ..passes.transition.holdings import plan_holdings, state_bytes
from ..testing.jobs import ppo_70b

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
            lay.mesh = alive[first : first + lay.dp * per]
    m2.plans[c.name] = c
    yield "DP 32 -> 30: 64 GPUs reclaimed", m2, "ppo70b_p0", "dp_shrunk"
    m4 = copy.deepcopy(base)
    z = copy.deepcopy(a)
    z.name = "zero3"
    for ms in ("actor.train", "critic.train"):
        lay = z.layouts[ms]
        lay.tp, lay.pp, lay.vpp, lay.zero = 4, 1, 1, 3
        lay.dp = len(lay.mesh) // 4
        lay.layers = [(0, 79)]
    m4.plans[z.name] = z
    yield "TP8 PP4 ZeRO-1 -> TP4 ZeRO-3", m4, "ppo70b_p0", "zero3"
    for plan in ("ppo70b_p0", "tp4pp8"):
        derive_missing_emus(tight, plan)
    before, after_ = state_bytes(tight, "ppo70b_p0"), state_bytes(tight, "tp4pp8")
    tight.clusters[a.cluster].gpu_memory = max(
        max(before.get(g, 0), after_.get(g, 0)) for g in set(before) | set(after_)
    )
    yield "TP8 PP4 -> TP4 PP8, no memory to spare", tight, "ppo70b_p0", "tp4pp8"
    back = copy.deepcopy(base)
    back.plans[z.name] = copy.deepcopy(z)
    for plan in ("zero3", "ppo70b_p0"):
        derive_missing_emus(back, plan)
    before, after_ = state_bytes(back, "zero3"), state_bytes(back, "ppo70b_p0")
    back.clusters[a.cluster].gpu_memory = max(
        max(before.get(g, 0), after_.get(g, 0)) for g in set(before) | set(after_)
    )
    yield "TP4 ZeRO-3 -> TP8 PP4 ZeRO-1, no memory to spare", back, "zero3", "ppo70b_p0"


@dataclass
class PeerCost:
    """What one peer strategy costs on one transition."""

    bytes: int  # over links (NVLink + NIC); for DCP, written to and read from storage
    seconds: float  # port bound: the busiest port's bytes over its link (see ``Ports``)
    nvlink_bytes: int = 0
    nic_bytes: int = 0


class Ports:
    """Busy time of every GPU's ports, as ``schedule-transfers`` models them: a send and a receive
    port per link kind (NVLink inside a node, the NIC across nodes), each moving
    ``bandwidth x efficiency`` bytes a second with the efficiencies of the cluster's cost model.
    ``seconds`` is the busiest port's time, the bound Nereus's schedules are held to (per-message
    latencies, microseconds, are left out)."""

    def __init__(self, cluster, efficiency):
        self.rate = {
            "nvlink": cluster.intra_node.bandwidth * efficiency.nvlink,
            "nic": cluster.inter_node.bandwidth * efficiency.nic,
        }
        self.busy = {(d, link): np.zeros(cluster.num_gpus) for d in ("send", "recv") for link in self.rate}
        self.node_of = cluster.node_of

    def move(self, src: int, dst: int, link: str, nbytes: float) -> None:
        self.send(src, link, nbytes)
        self.recv(dst, link, nbytes)

    def send(self, gpus, link: str, nbytes) -> None:
        np.add.at(self.busy[("send", link)], gpus, nbytes)

    def recv(self, gpus, link: str, nbytes) -> None:
        np.add.at(self.busy[("recv", link)], gpus, nbytes)

    def seconds(self) -> float:
        return max(float(b.max()) / self.rate[link] for (_, link), b in self.busy.items())

    def cost(self) -> PeerCost:
        nv, nic = round(self.busy[("recv", "nvlink")].sum()), round(self.busy[("recv", "nic")].sum())
        return PeerCost(nv + nic, self.seconds(), nv, nic)


def by_model_stage(holdings) -> dict[str, dict[tuple, list]]:
    """model-stage -> (model, state, family) -> its pieces."""
    out: dict[str, dict[tuple, list]] = defaultdict(lambda: defaultdict(list))
    for key, pieces in holdings.items():
        for p in pieces:
            out[p.ref.model_stage][key].append(p)
    return out


def changed_model_stages(src: dict, dst: dict) -> list[str]:
    """Model-stages whose pieces (tensor, GPU, region) differ between the plans: the only ones a
    real system reshards. A model-stage plan B drops needs nothing."""

    def signature(per_key):
        return {(key, p.gpu, p.region) for key, pieces in per_key.items() for p in pieces}

    return sorted(ms for ms in dst if signature(dst[ms]) != signature(src.get(ms, {})))


def _layer_box(model, key, region) -> tuple[int, int, tuple]:
    """(first layer, end layer, box within one layer) of a region; a family without a layer axis
    is one 'layer' [0, 1)."""
    if model.tensors[key[2]].per_layer:
        (lo, hi), rest = region[0], tuple(region[1:])
        return lo, hi, rest
    return 0, 1, tuple(region)


def gather_tensors(
    ports: Ports, m, ms: str, key: tuple, src_pieces: list, needs: dict[int, list[tuple[int, int]]]
) -> None:
    """Every GPU ``g`` of ``needs`` (GPU -> layer ranges) assembles the whole tensor of ``key``
    for each layer it needs, from the model-stage's own plan-A pieces: every distinct source box
    of those layers it does not hold itself arrives from a holder, one inside its node over
    NVLink when there is one (shared evenly among them), else over the NIC (shared evenly among
    all holders). Bytes = full tensor of each needed layer less what ``g`` holds of it."""
    model = m.models[key[0]]
    spec = model.tensors[key[2]]
    itemsize = state_dtype_bytes(model, key[1])
    layers = model.layers if spec.per_layer else 1
    boxes: dict[tuple, list[int]] = {}
    for p in src_pieces:
        boxes.setdefault(p.region, []).append(p.gpu)
    if not boxes:
        raise ValueError(f"{ms}: plan A holds no {key}; a peer has nowhere to gather it from")
    regions = list(boxes)
    lo_hi_v = [_layer_box(model, key, r) for r in regions]
    la = np.array([x[0] for x in lo_hi_v])
    lb = np.array([x[1] for x in lo_hi_v])
    vol = np.array([_vol(x[2]) * itemsize for x in lo_hi_v], dtype=np.float64)
    # the distinct boxes tile every layer: each layer's boxes add up to the tensor
    cover = np.zeros(layers + 1)
    np.add.at(cover, la, vol)
    np.add.at(cover, lb, -vol)
    if not np.allclose(np.cumsum(cover)[:layers], spec.numel() * itemsize):
        raise ValueError(f"{ms}: the distinct plan-A boxes of {key} do not tile the tensor")
    gpus = sorted(needs)
    need = np.zeros((len(gpus), layers), dtype=np.int64)
    for i, g in enumerate(gpus):
        for lo, hi in needs[g]:
            need[i, lo:hi] = 1
    cum = np.concatenate([np.zeros((len(gpus), 1), dtype=np.int64), np.cumsum(need, axis=1)], axis=1)
    overlap = cum[:, lb] - cum[:, la]  # layers of box b that GPU i needs
    gidx = {g: i for i, g in enumerate(gpus)}
    holds = np.zeros_like(overlap, dtype=bool)
    node_of = ports.node_of
    nodes = sorted({node_of(g) for g in gpus} | {node_of(h) for hs in boxes.values() for h in hs})
    nidx = {n: i for i, n in enumerate(nodes)}
    in_node = np.zeros((len(regions), len(nodes)), dtype=np.int64)  # holders of box b in each node
    for b, r in enumerate(regions):
        for h in boxes[r]:
            in_node[b, nidx[node_of(h)]] += 1
            if h in gidx:
                holds[gidx[h], b] = True
    recv_node = np.array([nidx[node_of(g)] for g in gpus])
    nbytes = np.where(holds, 0.0, overlap * vol[None, :])
    near = in_node[:, recv_node].T > 0  # GPU i has a holder of box b in its node
    nv, nic = np.where(near, nbytes, 0.0), np.where(near, 0.0, nbytes)
    ports.recv(gpus, "nvlink", nv.sum(axis=1))
    ports.recv(gpus, "nic", nic.sum(axis=1))
    order = np.argsort(recv_node, kind="stable")
    first = np.flatnonzero(np.r_[True, np.diff(recv_node[order]) != 0])
    nv_demand = np.zeros((len(regions), len(nodes)))  # box x node: bytes its holders there send over NVLink
    nv_demand[:, recv_node[order][first]] = np.add.reduceat(nv[order], first, axis=0).T
    nic_demand = nic.sum(axis=0)
    senders, links, amounts = [], [], []
    for b, r in enumerate(regions):
        hs = boxes[r]
        for h in hs:
            n = nidx[node_of(h)]
            if nv_demand[b, n]:
                senders.append(h), links.append(0), amounts.append(nv_demand[b, n] / in_node[b, n])
            if nic_demand[b]:
                senders.append(h), links.append(1), amounts.append(nic_demand[b] / len(hs))
    senders, links, amounts = np.array(senders, dtype=np.int64), np.array(links), np.array(amounts)
    ports.send(senders[links == 0], "nvlink", amounts[links == 0])
    ports.send(senders[links == 1], "nic", amounts[links == 1])


def _needs(m, key: tuple, pieces: list) -> dict[int, list[tuple[int, int]]]:
    """GPU -> the layer ranges of ``key`` it holds (needs) among ``pieces``."""
    model = m.models[key[0]]
    out: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for p in pieces:
        lo, hi, _ = _layer_box(model, key, p.region)
        out[p.gpu].append((lo, hi))
    return out


def peers(m, source: str, target: str) -> dict[str, PeerCost]:
    """What each peer strategy moves and how long its busiest port takes; see the module docstring."""
    cluster = m.clusters[m.plans[target].cluster]
    eff = CostModel(cluster).efficiency
    src, dst = by_model_stage(plan_holdings(m, source)), by_model_stage(plan_holdings(m, target))
    changed = changed_model_stages(src, dst)
    nic_rate = cluster.inter_node.bandwidth * eff.nic

    # all-gather then slice (verl): per tensor and layer it needs, the whole tensor, less what it holds
    ag = Ports(cluster, eff)
    for ms in changed:
        for key, pieces in dst[ms].items():
            gather_tensors(ag, m, ms, key, src[ms].get(key, []), _needs(m, key, pieces))
    # gather to one rank, then broadcast (OpenRLHF): the model-stage's plan-A rank 0 assembles every
    # tensor plan B holds, then a pipelined broadcast (a chain, root's node first) gives it whole
    # to every other GPU of plan B's layout
    gb = Ports(cluster, eff)
    for ms in changed:
        first = next(p for pieces in src[ms].values() for p in pieces if (p.ref.dp, p.ref.pp, p.ref.tp) == (0, 0, 0))
        root = first.gpu
        total = 0
        for key in dst[ms]:
            model = m.models[key[0]]
            spec = model.tensors[key[2]]
            layers = model.layers if spec.per_layer else 1
            gather_tensors(gb, m, ms, key, src[ms].get(key, []), {root: [(0, layers)]})
            total += spec.numel() * layers * state_dtype_bytes(model, key[1])
        receivers = sorted(
            {p.gpu for pieces in dst[ms].values() for p in pieces} - {root},
            key=lambda g: (cluster.node_of(g) != cluster.node_of(root), g),
        )
        for a, b in zip([root] + receivers, receivers):
            gb.move(a, b, "nvlink" if cluster.node_of(a) == cluster.node_of(b) else "nic", total)
    # DCP save + load: every distinct plan-A piece written once (replicas deduplicated, the writes
    # balanced over the holders, as DCP's save planner does), every plan-B piece read; each GPU's
    # traffic goes through its NIC, all of it through the storage's aggregate bandwidth
    written: dict[int, float] = defaultdict(float)
    read: dict[int, float] = defaultdict(float)
    for ms in changed:
        distinct: dict[tuple, list[int]] = {}
        sizes: dict[tuple, int] = {}
        for key, pieces in src[ms].items():
            itemsize = state_dtype_bytes(m.models[key[0]], key[1])
            for p in pieces:
                distinct.setdefault((key, p.region), []).append(p.gpu)
                sizes[(key, p.region)] = _vol(p.region) * itemsize
        for box in sorted(distinct, key=lambda b: -sizes[b]):
            writer = min(distinct[box], key=lambda g: (written[g], g))
            written[writer] += sizes[box]
        for key, pieces in dst[ms].items():
            itemsize = state_dtype_bytes(m.models[key[0]], key[1])
            for p in pieces:
                read[p.gpu] += _vol(p.region) * itemsize
    storage = STORAGE_GBPS * 1e9
    w, r = sum(written.values()), sum(read.values())
    dcp_time = max(w / storage, max(written.values(), default=0) / nic_rate) + max(
        r / storage, max(read.values(), default=0) / nic_rate
    )
    return {
        "all-gather + slice": ag.cost(),
        "gather + broadcast": gb.cost(),
        "DCP save + load": PeerCost(round(w + r), dcp_time),
    }


def _vol(region) -> int:
    n = 1
    for lo, hi in region:
        n *= hi - lo
    return n


def apply_passes(m, spec: str) -> None:
    """The passes of ``spec`` and those they require (derive-emus), applied without the verifier
    that ``run_pipeline`` runs after each: the planning time is the passes' own (the verifier's
    time on the result is timed apart, ``verify_s``)."""
    for p in parse_pipeline(spec):
        for q in p.requires(m):
            q.apply(m)
        p.apply(m)


def run(quick: bool = False, json_output: bool = False, gpus: int | None = None, time_limit: float = 3.0) -> dict:
    gpus = gpus or (128 if quick else 1024)
    rows = []
    for label, m, source, target in cases(gpus):
        verify(m)
        # planning time counts deriving the EMUs the pass needs (derive-emus, which it requires)
        t0 = time.perf_counter()
        apply_passes(
            m, f"plan-transition{{source=@{source},to=@{target},into=@t,drain=true}}"
        )  # reclaimed GPUs still send
        t1 = time.perf_counter()
        t = m.transitions["t"]
        apply_passes(m, f"schedule-transfers{{transition=@t,time_limit={time_limit}}}")
        t2 = time.perf_counter()
        verify(m)  # what run_pipeline would add: the verifier on the planned and scheduled module
        t_verify = time.perf_counter() - t2
        row = {
            "case": label,
            "gpus": gpus,
            "ops": len(t.ops),
            "plan_s": round(t1 - t0, 2),
            "schedule_s": round(t2 - t1, 2),
            "verify_s": round(t_verify, 2),
            "bytes_moved": t.bytes_moved,
            "lower_bound": t.lower_bound,
            "bytes_ratio": round(t.bytes_moved / t.lower_bound, 4) if t.lower_bound else 1.0,
            "makespan_s": t.makespan,
            "port_bound_s": t.port_bound,
            "makespan_ratio": round(t.makespan / t.port_bound, 3) if t.port_bound else 1.0,
            "schedule_status": t.schedule_status,
            "staged_bytes": sum(op.bytes for op in t.ops if op.kind == "unstage"),
            "peers": {},
        }
        t3 = time.perf_counter()
        costs = peers(m, source, target)
        row["peers_model_s"] = round(time.perf_counter() - t3, 2)
        for name, c in costs.items():
            row["peers"][name] = {
                "bytes": c.bytes,
                "nvlink_bytes": c.nvlink_bytes,
                "nic_bytes": c.nic_bytes,
                "seconds": round(c.seconds, 3),
                "bytes_vs_nereus": round(c.bytes / max(t.bytes_moved, 1), 2),
                "time_vs_nereus": round(c.seconds / t.makespan, 2) if t.makespan else None,
            }
        # what remap saves: plan B's GPUs renamed (node-preserving) before planning
        placed = copy.deepcopy(m)
        placed.transitions.clear()
        t3 = time.perf_counter()
        apply_passes(placed, f"remap{{source=@{source},to=@{target},drain=true}}")
        row["remap_s"] = round(time.perf_counter() - t3, 2)
        rec = placed.plans[target].remap
        apply_passes(placed, f"plan-transition{{source=@{source},to=@{target},into=@t,drain=true}}")
        row["remap_bytes"] = placed.transitions["t"].lower_bound
        assert row["remap_bytes"] == rec.after
        rows.append(row)
    result = {"benchmark": "transition", "gpus": gpus, "storage_gbps": STORAGE_GBPS, "rows": rows}
    if not json_output:
        console = Console(width=200)
        t = Table(title=f"transitions of the 70B PPO job on {gpus} GPUs", title_justify="left")
        for col in (
            "case",
            "ops",
            "plan s",
            "schedule s",
            "verify s",
            "bytes moved",
            "vs lower bound",
            "staged",
            "makespan",
            "vs port bound",
            "status",
            "after remap",
            "remap s",
        ):
            t.add_column(col, justify="left" if col == "case" else "right")
        for r in rows:
            t.add_row(
                r["case"],
                f"{r['ops']:,}",
                f"{r['plan_s']:.2f}",
                f"{r['schedule_s']:.2f}",
                f"{r['verify_s']:.2f}",
                f"{r['bytes_moved'] / 2**30:,.1f} GiB",
                f"{r['bytes_ratio']:.3f}",
                f"{r['staged_bytes'] / 2**30:,.1f} GiB",
                f"{r['makespan_s']:.3f} s",
                f"{r['makespan_ratio']:.3f}",
                r["schedule_status"],
                f"{r['remap_bytes'] / 2**30:,.1f} GiB",
                f"{r['remap_s']:.2f}",
            )
        console.print(t)
        p = Table(
            title="peers on the model-stages that change, same links and efficiencies (bytes; port-bound time)",
            title_justify="left",
        )
        for col in ("case", "strategy", "bytes", "NVLink", "NIC", "x Nereus bytes", "time", "x Nereus time"):
            p.add_column(col, justify="left" if col in ("case", "strategy") else "right")
        for r in rows:
            p.add_row(
                r["case"],
                "Nereus",
                f"{r['bytes_moved'] / 2**30:,.1f} GiB",
                "",
                "",
                "1.00",
                f"{r['makespan_s']:.3f} s",
                "1.00",
            )
            for name, v in r["peers"].items():
                split = [f"{v[k] / 2**30:,.1f} GiB" if v[k] else "" for k in ("nvlink_bytes", "nic_bytes")]
                p.add_row(
                    "",
                    name,
                    f"{v['bytes'] / 2**30:,.1f} GiB",
                    *split,
                    f"{v['bytes_vs_nereus']:.2f}",
                    f"{v['seconds']:.3f} s",
                    f"{v['time_vs_nereus']:.2f}",
                )
        console.print(p)
    return result
