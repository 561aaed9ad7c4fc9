"""The Controller around a loop on 4 gloo processes: measurements gathered, one decision on every
rank, the transition run on the live state, bit-exact; a failed transition rolls back."""

import pytest

from nereus.runtime.launch import run_local

from . import controller_workers as w


@pytest.mark.slow
def test_a_rank_announced_to_leave_hands_its_state_over_and_the_rest_go_on():
    results = run_local(w.run_loop, 4, "leave", timeout=240)
    for rank, res in enumerate(results):
        assert res["actions"][:2] == ["stay", "transition"], res
        if rank == 3:
            assert not res["active"] and len(res["actions"]) == 2  # it left after handing over
        else:
            assert res["active"] and res["exact"] and res["loads"] == 1, res
            assert res["actions"] == ["stay", "transition", "stay"]  # the survivors go on
    assert len({tuple(r["plans"][:2]) for r in results}) == 1  # every rank took the same decision


@pytest.mark.slow
def test_longer_responses_make_an_admitted_move_on_every_rank():
    results = run_local(w.run_loop, 4, "grow", timeout=240)
    for res in results:
        assert res["actions"][0] == "stay" and "transition" in res["actions"], res
        assert res["exact"] and res["loads"] >= 1
    assert len({tuple(r["plans"]) for r in results}) == 1


@pytest.mark.slow
def test_a_transition_that_fails_rolls_back_and_the_loop_goes_on_under_plan_a():
    results = run_local(w.run_loop, 4, "fault", timeout=240)
    for res in results:
        assert res["actions"] == ["stay", "rolled_back", "stay"], res  # the loop went on
        assert res["plans"] == ["a", "a", "a"] and res["loads"] == 0
        assert res["active"] and res["exact"]  # plan A's state, untouched, on every rank
