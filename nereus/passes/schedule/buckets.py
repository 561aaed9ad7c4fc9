"""Buckets of a transition's transfers: operations between the same sender and receivers over the same
link, packed as one contiguous buffer; the ports each holds and the precedences between them.

Part of ``schedule-transfers`` (``schedule_transfers.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import TypeAlias, cast

import numpy as np

from ...ir import HostRef, Module, Shard, Transition
from ..cost.cost_model import CostModel

TICK = 1e-6  # schedule resolution: 1 us
# (before, after) bucket pairs: ``bucket_precedences``' array of two columns, or a set of pairs (small cases, tests)
Precedences: TypeAlias = "np.ndarray | set[tuple[int, int]]"


@dataclass
class Bucket:
    src: int
    dsts: tuple[int, ...]
    link: str
    ops: list  # the transition's operations it carries, in order
    direction: str = "net"  # net | h2d (load) | d2h (offload)
    bytes: int = 0
    duration: int = 0  # ticks
    index: int = -1  # its place in ``buckets_of``'s list


def endpoint_gpu(m: Module, plan: str, ref) -> int:
    if isinstance(ref, HostRef):
        return ref.gpu
    return cast(Shard, m.emus[(plan, ref.model_stage, ref.dp)].shard(ref.pp, ref.tp)).gpu


def _gpus(m: Module, plan: str):
    """``endpoint_gpu`` under ``plan``, remembered per endpoint object (a transition names each shard
    many times, and plan-transition gives every operation on a shard the same reference). By
    identity, not by value: a reference's hash is its fields' (6.5 million hashes, 4 of the 15 s
    of bucketing the largest move of the combined trace); each entry keeps its reference, so an
    identity is never reused while remembered."""
    known: dict[int, tuple] = {}

    def gpu(ref) -> int:
        if type(ref) is HostRef:
            return ref.gpu
        hit = known.get(id(ref))
        if hit is None or hit[0] is not ref:
            hit = known[id(ref)] = (ref, endpoint_gpu(m, plan, ref))
        return hit[1]

    return gpu


def buckets_of(m: Module, t: Transition, model: CostModel) -> tuple[list[Bucket], np.ndarray]:
    """Group transfers into buckets; returns the buckets and each operation's bucket (an array
    in the order of ``t.ops``; -1 for an operation in none: local copies and frees)."""
    cluster = model.cluster
    eff = model.efficiency
    groups: dict[tuple, Bucket] = {}
    on_a, on_b = _gpus(m, t.source), _gpus(m, t.target)
    receivers: dict[tuple[int, str], tuple[int, ...]] = {}  # (id of a destination list, plan) -> GPUs
    where: list = [None] * len(t.ops)  # each operation's bucket, by position
    dsts: tuple[int, ...] | None
    facts: dict[str, tuple] = {}  # kind name -> what bucketing reads of it (``_kind_facts``)
    for k, op in enumerate(t.ops):
        f = facts.get(op.kind)
        if f is None:
            f = facts[op.kind] = _kind_facts(op.spec, on_a, on_b)
        local, ported, unstage, src_gpu, dst_gpu, dplan, direction = f
        if local and isinstance(op.dst[0], HostRef):  # a staged copy: device to host, over PCIe
            if direction == "net":
                direction = "d2h"
        elif not ported:
            continue  # local copies and frees use no port
        if unstage:  # host[g] onto GPU g (the verifier checks it)
            src = cast(HostRef, op.src[0]).gpu
            dsts = (src,)
        else:
            src = src_gpu(op.src[0])
            if len(op.dst) == 1:
                dsts = (dst_gpu(op.dst[0]),)
            else:  # a broadcast: plan-transition gives the operations of one group one list (alive all along)
                dsts = receivers.get((id(op.dst), dplan))
                if dsts is None:
                    dsts = receivers[(id(op.dst), dplan)] = tuple(sorted({dst_gpu(d) for d in op.dst}))
        # PCIe moves of different kinds go in different buckets: a staged copy, its unstage and
        # an offload after the unstage share a direction, and one bucket would order them in a
        # cycle. Unstages wait for a growing prefix of their GPU's frees: one bucket per prefix
        # (the number of dependencies tells them apart), so that the first need not wait for all
        phase = "" if direction == "net" else (op.kind, len(op.deps)) if unstage else (op.kind, 0)
        key = (src, dsts, op.link, direction, phase)
        b = groups.get(key)
        if b is None:
            b = groups[key] = Bucket(src, dsts, op.link, [], direction)
        b.ops.append(op)
        b.bytes += op.bytes
        where[k] = b
    out = [groups[k] for k in sorted(groups)]
    for i, b in enumerate(out):
        b.index = i
        if b.link == "nvlink":
            bw, lat, e = cluster.intra_node.bandwidth, cluster.intra_node.latency, eff.nvlink
        elif b.link == "pcie":
            link = cluster.host_link or cluster.inter_node
            bw, lat, e = link.bandwidth, link.latency, eff.pcie
        else:
            bw, lat, e = cluster.inter_node.bandwidth, cluster.inter_node.latency, eff.nic
        b.duration = max(1, round((lat + b.bytes / (bw * e)) / TICK))
    bucket_of = np.fromiter((-1 if b is None else b.index for b in where), dtype=np.int64, count=len(where))
    return out, bucket_of


def _kind_facts(kind, on_a, on_b) -> tuple:
    """What ``buckets_of`` reads of an operation kind: (local, whether it uses a port whatever its
    endpoints, an unstage, the GPU of its source endpoint, of a destination endpoint, the plan its
    destinations name, its direction unless it is a local copy that stages)."""
    ported = (kind.transfer and not kind.local) or kind.pcie
    direction = "h2d" if kind.reads_host else "d2h" if kind.writes_host else "net"
    return (
        kind.local,
        ported,
        kind.reads_host and kind.delivers,
        on_b if kind.source_plan == "target" else on_a,
        on_a if kind.destination_plan == "source" else on_b,
        kind.destination_plan,
        direction,
    )


PORT_KINDS = ("send nic", "send nvlink", "recv nic", "recv nvlink", "h2d pcie", "d2h pcie")
SEND_NIC, SEND_NVLINK, RECV_NIC, RECV_NVLINK, H2D, D2H = range(len(PORT_KINDS))
"""A port is the integer ``gpu * len(PORT_KINDS) + kind``: a list index, where a tuple key would be
hashed millions of times on a transition of a 1,024-GPU job."""


def _port(gpu: int, kind: int) -> int:
    return gpu * len(PORT_KINDS) + kind


def bucket_ports(b: Bucket, recv: list[int] | None = None) -> list[int]:
    """Send and receive ports per link kind (``PORT_KINDS``); PCIe is full duplex: host-to-device
    and back. ``recv``: the receive ports of ``b.dsts``, if made (``all_bucket_ports``)."""
    if b.direction != "net":
        return [_port(b.src, H2D if b.direction == "h2d" else D2H)]
    nic = b.link == "nic"
    if recv is None:
        recv = [_port(d, RECV_NIC if nic else RECV_NVLINK) for d in b.dsts]
    return [_port(b.src, SEND_NIC if nic else SEND_NVLINK)] + recv


def all_bucket_ports(buckets: list[Bucket]) -> list[list[int]]:
    """``bucket_ports`` of every bucket, the receive ports of one receivers' tuple made once (buckets
    share the tuple of their operations' receivers, thousands of GPUs in all at 1,024 GPUs)."""
    made: dict[tuple, list[int]] = {}
    out = []
    for b in buckets:
        if b.direction != "net" or len(b.dsts) < 4:  # a few receivers: made as fast as looked up
            out.append(bucket_ports(b))
            continue
        key = (b.dsts, b.link == "nic")
        recv = made.get(key)
        if recv is None:
            recv = made[key] = [_port(d, RECV_NIC if key[1] else RECV_NVLINK) for d in b.dsts]
        out.append(bucket_ports(b, recv))
    return out


