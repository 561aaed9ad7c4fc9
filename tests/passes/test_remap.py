"""remap: plan B's GPUs renamed (inside nodes, whole nodes) so the transition moves the fewest
bytes; the best renaming equals brute force, the plan's cost does not change, and the
transition after it is exact with the lower bound it predicts."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import nereus
from nereus.passes.transition.plan_transition import plan_transition
from nereus.passes.transition.remap import best_permutation
from nereus.runtime.reference_executor import simulate
from nereus.testing.cases import case_module


def brute_force(value, per_node, can_host, used):
    gpus = len(value)
    nodes = gpus // per_node
    best = None
    for order in itertools.permutations(range(nodes)):  # plan B's node b goes to physical node order[b]
        for inner in itertools.product(*[list(itertools.permutations(range(per_node)))] * nodes):
            pi = [order[j // per_node] * per_node + inner[j // per_node][j % per_node] for j in range(gpus)]
            if any(used[j] and not can_host[pi[j]] for j in range(gpus)):
                continue
            v = sum(value[pi[j], j] for j in range(gpus))
            best = v if best is None else max(best, v)
    return best


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([(2, 2), (2, 3), (3, 2)]), st.integers(0, 2**32 - 1), st.integers(0, 2))
def test_best_permutation_equals_brute_force(shape, seed, holes):
    nodes, per_node = shape
    gpus = nodes * per_node
    rng = np.random.default_rng(seed)
    value = rng.integers(0, 100, size=(gpus, gpus)).astype(float)
    can_host = np.ones(gpus, dtype=bool)
    can_host[rng.choice(gpus, size=holes, replace=False)] = False
    used = np.ones(gpus, dtype=bool)
    used[rng.choice(gpus, size=holes, replace=False)] = False  # as many idle parts as unusable GPUs
    pi = best_permutation(value, per_node, can_host, used)
    best = brute_force(value, per_node, can_host, used)
    if best is None:  # the unusable GPUs and the idle parts are in different nodes
        assert pi is None
        return
    assert sorted(pi) == list(range(gpus))  # a permutation
    assert all(pi[j] // per_node == pi[j - j % per_node] // per_node for j in range(gpus))  # nodes stay together
    assert not any(used[j] and not can_host[pi[j]] for j in range(gpus))
    assert sum(value[pi[j], j] for j in range(gpus)) == best


@pytest.mark.parametrize(
    "case,n,after", [("tp4-tp2x2", 4, 2 / 3), ("tp2x2-tp4", 8, 0.0), ("pp2-pp4", 4, 0.0), ("train-gen", 4, 1.0)]
)
def test_remap_moves_fewer_bytes_and_keeps_the_plan_cost(case, n, after):
    m = case_module(case, n, hidden=64, layers=4)
    nereus.run_pipeline(m, "estimate")
    step = m.plans["b"].step_time
    written = plan_transition(m, "a", "b", "written").lower_bound
    nereus.run_pipeline(m, "remap{to=@b},estimate,plan-transition{to=@b}")
    rec = m.plans["b"].remap
    t = m.transitions["a_to_b"]
    assert rec.before == written and rec.after == t.lower_bound == t.bytes_moved
    assert t.lower_bound == pytest.approx(after * written)
    assert (rec.gpus > 0) == (after < 1.0)
    assert m.plans["b"].step_time == step  # same shape, same links: same cost
    nereus.verify(m)
    assert simulate(m, t).mismatches == []
    text = nereus.print_ir(m)
    assert "remap = remap(before = " in text and nereus.parse(text) == m


def test_unavailable_gpus_never_take_plan_b_state():
    """TP 4 x DP 2 on 8 GPUs -> TP 2 x DP 2 on four of them, GPU 1 failed: plan B as written
    uses GPU 6 instead; remap finds a better four, never GPU 1."""
    m = case_module("tp4-tp2", 8, hidden=64, layers=4)
    b = m.plans["b"]
    m.clusters["after"] = nereus.ir.Cluster(**{**vars(m.clusters[b.cluster]), "name": "after", "unavailable": [1]})
    b.cluster = "after"
    b.layouts["actor.train"].mesh = [0, 6, 2, 3]
    for key in [k for k in m.emus if k[0] == "b"]:
        del m.emus[key]
    nereus.run_pipeline(m, "remap{to=@b},plan-transition{to=@b}")
    assert 1 not in b.layouts["actor.train"].mesh
    assert b.remap.after < b.remap.before
    t = m.transitions["a_to_b"]
    assert t.lower_bound == b.remap.after
    assert simulate(m, t).mismatches == []


@pytest.mark.parametrize("case,n", [("tp4-tp2x2", 4), ("pp2-pp4", 4), ("train-gen", 4), ("dp4-dp2", 8), ("ppo", 16)])
def test_reuse_matrix_equals_box_arithmetic_per_gpu_pair(case, n):
    """``reuse_matrix``'s value[i, j] (bytes GPU j needs under plan B that GPU i holds under plan A)
    against ``lower_bound``'s box arithmetic, which shares no code with its cell grid. ``ppo``: the
    8B PPO example to the plan searched for it, where a GPU holds overlapping slices of one model
    for several model-stages (each byte counts once)."""
    from collections import defaultdict

    from nereus.ir.model import state_dtype_bytes
    from nereus.passes.transition.derive_emus import derive_missing_emus
    from nereus.passes.transition.lower_bound import missing_volume
    from nereus.passes.transition.remap import reuse_matrix

    if case == "ppo":
        from ..support import EXAMPLES

        m = nereus.parse(next(p for p in EXAMPLES if p.name == "ppo_8b_16gpu.nir").read_text())
        nereus.run_pipeline(m, "plan-search{into=@b}")
        m.plans["a"] = m.plans.pop("ppo_p0")
        m.plans["a"].name = "a"
        m.emus = {("a" if k[0] == "ppo_p0" else k[0],) + k[1:]: e for k, e in m.emus.items()}
    else:
        m = case_module(case, n, hidden=64, layers=4)
    for p in ("a", "b"):
        derive_missing_emus(m, p)
    boxes = {p: defaultdict(set) for p in ("a", "b")}  # plan -> (gpu, model, state, family) -> regions
    for (plan, ms, _), emu in m.emus.items():
        for s in emu.shards:
            for e in s.entries:
                boxes[plan][(s.gpu, ms.rpartition(".")[0], e.state, e.family)].add(e.region)
    value, need = reuse_matrix(m, "a", "b", n, lost=set())
    for j in range(n):
        for i in range(n):
            want = 0
            for (g, model, state, family), regions in boxes["b"].items():
                if g != j:
                    continue
                have = frozenset(boxes["a"].get((i, model, state, family), ()))
                size = state_dtype_bytes(m.models[model], state)
                want += (
                    missing_volume(frozenset(regions), frozenset()) - missing_volume(frozenset(regions), have)
                ) * size
            assert value[i, j] == want, (i, j)
        assert need[j] == sum(
            missing_volume(frozenset(r), frozenset()) * state_dtype_bytes(m.models[k[1]], k[2])
            for k, r in boxes["b"].items()
            if k[0] == j
        )


def test_holdings_remembered_only_for_the_emus_they_were_read_from():
    """``plan_holdings`` hands back what it read for the same EMUs (kept in ``m.analyses``), and
    reads again once remap replaced plan B's EMUs, or a shard was replaced by one with another
    GPU or entry tuple; EMUs cannot change in place; a deep copy shares what was read."""
    import copy
    import dataclasses
    from dataclasses import replace

    import pytest

    from nereus.passes.transition.derive_emus import derive_missing_emus
    from nereus.passes.transition.holdings import plan_holdings, read_holdings

    m = case_module("tp2x2-tp4", 8, hidden=64, layers=4)
    for p in ("a", "b"):
        derive_missing_emus(m, p)

    def fresh(plan):
        return dict(read_holdings(sorted((k, e) for k, e in m.emus.items() if k[0] == plan)))

    first = plan_holdings(m, "b")
    assert plan_holdings(m, "b") == first == fresh("b")
    again = plan_holdings(m, "b")
    assert all(again[k] is first[k] for k in first)  # remembered, not read again
    key = next(k for k in m.emus if k[0] == "b")
    emu = m.emus[key]
    m.emus[key] = replace(emu, shards=[replace(s, gpu=7 - s.gpu) for s in emu.shards])  # as remap rewrites
    assert plan_holdings(m, "b") == fresh("b") != first
    shard = m.emus[key].shards[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        shard.gpu = 5 - shard.gpu  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.emus[key].shards[0].entries[0].box = ()  # type: ignore[misc]
    emu = m.emus[key]
    m.emus[key] = replace(emu, shards=(replace(emu.shards[0], entries=emu.shards[0].entries[:-1]), *emu.shards[1:]))
    assert plan_holdings(m, "b") == fresh("b")
    assert plan_holdings(m, "a") == fresh("a")
    copied = copy.deepcopy(m)
    assert copied.emus[key] is m.emus[key]  # values: shared, not copied
    held = plan_holdings(m, "a")
    assert all(plan_holdings(copied, "a")[k] is held[k] for k in held)


def test_families_that_lie_alike_add_their_bytes_and_others_keep_their_own():
    """``reuse_of`` finds the terms of families that lie alike once and adds their cells' bytes:
    against box arithmetic per GPU pair, on three families of one shape. ``scaled`` cuts its
    grid as ``overlapping`` does (ten times larger, 2-byte elements: it shares the terms);
    ``gapped`` has the same GPUs, slice pattern and number of cuts but other spans (its middle
    cell is on no GPU of plan A), so it must not share them."""
    from nereus.ir import ShardRef
    from nereus.passes.transition.grid import Holding
    from nereus.passes.transition.remap import reuse_of

    def pieces(regions, ms):
        return [Holding(ShardRef(ms, i, 0, 0), gpu, (r,), i) for i, (gpu, r) in enumerate(regions)]

    families = {  # key -> (plan A's (GPU, slice)s, plan B's, element bytes)
        ("m", "weight", "overlapping"): ([(0, (0, 3)), (1, (1, 4))], [(2, (0, 4)), (1, (0, 2))], 4),
        ("m", "weight", "scaled"): ([(0, (0, 30)), (1, (10, 40))], [(2, (0, 40)), (1, (0, 20))], 2),
        ("m", "weight", "gapped"): ([(0, (0, 1)), (1, (3, 4))], [(2, (0, 4)), (1, (0, 2))], 8),
    }
    src_all = {k: pieces(a, "m.train") for k, (a, _, _) in families.items()}
    dst_all = {k: pieces(b, "m.generate") for k, (_, b, _) in families.items()}
    value, need = reuse_of(src_all, dst_all, {k: f[2] for k, f in families.items()}, 3, lost=set())
    want, want_need = np.zeros((3, 3)), np.zeros(3)
    for a, b, size in families.values():
        for j, (lo, hi) in b:
            want_need[j] += (hi - lo) * size
            for i in range(3):
                held = {x for g, (l2, h2) in a if g == i for x in range(l2, h2)}
                want[i, j] += len(held & set(range(lo, hi))) * size
    assert (value == want).all() and (need == want_need).all()
