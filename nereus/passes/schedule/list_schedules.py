"""List schedules of buckets on their ports (``greedy``, ``insertion``, ``serial``), bottom levels and the
port lower bound: the schedules ``cpsat`` starts from, and the only ones above its size limit.

Part of ``schedule-transfers`` (``schedule_transfers.py``)."""

from __future__ import annotations

import bisect
import heapq
from collections import defaultdict
from dataclasses import dataclass
from itertools import chain
from operator import itemgetter

import numpy as np

from .buckets import Bucket, Precedences, all_bucket_ports, precedence_pairs


def port_graph(buckets: list[Bucket], prec):
    """Predecessors and successors of every bucket (lists indexed by bucket), its ports, and each
    port's total busy time (a list indexed by port). The lists are cut from one sort of the pairs (millions at 1,024
    GPUs,
    where one GPU's offload waits for every bucket that delivers to it)."""
    n = len(buckets)
    pairs = precedence_pairs(prec)
    if len(pairs):
        preds, succs = _adjacency(pairs[:, 1], pairs[:, 0], n), _adjacency(pairs[:, 0], pairs[:, 1], n)
    else:
        preds, succs = [[] for _ in range(n)], [[] for _ in range(n)]
    ports = all_bucket_ports(buckets)
    flat = np.fromiter(chain.from_iterable(ports), dtype=np.int64)
    weight = np.repeat(bucket_durations(buckets), [len(ps) for ps in ports])
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
    preds, succs, ports, left = port_graph(buckets, prec)  # left: each port's work not yet placed
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


def tails_of(buckets: list[Bucket], succs) -> list[int]:
    """Each bucket's bottom level: its duration plus the longest chain of buckets after it."""
    after = np.fromiter((j for js in succs for j in js), dtype=np.int64)
    before = np.repeat(np.arange(len(succs), dtype=np.int64), [len(js) for js in succs])
    return bottom_levels(bucket_durations(buckets), before, after).tolist()


def bucket_durations(buckets: list[Bucket]) -> np.ndarray:
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
    ``graph``: ``port_graph``'s, if made (read only); ``tails``: ``tails_of``', if computed.
    """
    preds, succs, ports, busy = graph or port_graph(buckets, prec)
    tail = (tails or tails_of(buckets, succs)) if chains else [0] * len(buckets)
    prio = [
        (-tail[i], -max(busy[p] for p in ps), -len(ps), -b.duration, i) for i, (b, ps) in enumerate(zip(buckets, ports))
    ]
    duration = [b.duration for b in buckets]
    waiting = [len(ps) for ps in preds]
    heap = [prio[i] for i in range(len(buckets)) if waiting[i] == 0]
    heapq.heapify(heap)
    # port -> the starts and ends of its busy spans: buckets placed back to back are one span,
    # so the search for a gap jumps over a packed stretch at once (a port thousands of buckets
    # use is one span or a few, and the search stays short)
    placed: dict[tuple, tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))
    start = [0] * len(buckets)
    end = [0] * len(buckets)  # of the placed buckets
    count = 0
    while heap:
        i = heapq.heappop(heap)[-1]
        d = duration[i]
        t = max(map(end.__getitem__, preds[i]), default=0)
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
        end[i] = t + d
        count += 1
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
    if count != len(buckets):
        raise ValueError("cyclic dependencies between transfer buckets")
    return start


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
    0 without dependencies) this is the port's busy time. ``graph``: ``port_graph``'s, if made."""
    _, _, ports, busy = graph or port_graph(buckets, prec)
    pairs = precedence_pairs(prec)
    if not len(pairs):
        return max(busy, default=0)
    duration = bucket_durations(buckets)
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


def serial(buckets: list[Bucket], prec: Precedences, graph=None, tails: list[int] | None = None) -> list[int]:
    """List schedule in one pass, O(n log n): of the buckets whose predecessors are placed, the
    one with the longest chain of work from its start to the end (its bottom level, ``tails_of``)
    first, started as early as its ports and predecessors allow. ``greedy`` re-keys every
    bucket waiting on a port each time the port fills, which is quadratic on a port thousands
    of buckets wait for (a transition of a 1,024-GPU job); this is the fallback there.

    The bottom level first, not the earliest released: where a GPU's offload waits for every
    delivery to that GPU, the deliveries start first and the offloads overlap the rest of the
    traffic (20.9 s -> 6.2 s on a 282,428-bucket move of the combined trace, whose port bound is
    1.1 s). ``graph``: ``port_graph``'s, if made (read only); ``tails``: ``tails_of``', if computed."""
    preds, succs, ports, busy = graph or port_graph(buckets, prec)
    tail = tails or tails_of(buckets, succs)
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


