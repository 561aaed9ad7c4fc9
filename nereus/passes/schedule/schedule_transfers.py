"""``schedule-transfers{time_limit=S}``: start times for a transition's transfers, by CP-SAT.

Transfers between the same sender and the same receivers over the same link are one bucket
(a contiguous flat buffer, as verl and NeMo-RL pack weights): bucket count grows with GPU pairs,
not with tensors. Each bucket is an interval of ``latency + bytes / (bandwidth x efficiency)``
on its link (NVLink inside a node, the NIC across nodes; efficiencies from the cluster's
calibrated cost model). Every GPU has a send port and a receive port per link kind, each a
no-overlap resource; a broadcast holds its sender's port and every receiver's. Dependencies
between operations become precedences between their buckets. The solver minimises the
makespan, starting from the better of two list schedules (``greedy``: the bucket whose ports
have the most work left, at the earliest time its ports are free; ``insertion``: buckets by
their busiest port, each in the earliest gap that all its ports share), and past the time limit
returns the best schedule with its gap. When a list schedule meets the port bound, no search
is needed; above ``SEARCH_MAX`` buckets none is run (it found nothing better there), and above
``LARGE`` the list schedules are of one pass.

The port lower bound is the busiest port's total busy time: no schedule is shorter. Local
copies run on HBM after their dependencies and frees after the operations that read what they
free; both are timed but hold no link port.
"""

from __future__ import annotations

import bisect
import heapq
from collections import defaultdict
from dataclasses import dataclass
from itertools import chain
from operator import itemgetter
from typing import TypeAlias, cast

import numpy as np
from ortools.sat.python import cp_model

from ...ir import Diagnostic, DiagnosticError, HostRef, Loc, Module, Shard, Transition
from ...ir.gc_pause import gc_paused
from ...ir.printer import printed_precision
from ..cost.cost_model import CostModel
from ..infra.pass_manager import ModulePass, Ref, register

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
    for k, op in enumerate(t.ops):
        kind = op.spec
        staged_copy = kind.local and isinstance(op.dst[0], HostRef)  # device to host, over PCIe
        if not (kind.transfer and not kind.local) and not kind.pcie and not staged_copy:
            continue  # local copies and frees use no port
        if kind.reads_host and kind.delivers:  # an unstage: host[g] onto GPU g (the verifier checks it)
            src = cast(HostRef, op.src[0]).gpu
            dsts = (src,)
        else:
            src = (on_b if kind.source_plan == "target" else on_a)(op.src[0])
            dst_gpu = on_a if kind.destination_plan == "source" else on_b
            if len(op.dst) == 1:
                dsts = (dst_gpu(op.dst[0]),)
            else:  # a broadcast: plan-transition gives the operations of one group one list (alive all along)
                dsts = receivers.get((id(op.dst), kind.destination_plan))
                if dsts is None:
                    dsts = receivers[(id(op.dst), kind.destination_plan)] = tuple(sorted({dst_gpu(d) for d in op.dst}))
        direction = "h2d" if kind.reads_host else "d2h" if kind.writes_host or staged_copy else "net"
        # PCIe moves of different kinds go in different buckets: a staged copy, its unstage and
        # an offload after the unstage share a direction, and one bucket would order them in a
        # cycle. Unstages wait for a growing prefix of their GPU's frees: one bucket per prefix
        # (the number of dependencies tells them apart), so that the first need not wait for all
        phase = (
            "" if direction == "net" else (op.kind, len(op.deps)) if kind.reads_host and kind.delivers else (op.kind, 0)
        )
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


PORT_KINDS = ("send nic", "send nvlink", "recv nic", "recv nvlink", "h2d pcie", "d2h pcie")
SEND_NIC, SEND_NVLINK, RECV_NIC, RECV_NVLINK, H2D, D2H = range(len(PORT_KINDS))
"""A port is the integer ``gpu * len(PORT_KINDS) + kind``: a list index, where a tuple key would be
hashed millions of times on a transition of a 1,024-GPU job."""


def _port(gpu: int, kind: int) -> int:
    return gpu * len(PORT_KINDS) + kind