def bucket_precedences(t: Transition, buckets: list[Bucket], bucket_of: np.ndarray) -> np.ndarray:
    """Bucket-level precedences from op dependencies, through frees and copies (transitively):
    the distinct (before, after) pairs as an array of two columns, in ascending order (millions
    at 1,024 GPUs, where one GPU's offload waits for every bucket that delivers to it; a set of
    pairs, as the tests write them, is accepted wherever an array is). ``bucket_of``: each
    operation's bucket, as ``buckets_of`` gives it.

    With numpy on every dependency at once (8.9 million on the largest move of the combined
    trace, 8.3 million of them offloads waiting for what delivered their shard): each edge
    (operation, dependency) as positions; what an operation outside buckets waits for is
    resolved by joining its edges with what its dependencies wait for, a path longer each round
    (frees and copies wait on one another only a few deep)."""
    ops = t.ops
    n = len(ops)
    lens = np.fromiter((len(op.deps) for op in ops), dtype=np.int64, count=n)
    deps = chain.from_iterable(op.deps for op in ops)
    total = int(lens.sum())
    dep = None
    if all(op.id == f"%{k}" for k, op in enumerate(ops)):  # plan-transition's numbering: "%k" is ops[k]
        # every id "%k" at once: "%3%17%4" read as the integers 3 17 4 by numpy's text parser
        # (8.9 million on the step-933 move of combined: 1.41 -> 0.76 s, against int() on each)
        dep = np.fromstring("".join(deps).replace("%", " "), dtype=np.int64, sep=" ")
        if len(dep) != total or (total and (dep.min() < 0 or dep.max() >= n)):
            dep = None  # an id that is not an operation's: looked up one by one, which names it
            deps = chain.from_iterable(op.deps for op in ops)
    if dep is None:
        pos = {op.id: k for k, op in enumerate(ops)}
        dep = np.fromiter(map(pos.__getitem__, deps), dtype=np.int64, count=total)
    owner = np.repeat(np.arange(n, dtype=np.int64), lens)
    # what each operation outside buckets waits for: (operation, bucket) rows
    outside = bucket_of[owner] < 0
    o_owner, o_dep = owner[outside], dep[outside]
    direct = bucket_of[o_dep] >= 0
    found = [np.stack([o_owner[direct], bucket_of[o_dep[direct]]], axis=1)]
    hops = np.stack([o_owner[~direct], o_dep[~direct]], axis=1)  # (operation, an outside op it waits for)
    paths, seen = hops, set()
    while len(paths):
        # what the ends of the paths wait for directly
        found.append(_join(paths, found[0]))
        # the paths one outside operation longer; each (operation, end) once, so a cycle ends
        longer = _join(paths, hops)
        key = _distinct(longer[:, 0] * n + longer[:, 1])
        fresh = np.fromiter((k not in seen for k in key.tolist()), dtype=bool, count=len(key))
        seen.update(key.tolist())
        paths = np.stack(np.divmod(key[fresh], n), axis=1)
    waits = np.concatenate(found)
    # the pairs: a bucket's operations' dependencies in buckets, and what outside ones wait for
    inside = ~outside
    b_owner, b_dep = bucket_of[owner[inside]], dep[inside]
    in_bucket = bucket_of[b_dep] >= 0
    direct_pairs = np.stack([bucket_of[b_dep[in_bucket]], b_owner[in_bucket]], axis=1)
    via = _join(np.stack([b_owner[~in_bucket], b_dep[~in_bucket]], axis=1), waits)  # (after, before)
    pairs = np.concatenate([direct_pairs, via[:, ::-1]])
    pairs = pairs[pairs[:, 0] != pairs[:, 1]]
    nb = max(len(buckets), 1)
    key = _distinct(pairs[:, 0] * nb + pairs[:, 1])
    out = np.empty((len(key), 2), dtype=np.int64)
    out[:, 0], out[:, 1] = np.divmod(key, nb)
    return out