def backwards(buckets: list[Bucket], prec: Precedences, graph=None) -> list[int]:
    """``dense`` on the reversed problem (every precedence turned around), read backwards: a bucket
    that ends there at e starts here at span - e. Ports and precedences hold mirrored, so it is a
    schedule of the same length. Forward, ``dense`` starts whatever is ready on an idle port and
    leaves for later the chains that end a move (sends that must finish before a GPU's frees let
    its staged slices in: the ``unstage`` buckets); backwards, those chains' last buckets are
    placed first and what feeds them just before, where they are needed. On ``bench
    transition``'s case 5 (TP 4 ZeRO-3 -> TP 8 PP 4 ZeRO-1 at 1,024 GPUs, 21,449 buckets, 119,470
    precedences): 1.30x the port bound forward, 1.07x backwards. ``graph``: ``port_graph``'s of the
    forward problem, if made (read only)."""
    preds, succs, ports, busy = graph or port_graph(buckets, prec)
    pairs = precedence_pairs(prec)
    duration = bucket_durations(buckets)
    heads = bottom_levels(duration, pairs[:, 1], pairs[:, 0]).tolist()  # the reversed problem's bottom levels
    mirrored = dense(buckets, None, (succs, preds, ports, busy), heads)
    span = max((s + b.duration for s, b in zip(mirrored, buckets)), default=0)
    return [span - (s + b.duration) for s, b in zip(mirrored, buckets)]


def dense(buckets: list[Bucket], prec: Precedences | None, graph=None, tails: list[int] | None = None) -> list[int]:
    """Dense list schedule, event by event: whenever a port falls idle, it starts at once one of
    its ready buckets whose every port is idle too, if there is one; no port waits while a
    bucket could run on it. Of those, the bucket with the longest chain of work from its start
    (``tails``: its bottom level, its duration where nothing follows it) first, then the one
    whose other ports have the most work left. Freed ports choose in order of their own work left.

    ``serial`` and ``insertion`` place buckets in one global order, each as early as the ports
    it names allow: on a move where most ports are near the busiest (TP 8 x PP 4 ZeRO-1 to TP 4
    ZeRO-3 at 1,024 GPUs: 4,096 ports, 49,686 buckets, hundreds of ports within 1% of the bound)
    a port's next bucket in that order waits for its partner while the port could serve another
    (2.08x the port bound; this: 1.10x). Event-driven, each freed port reads its ready buckets:
    O(events x buckets per port). ``graph``: ``port_graph``'s, if made (read only; then ``prec`` is
    not read)."""
    preds, succs, ports, busy = graph or port_graph(buckets, prec)
    n = len(buckets)
    duration = [b.duration for b in buckets]
    tail = tails or duration
    left = list(busy)  # work not started yet, per port
    idle = [True] * (len(left) + 1)  # and a spare, never busy: the watch of a bucket with no port
    ready: list[list[int]] = [[] for _ in left]  # per port, ready buckets not started (started ones dropped lazily)
    waiting = [len(ps) for ps in preds]
    started = [False] * n
    # per bucket, the port last found busy, read first: a broadcast's bucket waits on hundreds of
    # ports' lists, and a bucket is read at every event on each (13.9 million reads of ports for
    # 2.6 million of buckets on the bench's case 5)
    watch = [ps[0] if ps else len(left) for ps in ports]
    start = [0] * n
    ends: list[tuple[int, int]] = []  # (end, bucket) of the running buckets
    placed = 0

    def run(i: int, t: int) -> None:
        nonlocal placed
        started[i] = True
        start[i] = t
        placed += 1
        d = duration[i]
        for q in ports[i]:
            idle[q] = False
            left[q] -= d
        heapq.heappush(ends, (t + d, i))

    def choose(p: int, t: int) -> None:
        """Start on idle port ``p`` the best of its ready buckets whose ports are all idle."""
        best, best_key = -1, None
        ready[p] = waiting_here = [i for i in ready[p] if not started[i]]
        for i in [i for i in waiting_here if idle[watch[i]]]:
            other = 0  # the most work left on another of its ports; -1: one of them is busy
            for q in ports[i]:
                if not idle[q]:
                    watch[i] = q
                    other = -1
                    break
                if q != p and left[q] > other:
                    other = left[q]
            if other >= 0:
                k = (tail[i], other)
                if best_key is None or k > best_key:
                    best, best_key = i, k
        if best >= 0:
            run(best, t)

    def release(i: int) -> None:
        for q in ports[i]:
            ready[q].append(i)

    fresh = [i for i in range(n) if waiting[i] == 0]
    for i in fresh:
        release(i)
    t = 0
    freed = sorted(range(len(left)), key=lambda q: -left[q])
    while True:
        for q in freed:
            if idle[q]:
                choose(q, t)
        for i in fresh:  # ready now on ports that were idle before and freed nothing at t
            if not started[i] and all(idle[q] for q in ports[i]):
                run(i, t)
        if not ends:
            break
        t = ends[0][0]
        freed, fresh = [], []
        while ends and ends[0][0] == t:
            _, i = heapq.heappop(ends)
            for q in ports[i]:
                idle[q] = True
                freed.append(q)
            for j in succs[i]:
                waiting[j] -= 1
                if waiting[j] == 0:
                    fresh.append(j)
                    release(j)
        freed.sort(key=lambda q: -left[q])
    if placed != n:
        raise ValueError("cyclic dependencies between transfer buckets")
    return start