def _ports(b: Bucket, recv: list[int] | None = None) -> list[int]:
    """Send and receive ports per link kind (``PORT_KINDS``); PCIe is full duplex: host-to-device
    and back. ``recv``: the receive ports of ``b.dsts``, if made (``_all_ports``)."""
    if b.direction != "net":
        return [_port(b.src, H2D if b.direction == "h2d" else D2H)]
    nic = b.link == "nic"
    if recv is None:
        recv = [_port(d, RECV_NIC if nic else RECV_NVLINK) for d in b.dsts]
    return [_port(b.src, SEND_NIC if nic else SEND_NVLINK)] + recv


def _all_ports(buckets: list[Bucket]) -> list[list[int]]:
    """``_ports`` of every bucket, the receive ports of one receivers' tuple made once (buckets
    share the tuple of their operations' receivers, thousands of GPUs in all at 1,024 GPUs)."""
    made: dict[tuple, list[int]] = {}
    out = []
    for b in buckets:
        if b.direction != "net" or len(b.dsts) < 4:  # a few receivers: made as fast as looked up
            out.append(_ports(b))
            continue
        key = (b.dsts, b.link == "nic")
        recv = made.get(key)
        if recv is None:
            recv = made[key] = [_port(d, RECV_NIC if key[1] else RECV_NVLINK) for d in b.dsts]
        out.append(_ports(b, recv))
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


def _pairs(prec) -> np.ndarray:
    """Precedences as an array of (before, after) rows: ``bucket_precedences``' own, or a set of pairs."""
    if isinstance(prec, np.ndarray):
        return prec.reshape(-1, 2)
    return np.array(sorted(prec), dtype=np.int64).reshape(-1, 2)


def _graph(buckets: list[Bucket], prec):
    """Predecessors and successors of every bucket (lists indexed by bucket), its ports, and each
    port's total busy time (a list indexed by port). The lists are cut from one sort of the pairs (millions at 1,024
    GPUs,
    where one GPU's offload waits for every bucket that delivers to it)."""
    n = len(buckets)
    pairs = _pairs(prec)
    if len(pairs):
        preds, succs = _adjacency(pairs[:, 1], pairs[:, 0], n), _adjacency(pairs[:, 0], pairs[:, 1], n)
    else:
        preds, succs = [[] for _ in range(n)], [[] for _ in range(n)]
    ports = _all_ports(buckets)
    flat = np.fromiter(chain.from_iterable(ports), dtype=np.int64)
    weight = np.repeat(_durations(buckets), [len(ps) for ps in ports])
    busy = np.bincount(flat, weights=weight, minlength=1).astype(np.int64).tolist() if len(flat) else [0]
    return preds, succs, ports, busy


def _adjacency(key: np.ndarray, value: np.ndarray, n: int) -> list[list[int]]:
    """``out[k]``: the values paired with key k, in the pairs' order."""
    order = np.argsort(key, kind="stable")
    values = value[order].tolist()
    ends = np.cumsum(np.bincount(key, minlength=n)).tolist()
    return [values[a:b] for a, b in zip([0] + ends[:-1], ends)]


