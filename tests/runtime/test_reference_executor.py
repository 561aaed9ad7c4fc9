"""The numpy reference executor (``runtime/reference_executor.py``) refuses what it cannot check."""

import pytest

import nereus
from nereus.ir import Layout, Plan
from nereus.runtime.reference_executor import simulate

from ..support.jobs import job


def _pair():
    m = job()
    mk = lambda mesh: {
        ms: Layout(model_stage=ms, tp=2, pp=1, dp=1, layers=[(0, 4)], mesh=mesh)
        for ms in ("actor.generate", "ref.infer", "actor.train")
    }
    m.plans["a"] = Plan(name="a", workload="w", cluster="c", layouts=mk([0, 1]))
    m.plans["b"] = Plan(name="b", workload="w", cluster="c", layouts=mk([2, 3]))
    return nereus.run_pipeline(m, "plan-transition{to=@b}")


def test_a_free_that_matches_no_held_slice_is_an_error():
    m = _pair()
    t = m.transitions["a_to_b"]
    assert simulate(m, t).mismatches == []
    free = next(op for op in t.ops if op.spec.frees)
    (lo, hi), *rest = free.box
    free.box = ((lo, lo + (hi - lo) // 2), *rest)  # half of the slice: a free that frees nothing whole
    with pytest.raises(ValueError, match="holds as one slice"):
        simulate(m, t)
