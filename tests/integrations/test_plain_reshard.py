"""``nereus.reshard``: a model's shape and two layouts in, this rank's new shards out, bit-exact,
on real gloo processes; no cluster or workload figures asked of the user."""

import pytest

import nereus
from nereus.runtime.launch import run_local

from ..support import runtime_workers as w


def test_weights_move_between_tp_dp_pp_and_cp_layouts_bit_exact():
    pairs = [
        ({"tp": 4}, {"tp": 2, "dp": 2}),  # TP 4 -> TP 2 x DP 2 (evaluation on fewer GPUs per replica)
        ({"tp": 2, "dp": 2}, {"pp": 2, "dp": 2, "mesh": [3, 2, 1, 0]}),  # to a pipeline on renamed GPUs
        ({"tp": 2, "pp": 2}, {"tp": 1, "dp": 2}),
    ]  # scale in to 2 ranks (ranks 2, 3 only send)
    assert run_local(w.run_plain_reshard, 4, pairs, False, timeout=180) == [[[]] * 3] * 4


def test_optimizer_state_moves_under_zero_over_dp_and_cp():
    pairs = [({"tp": 2, "dp": 2, "zero": 1}, {"tp": 1, "dp": 2, "cp": 2, "zero": 3})]
    assert run_local(w.run_plain_reshard, 4, pairs, True, timeout=180) == [[[]]] * 4


def test_a_layout_the_model_cannot_take_is_a_diagnostic_before_any_message():
    with pytest.raises(nereus.DiagnosticError, match="tp = 3 does not divide heads = 8"):
        nereus.reshard_shards(w.RESHARD_MODEL, {"tp": 3}, 0, world=4)


def test_a_reshard_runs_in_a_process_group_of_some_ranks_while_the_world_does_something_else():
    """``nereus.reshard(group=)``: ranks 1-3 move TP 3 -> DP 3 (a broadcast-heavy move, chained
    inside the group) while rank 0, outside it, all-reduces with rank 1 before and after; every
    shard bit-exact."""
    results = run_local(w.run_reshard_in_subgroup, 4, {"tp": 1, "dp": 1, "pp": 3}, {"dp": 3}, timeout=180)
    assert [r["bad"] for r in results] == [[], [], [], []]
    assert [r["sums"] for r in results] == [[2.0, 2.0], [2.0, 2.0], [], []]