def greedy(buckets: list[Bucket], prec: Precedences) -> list[int]:
    """List schedule: repeatedly start, as early as its ports and predecessors allow, the ready
    bucket whose busiest port has the most work left (ties: the longer bucket), so that the
    ports that bound the makespan are never left idle when they could work.

    A heap keyed by earliest start; keys only grow as ports fill, so a popped bucket whose key
    is stale goes back with its new key (lazy update). O(n log n) for n buckets, each pop
    reading all of a bucket's ports (a broadcast holds every receiver's): a bucket's ports and
    predecessors are read by one ``itemgetter`` each, which also names one spare entry (a port
    always free and with no work, a predecessor that ended at 0) so that it returns a tuple.
    """
    preds, succs, ports, left = _graph(buckets, prec)  # left: each port's work not yet placed
    n = len(buckets)
    duration = [b.duration for b in buckets]
    spare = len(left)
    left = left + [-1]  # real ports' work left is never negative: the spare never is the busiest
    free_at = [0] * (spare + 1)
    end = [0] * (n + 1)  # end[i]: when bucket i ends, once placed; end[n]: the spare, 0
    on_ports = [itemgetter(*ps, spare) for ps in ports]
    after = [itemgetter(*ps, n) if ps else None for ps in preds]
    waiting = [len(ps) for ps in preds]
    placed = [False] * n

    def key(k: int) -> tuple:
        on = on_ports[k]
        earliest = max(on(free_at))
        if after[k] is not None:
            earliest = max(earliest, max(after[k](end)))  # type: ignore[misc]  # not None, just checked
        return (earliest, -max(on(left)), -duration[k], k)

    heap = [key(i) for i in range(n) if waiting[i] == 0]
    heapq.heapify(heap)
    pop, push = heapq.heappop, heapq.heappush
    while heap:
        k = pop(heap)
        i = k[3]
        fresh = key(i)
        if fresh[0] > k[0]:
            push(heap, fresh)
            continue
        d = duration[i]
        end[i] = t = fresh[0] + d
        placed[i] = True
        for p in ports[i]:
            free_at[p] = t
            left[p] -= d
        for j in succs[i]:
            waiting[j] -= 1
            if waiting[j] == 0:
                push(heap, key(j))
    if not all(placed):
        raise ValueError("cyclic dependencies between transfer buckets")
    return [end[i] - duration[i] for i in range(n)]


def _tails(buckets: list[Bucket], succs) -> list[int]:
    """Each bucket's bottom level: its duration plus the longest chain of buckets after it."""
    after = np.fromiter((j for js in succs for j in js), dtype=np.int64)
    before = np.repeat(np.arange(len(succs), dtype=np.int64), [len(js) for js in succs])
    return bottom_levels(_durations(buckets), before, after).tolist()


def _durations(buckets: list[Bucket]) -> np.ndarray:
    return np.fromiter((b.duration for b in buckets), dtype=np.int64, count=len(buckets))


def bottom_levels(duration: np.ndarray, before: np.ndarray, after: np.ndarray) -> np.ndarray:
    """``level[i] = duration[i] + max(level[j] for every edge i -> j)`` (0 without one) on the
    DAG of edges ``before[k] -> after[k]``: level by level from the sinks, each level's edges at
    once (a transition's bucket graph is millions of edges but only tens of levels deep).
    Raises ValueError on a cycle."""
    n = len(duration)
    level = duration.astype(np.int64, copy=True)
    if not len(before):
        return level
    order = np.argsort(after, kind="stable")
    into = before[order]  # the edges' first ends, grouped by their second
    ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(after, minlength=n), out=ptr[1:])
    best = np.zeros(n, dtype=np.int64)  # the longest level among the successors final so far
    left = np.bincount(before, minlength=n)  # successors not final yet
    frontier = np.flatnonzero(left == 0)
    done = 0
    while len(frontier):
        done += len(frontier)
        level[frontier] += best[frontier]
        counts = ptr[frontier + 1] - ptr[frontier]
        total = int(counts.sum())
        if not total:
            break
        offsets = np.repeat(ptr[frontier] - (np.cumsum(counts) - counts), counts) + np.arange(total)
        src = into[offsets]
        np.maximum.at(best, src, np.repeat(level[frontier], counts))
        dec = np.bincount(src, minlength=n)
        left -= dec
        frontier = np.flatnonzero((left == 0) & (dec > 0))
    if done != n:
        raise ValueError("cyclic dependencies between transfer buckets")
    return level


