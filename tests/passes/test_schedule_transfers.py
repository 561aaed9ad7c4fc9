"""schedule-transfers: the list schedules place every bucket without overlapping a port and
after its predecessors; the schedule with insertion fills the gaps broadcasts leave."""

import bisect
import heapq
from collections import defaultdict
from itertools import pairwise

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import nereus.passes.schedule.cpsat as cpsat
from nereus.passes.schedule.buckets import Bucket, bucket_ports
from nereus.passes.schedule.cpsat import solve_schedule
from nereus.passes.schedule.list_schedules import (
    backwards,
    bottom_levels,
    dense,
    greedy,
    insertion,
    port_graph,
    serial,
    tails_of,
)
from nereus.passes.schedule.list_schedules import port_bound as list_port_bound


def port_bound(buckets):
    busy = defaultdict(int)
    for b in buckets:
        for p in bucket_ports(b):
            busy[p] += b.duration
    return max(busy.values())


def assert_valid(buckets, prec, starts):
    by_port = defaultdict(list)
    for b, s in zip(buckets, starts):
        assert s >= 0
        for p in bucket_ports(b):
            by_port[p].append((s, s + b.duration))
    for spans in by_port.values():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in pairwise(spans))  # one bucket at a time on a port
    for a, b in prec:
        assert starts[b] >= starts[a] + buckets[a].duration


@st.composite
def instances(draw):
    n = draw(st.integers(1, 14))
    buckets = []
    for _ in range(n):
        src = draw(st.integers(0, 5))
        dsts = tuple(sorted(draw(st.sets(st.integers(0, 5).filter(lambda g, s=src: g != s), min_size=1, max_size=4))))
        link = draw(st.sampled_from(["nic", "nvlink", "pcie"]))
        direction = draw(st.sampled_from(["h2d", "d2h"])) if link == "pcie" else "net"
        buckets.append(Bucket(src, dsts, link, [], direction, duration=draw(st.integers(1, 9))))
    prec = {(a, b) for a in range(n) for b in range(a + 1, n) if draw(st.integers(0, 4)) == 0}
    return buckets, prec


@settings(max_examples=200, deadline=None)
@given(instances())
def test_list_schedules_respect_ports_and_precedences(inst):
    buckets, prec = inst
    for schedule in (greedy, insertion, serial, dense, backwards):
        assert_valid(buckets, prec, schedule(buckets, prec))
    sched = solve_schedule(buckets, prec, time_limit=1.0)
    assert_valid(buckets, prec, sched.starts)
    assert sched.makespan == max(s + b.duration for s, b in zip(sched.starts, buckets)) >= port_bound(buckets)


def test_insertion_fills_the_gaps_broadcasts_leave():
    # receive port 5 carries 8 ticks of work; appending to ports, greedy leaves it idle while the
    # broadcast from GPU 3 waits for ports 4 and 6, and ends at 11
    buckets = [
        Bucket(1, (7,), "nic", [], duration=4),
        Bucket(2, (5,), "nic", [], duration=4),
        Bucket(1, (4, 6, 7), "nic", [], duration=3),
        Bucket(3, (4, 5, 6), "nic", [], duration=4),
    ]
    assert port_bound(buckets) == 8
    assert max(s + b.duration for s, b in zip(greedy(buckets, set()), buckets)) == 11
    starts = insertion(buckets, set())
    assert_valid(buckets, set(), starts)
    assert max(s + b.duration for s, b in zip(starts, buckets)) == 8
    sched = solve_schedule(buckets, set(), time_limit=1.0)
    assert (sched.makespan, sched.status) == (8, "optimal")


