"""The transition's lower bound is computed from the EMU boxes alone (``passes/lower_bound.py``),
independently of the planner; here it is checked against element-by-element brute force, and
the planner's bytes against it."""

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nereus
from nereus.ir.model import state_dtype_bytes
from nereus.passes.transition.derive_emus import derive_missing_emus
from nereus.passes.transition.lower_bound import lower_bound

from .test_transition import plan_pairs


def brute_force(m, source: str, target: str, lost=frozenset()) -> int:
    """Mark every element of every tensor each GPU needs (plan B) and holds (plan A) on full-size
    boolean arrays; count what is needed and not held."""
    need, held = {}, {}
    for (plan, ms, _dp), emu in m.emus.items():
        if plan not in (source, target):
            continue
        model = m.models[ms.rpartition(".")[0]]
        for s in emu.shards:
            if plan == source and s.gpu in lost:
                continue
            for e in s.entries:
                spec = model.tensors[e.family]
                shape = ((model.layers,) if spec.per_layer else ()) + tuple(spec.shape)
                masks = held if plan == source else need
                key = (s.gpu, model.name, e.state, e.family)
                if key not in masks:
                    masks[key] = np.zeros(shape, dtype=bool)
                masks[key][tuple(slice(lo, hi) for lo, hi in e.region)] = True
    total = 0
    for key, mask in need.items():
        have = held.get(key, np.zeros_like(mask))
        total += int((mask & ~have).sum()) * state_dtype_bytes(m.models[key[1]], key[2])
    return total


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(plan_pairs(), st.sets(st.integers(0, 7), max_size=3))
def test_the_bound_equals_brute_force_and_the_planner_moves_exactly_it(m, lost):
    for plan in ("a", "b"):
        derive_missing_emus(m, plan)
    assert lower_bound(m, "a", "b") == brute_force(m, "a", "b")
    assert lower_bound(m, "a", "b", set(lost)) == brute_force(m, "a", "b", set(lost))
    nereus.run_pipeline(m, "plan-transition{to=@b,drain=true}")  # drain: no GPU's state is lost
    t = m.transitions["a_to_b"]
    assert t.bytes_moved == t.lower_bound == brute_force(m, "a", "b")


def test_the_bound_counts_an_element_once_per_gpu_however_many_stages_need_it():
    """Two model-stages of one model on one GPU need the same slice: it crosses a link once."""
    from nereus.ir import Layout, Plan

    from ..support.jobs import job

    m = job()
    one = lambda ms, mesh: Layout(model_stage=ms, tp=1, pp=1, dp=1, layers=[(0, 4)], mesh=mesh)
    m.plans["a"] = Plan(
        name="a",
        workload="w",
        cluster="c",
        layouts={ms: one(ms, [0]) for ms in ("actor.generate", "ref.infer", "actor.train")},
    )
    m.plans["b"] = Plan(
        name="b",
        workload="w",
        cluster="c",
        layouts={ms: one(ms, [1]) for ms in ("actor.generate", "ref.infer", "actor.train")},
    )
    for plan in ("a", "b"):
        derive_missing_emus(m, plan)
    actor, ref = m.models["actor"], m.models["ref"]
    # actor weights once (generate and train share them), fp32 master and two Adam moments, ref weights
    by_hand = actor.num_params() * (actor.dtype_bytes + 3 * 4) + ref.num_params() * ref.dtype_bytes
    assert lower_bound(m, "a", "b") == brute_force(m, "a", "b") == by_hand


_span = st.tuples(st.integers(0, 5), st.integers(1, 4)).map(lambda t: (t[0], t[0] + t[1]))
_box = st.tuples(_span, _span)


@settings(max_examples=300, deadline=None)
@given(need=st.sets(_box, min_size=1, max_size=3), have=st.sets(_box, max_size=3))
def test_missing_volume_equals_counting_cells(need, have):
    """Every path of ``missing_volume`` (one needed box inside a held one, apart from all, or cut
    on the grid) against marking 2-D cells one by one."""
    from nereus.passes.transition.lower_bound import missing_volume

    wanted, there = np.zeros((10, 10), bool), np.zeros((10, 10), bool)
    for grid, boxes in ((wanted, need), (there, have)):
        for (a, b), (c, d) in boxes:
            grid[a:b, c:d] = True
    assert missing_volume(frozenset(need), frozenset(have)) == int((wanted & ~there).sum())