def insertion(
    buckets: list[Bucket], prec: Precedences, chains: bool = False, graph=None, tails: list[int] | None = None
) -> list[int]:
    """List schedule with insertion: ready buckets in a fixed priority (the busiest port first,
    then the bucket with more ports, then the longer), each at the earliest time after its
    predecessors at which all its ports are free for its whole duration, in a gap left between
    buckets already placed when one is long enough.

    Placing the many-port broadcasts first and filling the gaps they leave with point-to-point
    buckets keeps the busiest receive ports working from start to end, where ``greedy`` (which
    appends to each port) leaves them idle while a broadcast waits for all its ports.
    ``graph``: ``_graph``'s, if made (read only); ``tails``: ``_tails``', if computed.
    """
    preds, succs, ports, busy = graph or _graph(buckets, prec)
    tail = (tails or _tails(buckets, succs)) if chains else [0] * len(buckets)
    prio = [
        (-tail[i], -max(busy[p] for p in ps), -len(ps), -b.duration, i) for i, (b, ps) in enumerate(zip(buckets, ports))
    ]
    waiting = {i: len(preds[i]) for i in range(len(buckets))}
    heap = [prio[i] for i in range(len(buckets)) if waiting[i] == 0]
    heapq.heapify(heap)
    # port -> the starts and ends of its busy spans: buckets placed back to back are one span,
    # so the search for a gap jumps over a packed stretch at once (a port thousands of buckets
    # use is one span or a few, and the search stays short)
    placed: dict[tuple, tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))
    start: dict[int, int] = {}
    while heap:
        i = heapq.heappop(heap)[-1]
        d = buckets[i].duration
        t = max((start[j] + buckets[j].duration for j in preds[i]), default=0)
        lines = [placed[p] for p in ports[i]]
        # the earliest gap of length d from t on, on every port at once: round the ports until
        # every one of them in a row is free from t on (a port that moves t is free from there)
        at, free, nl = 0, 0, len(lines)
        while free < nl:
            starts, ends = lines[at]
            k = bisect.bisect_right(ends, t)  # the first span on this port ending after t
            n = len(starts)
            if k < n and starts[k] < t + d:
                while k < n and starts[k] < t + d:  # past this port's spans in the way, one after another
                    t = ends[k]
                    k += 1
                free = 1
            else:
                free += 1
            at = at + 1 if at + 1 < nl else 0
        start[i] = t
        for starts, ends in lines:
            k = bisect.bisect_left(starts, t)  # spans before k end by t, spans from k start at t + d or later
            joins_left = k > 0 and ends[k - 1] == t
            joins_right = k < len(starts) and starts[k] == t + d
            if joins_left and joins_right:
                ends[k - 1] = ends[k]
                del starts[k], ends[k]
            elif joins_left:
                ends[k - 1] = t + d
            elif joins_right:
                starts[k] = t
            else:
                starts.insert(k, t)
                ends.insert(k, t + d)
        for j in succs[i]:
            waiting[j] -= 1
            if waiting[j] == 0:
                heapq.heappush(heap, prio[j])
    if len(start) != len(buckets):
        raise ValueError("cyclic dependencies between transfer buckets")
    return [start[i] for i in range(len(buckets))]


@dataclass
class Schedule:
    starts: list[int]
    makespan: int
    port_bound: int
    status: str
    bound: int
    searched: bool = True  # False: a list schedule, no CP-SAT search (above ``SEARCH_MAX`` buckets)


def port_bound(buckets: list[Bucket], prec, graph=None) -> int:
    """No schedule is shorter: for every port, the work on it that cannot start before some
    moment, from that moment on. A bucket cannot start before the longest chain of buckets
    that must precede it (its head); on a port whose buckets sorted by head are b_1..b_n, the
    makespan is at least head(b_k) + the durations of b_k..b_n, for every k. With k = 1 (head
    0 without dependencies) this is the port's busy time. ``graph``: ``_graph``'s, if made."""
    _, _, ports, busy = graph or _graph(buckets, prec)
    pairs = _pairs(prec)
    if not len(pairs):
        return max(busy, default=0)
    duration = _durations(buckets)
    head = bottom_levels(duration, pairs[:, 1], pairs[:, 0]) - duration  # chains before, on the reversed graph
    port = np.fromiter(chain.from_iterable(ports), dtype=np.int64)
    bucket = np.repeat(np.arange(len(buckets), dtype=np.int64), [len(ps) for ps in ports])
    port, h, d = by_port_and_head(port, head[bucket], duration[bucket])
    # the work from each bucket to the end of its port's list: the port's total less what came before
    done_before = np.cumsum(d) - d
    first = np.flatnonzero(np.r_[True, port[1:] != port[:-1]])
    total = np.add.reduceat(d, first)
    start = np.repeat(done_before[first], np.diff(np.r_[first, len(d)]))
    end = np.repeat(total, np.diff(np.r_[first, len(d)]))
    return int(np.max(h + end - (done_before - start)))