def test_dense_keeps_every_port_working_where_one_global_order_does_not():
    """GPU 2 sends to GPUs 5 and 3, which GPUs 0 and 1 also send to: three ports of 12 ticks.
    In one global order (the longest first, then by index) the first two buckets take ports 5
    and 3, so both of GPU 2's wait, one after the other (18); the dense schedule starts GPU 2's
    first as port 2 has the most work, and at 6 the other two pairs, each on ports just freed
    (12, the bound). Above ``LARGE`` buckets ``solve_schedule`` keeps the best of the three."""
    buckets = [Bucket(src, (dst,), "nic", [], duration=6) for src, dst in ((0, 5), (1, 3), (2, 5), (2, 3))]
    spans = {
        f.__name__: max(s + b.duration for s, b in zip(f(buckets, set()), buckets))
        for f in (serial, insertion, greedy, dense)
    }
    assert spans == {"serial": 18, "insertion": 18, "greedy": 18, "dense": 12} and port_bound(buckets) == 12
    assert_valid(buckets, set(), dense(buckets, set()))


def test_above_large_the_dense_schedule_is_kept_where_it_is_shorter():
    """The instance above on 1,001 disjoint sets of GPUs: 4,004 buckets, above ``LARGE``, where
    only one-pass list schedules run; the one-pass order gives 18, the dense schedule 12."""
    from nereus.passes.schedule.cpsat import LARGE

    pairs = ((0, 5), (1, 3), (2, 5), (2, 3))
    buckets = [Bucket(6 * k + a, (6 * k + b,), "nic", [], duration=6) for k in range(1001) for a, b in pairs]
    assert len(buckets) > LARGE
    assert max(s + b.duration for s, b in zip(serial(buckets, set()), buckets)) == 18
    sched = solve_schedule(buckets, set(), time_limit=1.0)
    assert_valid(buckets, set(), sched.starts)
    assert (sched.makespan, sched.status, sched.searched) == (12, "optimal", False)


def test_backwards_places_the_chain_that_ends_a_move_where_forward_list_schedules_do_not():
    """GPU 2 receives from GPU 1 (4 ticks) and from GPU 3 (1 tick), and GPU 3's send must end
    before GPU 0 sends to GPU 1 (2 ticks). Forward, every list schedule starts GPU 1's send first
    (the longer bottom level: 4 against 1 + 2) and the chain waits behind it: 7. Backwards, the
    chain's last bucket is placed first and GPU 3's send just before it: 5, the port bound with
    the chain. Above ``LARGE`` buckets (1,400 disjoint copies) ``solve_schedule`` keeps it."""
    from nereus.passes.schedule.cpsat import LARGE

    one = [((1, 2), 4), ((3, 2), 1), ((0, 1), 2)]
    buckets = [Bucket(src, (dst,), "nic", [], duration=d) for (src, dst), d in one]
    prec = {(1, 2)}
    spans = {
        f.__name__: max(s + b.duration for s, b in zip(f(buckets, prec), buckets))
        for f in (serial, insertion, greedy, dense, backwards)
    }
    assert spans == {"serial": 7, "insertion": 7, "greedy": 7, "dense": 7, "backwards": 5}
    assert list_port_bound(buckets, prec) == 5
    assert_valid(buckets, prec, backwards(buckets, prec))
    copies = 1400
    many = [Bucket(4 * k + src, (4 * k + dst,), "nic", [], duration=d) for k in range(copies) for (src, dst), d in one]
    many_prec = {(3 * k + 1, 3 * k + 2) for k in range(copies)}
    assert len(many) > LARGE
    sched = solve_schedule(many, many_prec, time_limit=1.0)
    assert_valid(many, many_prec, sched.starts)
    assert (sched.makespan, sched.status, sched.searched) == (5, "optimal", False)