def _distinct(a: np.ndarray) -> np.ndarray:
    """``np.unique(a)`` for integers, by a sort: numpy 2's hash-based ``unique`` took 6.4 s on 8
    million keys that sort in 0.07 s."""
    a = np.sort(a)
    return a[np.r_[True, a[1:] != a[:-1]]] if len(a) else a


def _join(left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """Rows (a, c) for every row (a, b) of ``left`` and (b, c) of ``right`` (two-column arrays)."""
    if not len(left) or not len(right):
        return np.empty((0, 2), dtype=np.int64)
    order = np.argsort(right[:, 0], kind="stable")
    keys, vals = right[order, 0], right[order, 1]
    lo = np.searchsorted(keys, left[:, 1], side="left")
    hi = np.searchsorted(keys, left[:, 1], side="right")
    counts = hi - lo
    total = int(counts.sum())
    starts = np.repeat(lo - (np.cumsum(counts) - counts), counts) + np.arange(total)
    return np.stack([np.repeat(left[:, 0], counts), vals[starts]], axis=1)


def precedence_pairs(prec) -> np.ndarray:
    """Precedences as an array of (before, after) rows: ``bucket_precedences``' own, or a set of pairs."""
    if isinstance(prec, np.ndarray):
        return prec.reshape(-1, 2)
    return np.array(sorted(prec), dtype=np.int64).reshape(-1, 2)