def by_port_and_head(port: np.ndarray, head: np.ndarray, duration: np.ndarray):
    """The (port, head, duration) entries sorted by port, then head. Where the three fit in one
    int64, by one sort of packed keys (a lexsort and three gathers in its order took 1.4 s on the
    7.5 million entries of the step-933 move of combined; entries of one port and head come out
    by duration, an order ``port_bound`` does not depend on)."""
    if not len(port):
        return port, head, duration
    hs, ds = int(head.max()) + 1, int(duration.max()) + 1
    if (int(port.max()) + 1) * hs * ds < 2**62:
        key = (port * hs + head) * ds + duration
        key.sort()
        rest, duration = np.divmod(key, ds)
        port, head = np.divmod(rest, hs)
        return port, head, duration
    order = np.lexsort((head, port))
    return port[order], head[order], duration[order]


SEARCH_MAX = 2000
"""Buckets: above this, no CP-SAT search after the list schedules. On every transition of 2,169
to 3,984 buckets where the search ran (the simulator's three traces and the transition bench:
12 searches given 0.5-3 s each) it found no shorter schedule, most often no schedule at all in
its time; on the test suite's (up to 279 buckets) it shortened 26 of 329 (docs/PERFORMANCE.md)."""
INSERTION_MAX = 100_000  # buckets: up to this, a large schedule also tries ``insertion`` (it is not O(n log n))
LARGE = 4000  # buckets: above this, list schedules of one pass (``serial``, ``insertion``) instead of ``greedy``


def serial(buckets: list[Bucket], prec: Precedences, graph=None, tails: list[int] | None = None) -> list[int]:
    """List schedule in one pass, O(n log n): of the buckets whose predecessors are placed, the
    one with the longest chain of work from its start to the end (its bottom level, ``_tails``)
    first, started as early as its ports and predecessors allow. ``greedy`` re-keys every
    bucket waiting on a port each time the port fills, which is quadratic on a port thousands
    of buckets wait for (a transition of a 1,024-GPU job); this is the fallback there.

    The bottom level first, not the earliest released: where a GPU's offload waits for every
    delivery to that GPU, the deliveries start first and the offloads overlap the rest of the
    traffic (20.9 s -> 6.2 s on a 282,428-bucket move of the combined trace, whose port bound is
    1.1 s). ``graph``: ``_graph``'s, if made (read only); ``tails``: ``_tails``', if computed."""
    preds, succs, ports, busy = graph or _graph(buckets, prec)
    tail = tails or _tails(buckets, succs)
    start: list[int] = [0] * len(buckets)
    spare = len(busy)  # a port always free: every bucket's getter names it, so that it returns a tuple
    free_at = [0] * (spare + 1)
    on_ports = [itemgetter(*ps, spare) for ps in ports]
    waiting = [len(preds[i]) for i in range(len(buckets))]
    release = [0] * len(buckets)
    heap = [(-tail[i], i) for i in range(len(buckets)) if waiting[i] == 0]
    heapq.heapify(heap)
    pop, push = heapq.heappop, heapq.heappush
    placed = 0
    while heap:
        i = pop(heap)[-1]
        s = max(on_ports[i](free_at))
        if release[i] > s:
            s = release[i]
        start[i] = s
        placed += 1
        e = s + buckets[i].duration
        for p in ports[i]:
            free_at[p] = e
        for j in succs[i]:
            if release[j] < e:
                release[j] = e
            waiting[j] -= 1
            if waiting[j] == 0:
                push(heap, (-tail[j], j))
    if placed != len(buckets):
        raise ValueError("cyclic dependencies between transfer buckets")
    return start