def test_no_search_above_search_max_buckets(monkeypatch):
    """Six buckets whose list schedules end at 12 and CP-SAT's at 11 (the bound): searched up to
    ``SEARCH_MAX`` buckets; with the cap one bucket lower, the list schedule comes back as it is,
    marked feasible and not searched, and CP-SAT is never called."""
    buckets = [
        Bucket(1, (4, 5, 7), "nic", [], duration=2),
        Bucket(3, (5,), "nic", [], duration=4),
        Bucket(1, (4, 6, 7), "nic", [], duration=1),
        Bucket(1, (5,), "nic", [], duration=2),
        Bucket(3, (4, 6), "nic", [], duration=5),
        Bucket(0, (6,), "nic", [], duration=5),
    ]
    assert min(max(s + b.duration for s, b in zip(f(buckets, set()), buckets)) for f in (greedy, insertion)) == 12
    monkeypatch.setattr(cpsat, "SEARCH_MAX", len(buckets))
    sched = solve_schedule(buckets, set(), time_limit=1.0)
    assert (sched.makespan, sched.status, sched.searched) == (11, "optimal", True)

    def no_search(*args):
        raise AssertionError("CP-SAT ran above SEARCH_MAX")

    monkeypatch.setattr(cpsat, "SEARCH_MAX", len(buckets) - 1)
    monkeypatch.setattr(cpsat.cp_model.CpSolver, "solve", no_search)
    sched = solve_schedule(buckets, set(), time_limit=1.0)
    assert_valid(buckets, set(), sched.starts)
    assert (sched.makespan, sched.bound, sched.status, sched.searched) == (12, 11, "feasible", False)


def test_a_large_transition_is_scheduled_in_one_pass_not_in_quadratic_time():
    """6,000 buckets all sent by GPU 0 (one port thousands wait for): ``greedy`` re-keys them
    all at every placement; above ``LARGE`` buckets the one-pass schedule is used, still valid
    and here at the port bound (the time it saves is measured by ``nereus simulate``, not here)."""
    from nereus.passes.schedule.cpsat import LARGE

    buckets = [Bucket(0, (1 + i % 7,), "nic", [], duration=1 + i % 3) for i in range(LARGE + 2000)]
    prec = {(i, i + 7) for i in range(0, len(buckets) - 7, 97)}
    sched = solve_schedule(buckets, prec, time_limit=1.0)
    assert_valid(buckets, prec, sched.starts)
    assert sched.makespan == port_bound(buckets) and sched.status == "optimal"


def insertion_by_buckets(buckets, prec, chains):
    """``insertion`` as first written: every placed bucket its own span on a port, the gap
    search stepping over them one by one."""
    preds, succs, ports, busy = port_graph(buckets, prec)
    tail = tails_of(buckets, succs) if chains else [0] * len(buckets)
    prio = [
        (-tail[i], -max(busy[p] for p in ps), -len(ps), -b.duration, i) for i, (b, ps) in enumerate(zip(buckets, ports))
    ]
    waiting = {i: len(preds[i]) for i in range(len(buckets))}
    heap = [prio[i] for i in range(len(buckets)) if waiting[i] == 0]
    heapq.heapify(heap)
    placed, start = defaultdict(lambda: ([], [])), {}
    while heap:
        i = heapq.heappop(heap)[-1]
        d = buckets[i].duration
        t = max((start[j] + buckets[j].duration for j in preds[i]), default=0)
        lines = [placed[p] for p in ports[i]]
        moved = True
        while moved:
            moved = False
            for starts, ends in lines:
                k = bisect.bisect_right(ends, t)
                if k < len(starts) and starts[k] < t + d:
                    t, moved = ends[k], True
        start[i] = t
        for starts, ends in lines:
            k = bisect.bisect_left(starts, t)
            starts.insert(k, t)
            ends.insert(k, t + d)
        for j in succs[i]:
            waiting[j] -= 1
            if waiting[j] == 0:
                heapq.heappush(heap, prio[j])
    return [start[i] for i in range(len(buckets))]


@settings(max_examples=300, deadline=None)
@given(instances(), st.booleans())
def test_insertion_on_merged_spans_places_every_bucket_where_per_bucket_spans_do(inst, chains):
    buckets, prec = inst
    assert insertion(buckets, prec, chains) == insertion_by_buckets(buckets, prec, chains)


