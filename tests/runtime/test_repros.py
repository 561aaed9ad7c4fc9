"""Regression tests for runtime defects found by an independent check (tests/runtime/repros,
copied from shared/repros/runtime), on real gloo processes."""

from pathlib import Path

import pytest

from nereus.ir.model import DTYPE_BYTES
from nereus.runtime.launch import LaunchError, run_local
from nereus.runtime.state import TORCH_DTYPES

from ..support import repro_workers as w

REPROS = Path(__file__).parent / "repros"
TIMEOUT = 6.0


@pytest.mark.slow
def test_a_dead_rank_with_broadcast_subgroups_fails_the_survivors_within_the_timeout():
    """Rank 3 dies before execute; the program broadcasts in a subgroup. Before the fix the
    survivors were still waiting after 90 s (group creation had gloo's 30-minute default)."""
    path = str(REPROS / "dead_rank_broadcast_subgroup.nir")
    with pytest.raises(LaunchError) as e:
        run_local(w.run_repro, 4, path, 3, TIMEOUT, timeout=90)
    assert set(e.value.errors) == {3}  # only the dead rank
    for rank in (0, 1, 2):
        res = e.value.results[rank]
        assert res["groups"] > 0  # the program does create a subgroup
        err = res["error"]
        assert err is not None, f"rank {rank} committed without rank 3"
        assert err["unresponsive"] and err["rank"] == rank and err["intact"]
        assert "is intact" in err["text"]
        assert res["intact"]
        # every collective is bounded: the program digest exchange, then the agreement
        assert res["elapsed"] < 2 * TIMEOUT + 5, res["elapsed"]


@pytest.mark.slow
def test_fp8_weights_lower_and_move_bit_exactly():
    """dtype = fp8 passed check and plan-transition, then lower died with KeyError: 'fp8'."""
    results = run_local(w.run_repro, 2, str(REPROS / "fp8_lowering.nir"), None, 30.0, timeout=120)
    for res in results:
        assert res["error"] is None and res["exact"], res


def test_every_dtype_the_ir_accepts_has_a_torch_dtype():
    assert set(TORCH_DTYPES) == set(DTYPE_BYTES)
    assert all(TORCH_DTYPES[name].itemsize == size for name, size in DTYPE_BYTES.items())


@pytest.mark.slow
def test_ranks_running_different_programs_refuse_and_say_so():
    results = run_local(w.run_mismatched_programs, 2, str(REPROS / "fp8_lowering.nir"), timeout=120)
    for res in results:
        assert res["error"] is not None and "run a different program" in res["error"]
        assert "is intact" in res["error"]