def solve_schedule(buckets: list[Bucket], prec: Precedences, time_limit: float, seed: int = 0) -> Schedule:
    if not buckets:
        return Schedule([], 0, 0, "optimal", 0)
    graph = _graph(buckets, prec)  # read by the bound and the one-pass schedule; greedy's changes its busy times
    bound = port_bound(buckets, prec, graph)
    if len(buckets) > LARGE:  # no search on this scale: the better of two list schedules, and the bound
        pairs = _pairs(prec)
        tails = bottom_levels(
            _durations(buckets), pairs[:, 0], pairs[:, 1]
        ).tolist()  # both list schedules order by them
        warm = serial(buckets, prec, graph, tails)
        horizon = max(s + b.duration for s, b in zip(warm, buckets))
        # with insertion: 8.83 s -> 0.757 s on a 94,535-bucket move whose bound is 0.755 s (2.6 s
        # more to schedule); it ran over 10 minutes on 200,504 buckets with 4.59 million precedences
        if horizon > bound and len(buckets) <= INSERTION_MAX and len(prec) <= 10 * INSERTION_MAX:
            other = insertion(buckets, prec, len(prec) > 0, graph, tails)
            span = max(s + b.duration for s, b in zip(other, buckets))
            if span < horizon:
                warm, horizon = other, span
        return Schedule(warm, horizon, bound, "optimal" if horizon == bound else "feasible", bound, searched=False)
    warm = greedy(buckets, prec)
    horizon = max(s + b.duration for s, b in zip(warm, buckets))
    for chains in (False, True):  # then list schedules with insertion; the best of them
        if horizon == bound or (chains and not len(prec)):
            break
        other = insertion(buckets, prec, chains)
        span = max(s + b.duration for s, b in zip(other, buckets))
        if span < horizon:
            warm, horizon = other, span
    if horizon == bound:  # a list schedule meets the lower bound: optimal, no search needed
        return Schedule(warm, horizon, bound, "optimal", bound)
    if len(buckets) > SEARCH_MAX:
        return Schedule(warm, horizon, bound, "feasible", bound, searched=False)
    m = cp_model.CpModel()
    starts, ends, intervals = [], [], []
    for i, b in enumerate(buckets):
        s = m.new_int_var(0, horizon - b.duration, f"s{i}")
        e = m.new_int_var(b.duration, horizon, f"e{i}")
        intervals.append(m.new_interval_var(s, b.duration, e, f"i{i}"))
        starts.append(s)
        ends.append(e)
        m.add_hint(s, warm[i])
    by_port: dict[int, list] = defaultdict(list)
    for i, b in enumerate(buckets):
        for p in _ports(b):
            by_port[p].append(intervals[i])
    for ivs in by_port.values():
        if len(ivs) > 1:
            m.add_no_overlap(ivs)
    for a, b in _pairs(prec).tolist():
        m.add(starts[b] >= ends[a])
    makespan = m.new_int_var(bound, horizon, "makespan")
    m.add_max_equality(makespan, ends)
    m.minimize(makespan)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit)
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = seed
    status = solver.solve(m)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return Schedule(warm, horizon, bound, "feasible", bound)
    found = [solver.value(s) for s in starts]
    span = int(solver.objective_value)
    if span > horizon:  # never worse than the warm start
        found, span = warm, horizon
    return Schedule(
        found, span, bound, "optimal" if status == cp_model.OPTIMAL else "feasible", int(solver.best_objective_bound)
    )


def schedule_transition(m: Module, t: Transition, time_limit: float = 5.0, seed: int = 0) -> Schedule:
    """Set start and duration of every operation; makespan, port bound and status on the transition."""
    with gc_paused():
        return _schedule_transition(m, t, time_limit, seed)