def greedy_by_lookups(buckets, prec):
    """``greedy`` as first written: every key read port by port into lists built per call."""
    preds, succs, ports, left = port_graph(buckets, prec)
    start, free_at = {}, [0] * len(left)
    waiting = {i: len(preds[i]) for i in range(len(buckets))}

    def key(k):
        earliest = max([free_at[p] for p in ports[k]] + [start[j] + buckets[j].duration for j in preds[k]])
        return (earliest, -max(left[p] for p in ports[k]), -buckets[k].duration, k)

    heap = [key(i) for i in range(len(buckets)) if waiting[i] == 0]
    heapq.heapify(heap)
    while heap:
        k = heapq.heappop(heap)
        i = k[3]
        fresh = key(i)
        if fresh[0] > k[0]:
            heapq.heappush(heap, fresh)
            continue
        start[i] = fresh[0]
        for p in ports[i]:
            free_at[p] = start[i] + buckets[i].duration
            left[p] -= buckets[i].duration
        for j in succs[i]:
            waiting[j] -= 1
            if waiting[j] == 0:
                heapq.heappush(heap, key(j))
    return [start[i] for i in range(len(buckets))]


@settings(max_examples=300, deadline=None)
@given(instances())
def test_greedy_with_item_getters_places_every_bucket_where_lookups_do(inst):
    """The same starts, stale keys and ties included (the spare port and predecessor that make
    every getter return a tuple never decide a key)."""
    buckets, prec = inst
    assert greedy(buckets, prec) == greedy_by_lookups(buckets, prec)


def serial_by_lookups(buckets, prec):
    """``serial`` as first written: a bucket's start read port by port into a list."""
    preds, succs, ports, busy = port_graph(buckets, prec)
    tail = tails_of(buckets, succs)
    start, free_at = [0] * len(buckets), [0] * len(busy)
    waiting = [len(preds[i]) for i in range(len(buckets))]
    release = [0] * len(buckets)
    heap = [(-tail[i], i) for i in range(len(buckets)) if waiting[i] == 0]
    heapq.heapify(heap)
    while heap:
        i = heapq.heappop(heap)[-1]
        d = buckets[i].duration
        s = max([release[i]] + [free_at[p] for p in ports[i]])
        start[i] = s
        for p in ports[i]:
            free_at[p] = s + d
        for j in succs[i]:
            release[j] = max(release[j], s + d)
            waiting[j] -= 1
            if waiting[j] == 0:
                heapq.heappush(heap, (-tail[j], j))
    return start


@settings(max_examples=300, deadline=None)
@given(instances())
def test_serial_with_item_getters_places_every_bucket_where_lookups_do(inst):
    buckets, prec = inst
    assert serial(buckets, prec) == serial_by_lookups(buckets, prec)


def test_greedy_on_cyclic_dependencies_is_an_error():
    import pytest

    buckets = [Bucket(0, (1,), "nic", [], duration=2), Bucket(1, (2,), "nic", [], duration=1)]
    with pytest.raises(ValueError, match="cyclic"):
        greedy(buckets, {(0, 1), (1, 0)})


def test_the_one_pass_schedule_starts_what_long_chains_wait_for_first():
    """As on a 1,024-GPU move into an offloaded plan: each GPU's offload to host (PCIe, long)
    waits for the delivery to that GPU. Three longer transfers from the same sender wait for
    nothing after them. Released in order of time, with the longer first, they would hold the
    sender's port for 15 ticks before any delivery, and the offloads would end at 31. The
    bottom level first: the deliveries go first, the offloads overlap the other transfers, and
    the schedule ends when the sender's port does, at 21 (its busy time: optimal)."""
    other = [Bucket(0, (9,), "nic", [], duration=5) for _ in range(3)]
    deliver = [Bucket(0, (g,), "nic", [], duration=2) for g in (1, 2, 3)]
    offload = [Bucket(g, (g,), "pcie", [], "d2h", duration=10) for g in (1, 2, 3)]
    buckets = other + deliver + offload
    prec = {(3 + k, 6 + k) for k in range(3)}
    starts = serial(buckets, prec)
    assert_valid(buckets, prec, starts)
    assert max(s + b.duration for s, b in zip(starts, buckets)) == 21 == port_bound(buckets)
    assert sorted(starts[3:6]) == [0, 2, 4]  # the deliveries first


