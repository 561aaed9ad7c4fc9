"""``nereus bench NAME --json`` prints one JSON document on stdout and nothing else, for the
benchmarks whose engines or processes print: push (vLLM's log lines), controller (four gloo
processes), and the validation benches (the other benchmarks' smoke tests are in ``test_cli.py``)."""

import pytest

from .test_cli import bench_json


@pytest.mark.slow
def test_bench_push_with_engines_prints_one_json_document():
    """With vLLM engines, whose log lines go to stdout when nothing redirects them: the document
    alone on stdout, every way of pushing checked bit for bit inside."""
    out = bench_json("push")
    assert set(out["layouts"]) == {"tp2xdp2", "pp2xtp2", "tp4"}
    assert all(row["bytes_at_bound"] for row in out["layouts"].values())
    for row in out["layouts"].values():  # the engines' load in CPU seconds, and what it leaves for overlap
        assert row["load"] > 0 and row["load_cpu_s"] > 0
        assert row["end_to_end_cpu_floor"] > 0 and row["end_to_end_ratio_bound"] > 0
        # end to end, up to the engines serving: the overlapped ways and the serial one, each measured
        assert row["waves"] > 1
        for way in ("nereus", "nereus_serial", "verl", "openrlhf"):
            assert row[f"{way}_e2e"] > 0 and row[f"{way}_e2e_cpu_s"] > 0


@pytest.mark.slow
def test_bench_controller_json_smoke():
    """Four models on four gloo processes: the Controller's stays, a forced move when rank 3
    leaves, and the same move the DCP way (every rank saves before the leave, the three left
    load after it)."""
    out = bench_json("controller")
    assert out["stays"] > 0 and out["models"] == ["actor.train", "critic.train", "ref.infer", "reward.infer"]
    assert out["move_s"] > 0 and out["dcp_save_s"] > 0 and out["dcp_load_s"] > 0
    assert max(out["dcp_save_s"], out["dcp_load_s"]) < out["dcp_s"] <= out["dcp_save_s"] + out["dcp_load_s"] + 1e-9


def test_bench_validate_and_calibrate_print_one_json_document():
    validate = bench_json("validate")
    assert validate["holdout"]["leave_one_source_out"]["n"] == validate["cases"]
    assert bench_json("calibrate")["benchmark"] == "calibrate"