def _schedule_transition(m: Module, t: Transition, time_limit: float, seed: int) -> Schedule:
    cluster = m.clusters[m.plans[t.target].cluster]
    model = CostModel(cluster)
    buckets, bucket_of = buckets_of(m, t, model)
    prec = bucket_precedences(t, buckets, bucket_of)
    sched = solve_schedule(buckets, prec, time_limit, seed)
    end = _times_in_buckets(buckets, sched.starts)
    hbm = cluster.hbm_bandwidth * model.efficiency.hbm
    for op in t.ops:  # copies and frees: after their dependencies, on no link port
        if op.id in end:
            continue
        ready = max((end.get(d, 0.0) for d in op.deps), default=0.0)
        op.start = _printed(ready)
        op.duration = _printed(2 * op.bytes / hbm) if op.spec.local else 0.0
        end[op.id] = ready + (op.duration or 0.0)
    t.makespan = _printed(max(end.values(), default=0.0))
    t.port_bound = _printed(sched.port_bound * TICK)
    t.schedule_status = sched.status
    return sched


def _times_in_buckets(buckets: list[Bucket], starts: list[int]) -> dict[str, float]:
    """Start and duration of every operation in a bucket (a bucket's operations back to back, in
    order, from its start; each its share of the bucket's time by bytes), set on the operations
    at the printed precision; returns each one's end, unrounded, by id.

    With numpy over all operations at once, the same arithmetic as one operation after another:
    a bucket's running time is summed in order, position by position across buckets (a bucket
    holds at most a few hundred operations), and each distinct time is rounded once."""
    ops = [op for b in buckets for op in b.ops]
    if not ops:
        return {}
    sizes = np.fromiter((len(b.ops) for b in buckets), dtype=np.int64, count=len(buckets))
    nbytes = np.fromiter((b.bytes for b in buckets), dtype=np.int64, count=len(buckets))
    per_byte = _durations(buckets) * TICK / np.maximum(nbytes, 1)
    offsets = np.cumsum(sizes) - sizes
    d = np.fromiter((op.bytes for op in ops), dtype=np.int64, count=len(ops)) * np.repeat(per_byte, sizes)
    t = np.empty(len(ops))
    t[offsets] = np.asarray(starts, dtype=np.int64) * TICK
    place = np.arange(len(ops)) - np.repeat(offsets, sizes)  # each operation's place in its bucket
    order = np.argsort(place, kind="stable")
    bounds = np.cumsum(np.bincount(place)).tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):  # the second operations of every bucket, then the third, ...
        at = order[a:b]
        t[at] = t[at - 1] + d[at - 1]
    for op, start, duration in zip(ops, _rounded(t), _rounded(d)):
        op.start, op.duration = start, duration
    return dict(zip([op.id for op in ops], (t + d).tolist()))


def _rounded(x: np.ndarray) -> list[float]:
    """``_printed`` of every entry, each distinct value rounded once."""
    values, inverse = np.unique(x, return_inverse=True)
    return np.array([_printed(v) for v in values.tolist()])[inverse].tolist()


@register
@dataclass(frozen=True)
class ScheduleTransfers(ModulePass):
    """Options: ``time_limit`` (s), ``seed``, ``transition`` (``@name``; default: every transition)."""

    name = "schedule-transfers"
    time_limit: float = 5.0
    seed: int = 0
    transition: Ref = ""

    def apply(self, module: Module) -> None:
        names = [self.transition] if self.transition else list(module.transitions)
        if not names:
            raise DiagnosticError(
                [
                    Diagnostic(
                        Loc(0, 0, module.filename),
                        "schedule-transfers: the module has no transition",
                        "run plan-transition{to=@plan_b} first",
                    )
                ]
            )
        for name in names:
            t = module.transitions[name]
            sched = schedule_transition(module, t, self.time_limit, self.seed)
            if sched.status != "optimal":
                gap = (sched.makespan - sched.bound) / sched.makespan if sched.makespan else 0.0
                why = (
                    f"stopped at time_limit={self.time_limit:g} s"
                    if sched.searched
                    else f"ran no search (a list schedule, above {SEARCH_MAX:,} buckets)"
                )
                module.warnings.append(
                    Diagnostic(
                        t.loc,
                        f"schedule-transfers {why}: makespan within {gap:.2%} of the best possible",
                        severity="warning",
                    )
                )


def _printed(x: float) -> float:
    """Schedule times at 6 significant digits (microseconds of a seconds-long transition)."""
    return printed_precision(x, 6)