def bottom_levels_by_dfs(durations, prec):
    """The bottom levels by memoized recursion over the successors: the definition."""
    succs = defaultdict(list)
    for a, b in prec:
        succs[a].append(b)
    memo = {}

    def level(i):
        if i not in memo:
            memo[i] = durations[i] + max((level(j) for j in succs[i]), default=0)
        return memo[i]

    return [level(i) for i in range(len(durations))]


def port_bound_by_ports(buckets, prec):
    """``port_bound`` as first written: per port, its buckets sorted by head, the work from each."""
    preds = defaultdict(list)
    for a, b in prec:
        preds[b].append(a)
    head = [
        t - b.duration
        for t, b in zip(bottom_levels_by_dfs([b.duration for b in buckets], {(b, a) for a, b in prec}), buckets)
    ]
    on_port = defaultdict(list)
    for i, b in enumerate(buckets):
        for p in bucket_ports(b):
            on_port[p].append(i)
    best = 0
    for idx in on_port.values():
        idx.sort(key=head.__getitem__)
        work = 0
        for i in reversed(idx):
            work += buckets[i].duration
            best = max(best, head[i] + work)
    return best


@settings(max_examples=300, deadline=None)
@given(instances())
def test_bottom_levels_and_port_bound_by_levels_equal_their_definitions(inst):
    """``bottom_levels`` (level by level, each level's edges at once, as a 1,024-GPU move's
    millions of precedences need) and the port bound built on it, against the recursion and the
    per-port loop; from a set of pairs and from ``_precedences``' array alike."""
    buckets, prec = inst
    durations = [b.duration for b in buckets]
    pairs = np.array(sorted(prec), dtype=np.int64).reshape(-1, 2)
    assert bottom_levels(np.array(durations), pairs[:, 0], pairs[:, 1]).tolist() == bottom_levels_by_dfs(
        durations, prec
    )
    assert tails_of(buckets, port_graph(buckets, prec)[1]) == bottom_levels_by_dfs(durations, prec)
    assert list_port_bound(buckets, prec) == list_port_bound(buckets, pairs) == port_bound_by_ports(buckets, prec)


def test_bottom_levels_of_a_cycle_is_an_error():
    import pytest

    with pytest.raises(ValueError, match="cyclic"):
        bottom_levels(np.array([1, 1, 1]), np.array([0, 1, 2]), np.array([1, 2, 1]))


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 40), st.integers(0, 2**20), st.integers(1, 2**20)), min_size=1, max_size=60),
    st.booleans(),
)
def test_entries_by_port_and_head_are_sorted_as_by_a_lexsort(rows, huge):
    """``by_port_and_head``: the entries sorted by port, then head, by packed keys where they fit
    in an int64 (these rows: at most 41 x 2**20 x 2**20) and by a lexsort where they do not
    (``huge`` makes them not fit); ties by duration, which ``port_bound`` does not depend on."""
    from nereus.passes.schedule.list_schedules import by_port_and_head

    port, head, duration = (np.array(c, dtype=np.int64) for c in zip(*rows))
    if huge:
        head[0] = 2**61
    p, h, d = by_port_and_head(port, head, duration)
    entries = list(zip(port.tolist(), head.tolist(), duration.tolist()))
    assert sorted(zip(p.tolist(), h.tolist(), d.tolist())) == sorted(entries)  # the same entries
    assert list(zip(p.tolist(), h.tolist())) == sorted((a, b) for a, b, _ in entries)  # by port, then head
