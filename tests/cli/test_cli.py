"""The command line: exit codes, diagnostics instead of tracebacks, fmt in place and --check."""

import json
import subprocess
import sys

import pytest

from nereus.cli import main

from ..support import EXAMPLES, GOLDEN

GRPO = next(p for p in EXAMPLES if p.name == "grpo_7b_8gpu.nir")


def test_check_ok(capsys):
    assert main(["check", *map(str, EXAMPLES)]) == 0
    assert capsys.readouterr().err == ""


def test_check_reports_every_error_with_location_and_caret(tmp_path, capsys):
    text = GRPO.read_text().replace("kv_heads = 4", "kv_heads = 5", 1).replace("tp = 2", "tp = 3", 1)
    bad = tmp_path / "bad.nir"
    bad.write_text(text)
    assert main(["check", str(bad)]) == 1
    err = capsys.readouterr().err
    kv_line = text.splitlines().index("  kv_heads = 5") + 1
    tp_line = text.splitlines().index("    tp = 3") + 1
    assert f"{bad}:{kv_line}:3: error: heads = 28 is not a multiple of kv_heads = 5" in err
    assert f"{bad}:{tp_line}:5: error: actor.generate: tp = 3 does not divide heads = 28" in err
    assert "    tp = 3\n" in err and "^" in err
    assert "Traceback" not in err


def test_missing_file_directory_and_binary(tmp_path, capsys):
    binary = tmp_path / "x.nir"
    binary.write_bytes(b"\xff\xfe\x00cluster")
    assert main(["check", str(tmp_path / "nope.nir"), str(tmp_path), str(binary)]) == 1
    err = capsys.readouterr().err
    assert "nope.nir: error: no such file" in err
    assert "is a directory" in err
    assert "not UTF-8 text" in err
    assert "Traceback" not in err


def test_fmt_rewrites_in_place_keeping_comments(tmp_path, capsys):
    src = tmp_path / "m.nir"
    src.write_text(
        "// the model\nmodel @m {\n  vocab=32000 , layers = 2 // tiny\n  hidden = 64, heads = 4, kv_heads = 4, ffn = "
        "128\n}\n"
    )
    assert main(["fmt", "--check", str(src)]) == 1
    assert main(["fmt", str(src)]) == 0
    out = src.read_text()
    assert out == (
        "// the model\nmodel @m {\n  layers = 2  // tiny\n  hidden = 64\n  heads = 4\n  kv_heads = 4\n"
        "  ffn = 128\n  vocab = 32000\n}\n"
    )
    assert main(["fmt", "--check", str(src)]) == 0
    capsys.readouterr()


def test_fmt_check_on_canonical_examples():
    assert main(["fmt", "--check", *map(str, EXAMPLES)]) == 0


def test_python_dash_m_and_usage_errors(tmp_path):
    run = lambda *a: subprocess.run([sys.executable, "-m", "nereus", *a], capture_output=True, text=True, timeout=120)
    ok = run("check", str(GRPO))
    assert ok.returncode == 0, ok.stderr
    usage = run("frobnicate")
    assert usage.returncode == 2 and "Traceback" not in usage.stderr
    bad = tmp_path / "t.nir"
    bad.write_text("cluster @c {\n  nodes = 2\n")
    r = run("check", str(bad))
    assert r.returncode == 1
    assert f"{bad}:2:12: error: unexpected end of file" in r.stderr
    assert "the block opened at line 1 is not closed" in r.stderr
    assert "Traceback" not in r.stderr


def bench_json(name: str, timeout: float = 600) -> dict:
    """``nereus bench NAME --quick --json`` in a process of its own: it exits 0 and its stdout is one
    JSON document and nothing else (engines' and libraries' logs go to stderr), which is returned."""
    r = subprocess.run(
        [sys.executable, "-m", "nereus", "bench", name, "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)  # fails on any line that is not the document's


def test_bench_parse_json_smoke():
    data = bench_json("parse")
    assert [r["gpus"] for r in data["rows"]] == [128, 256, 512, 1024]
    assert all(r["shards"] == r["gpus"] for r in data["rows"])
    assert all(r["canonical_ms"] > 0 and r["expanded_ms"] > 0 for r in data["rows"])


def test_bench_unknown_name(capsys):
    assert main(["bench", "nope"]) == 1
    assert "known: parse, estimate, plan-search, transition" in capsys.readouterr().err


def test_bench_estimate_json_smoke():
    data = bench_json("estimate")
    assert data["candidates"] == 10_000 and data["plan_gpus"] == 1024
    assert data["vectorized_s"] > 0 and data["one_at_a_time_s"] > data["vectorized_s"]


def test_bench_plan_search_json_smoke():
    data = bench_json("plan-search")
    rows = {(r["job"], r["gpus"]): r for r in data["rows"]}
    assert all(r["status"] == "optimal" for r in rows.values())
    assert rows[("PPO 8B", 16)]["greedy_over_searched"] >= 1.0  # the optimum is never worse than the peer


def test_bench_truth_json_smoke():
    data = bench_json("truth")
    assert set(data["error_prior"]) == {"generate", "infer", "train"}
    assert data["ranking_pairs"] > 0 and 0 <= data["ranking_wrong"] <= data["ranking_pairs"]
    assert data["seconds_per_evaluation"] > 0 and data["distinct_conditions"] == 100


def test_bench_transition_json_smoke():
    data = bench_json("transition")
    for row in data["rows"]:
        assert row["bytes_moved"] == row["lower_bound"]  # the planner reaches the lower bound
        assert row["makespan_s"] >= row["port_bound_s"] > 0
        assert all(v["bytes"] > row["bytes_moved"] for v in row["peers"].values())
    assert [row["case"] for row in data["rows"]] == [
        "TP8 PP4 -> TP4 PP8",
        "DP 32 -> 30: 64 GPUs reclaimed",
        "TP8 PP4 ZeRO-1 -> TP4 ZeRO-3",
        "TP8 PP4 -> TP4 PP8, no memory to spare",
        "TP4 ZeRO-3 -> TP8 PP4 ZeRO-1, no memory to spare",
    ]
    assert [row["staged_bytes"] > 0 for row in data["rows"]] == [
        False,
        False,
        False,
        True,
        True,
    ]  # no memory to spare: staged


def test_bench_reshard_json_smoke():
    """Four gloo processes, two small cases: every method bit-exact; Nereus sends what it planned."""
    out = bench_json("reshard")
    assert set(out["cases"]) == {"tp4-tp2x2 x4", "train-gen x4"}
    for case in out["cases"].values():
        assert all(case[m]["exact"] for m in ("nereus", "nereus+remap", "dcp", "allgather", "gather+bcast"))
        assert case["nereus"]["sent_MB"] == pytest.approx(case["planned_MB"])
        # every byte sent is checksummed by its sender and its receiver, and no more (a payload
        # sent to several is summed once); packed at most into a buffer and out of one
        assert 1.0 <= case["nereus"]["hashed_per_byte"] <= 2.0 and case["nereus"]["packed_per_byte"] <= 2.0
        assert case["nereus"]["cpu_s"] > 0 and case["floor"]["cpu_s"] > 0
        assert case["nereus+remap"]["sent_MB"] == pytest.approx(case["planned_remap_MB"])
        assert case["planned_remap_MB"] <= case["planned_MB"]
        assert case["bound_s"] > 0


def test_bench_ep_json_smoke():
    """``nereus bench ep --quick --json``: the two expert-parallel moves on 4 processes, every way
    bit-exact, Nereus sending its planned bytes, the experts' peers sending more."""
    out = bench_json("ep")
    assert set(out["cases"]) == {"ep4-ep2 x4", "ep4-tp2ep2 x4"}
    for case in out["cases"].values():
        methods = ("nereus", "nereus+remap", "dcp", "allgather", "gather+bcast", "holder-bcast")
        assert all(case[m]["exact"] for m in methods)
        assert case["nereus"]["sent_MB"] == pytest.approx(case["planned_MB"])
        assert case["allgather"]["sent_MB"] > case["nereus"]["sent_MB"]
        assert case["holder-bcast"]["sent_MB"] > case["nereus"]["sent_MB"]


def test_bench_push_smoke():
    """Four gloo processes, three trainer layouts, no engines: the three ways push the same
    weights bit for bit (checked inside), and Nereus receives exactly the lower bound."""
    from nereus.bench.push_bench import run

    out = run(quick=True, json_output=True, engines=False)
    assert set(out["layouts"]) == {"tp2xdp2", "pp2xtp2", "tp4"}
    for row in out["layouts"].values():
        assert row["bytes_at_bound"]
        assert row["verl_bytes"] >= row["nereus_bytes"] and row["openrlhf_bytes"] > row["nereus_bytes"]


@pytest.mark.slow
def test_bench_elastic_smoke():
    """A rank killed in step 15 of a DDP job checkpointed every 10 steps: Nereus recovers on the
    same processes and reruns only that step; the restart loads step 10's checkpoint on 3 new
    processes and redoes 5 more. Both reach the same loss at step 15 (the same state, up to
    reduction order over 3 ranks against 4). The killed rank's and the restart's messages stay
    off stdout, which holds the JSON document alone."""
    (case,) = bench_json("elastic")["cases"]
    assert case["lost_steps_nereus"] == 0 and case["lost_steps_restart"] == 5
    assert case["loss_nereus"] == pytest.approx(case["loss_restart"], rel=1e-4)
    assert 0 < case["detect_s"] < case["nereus_s"] and case["restart_up_s"] < case["restart_s"]


def test_an_output_path_that_cannot_be_written_is_a_diagnostic(tmp_path, capsys):
    bad = str(tmp_path / "no" / "such" / "dir" / "out")
    assert main(["opt", str(GRPO), "-p", "estimate", "-o", bad + ".nir"]) == 1
    err = capsys.readouterr().err
    assert f"{bad}.nir: error: cannot write: No such file or directory" in err
    assert "Traceback" not in err


def test_a_plan_that_overflows_a_small_gpu_names_sizes_in_readable_units(tmp_path, capsys):
    golden = GOLDEN / "plan-transition" / "staging.nir"
    small = tmp_path / "small.nir"
    small.write_text(golden.read_text().replace("gpu_memory = 640KiB", "gpu_memory = 600KiB"))
    assert main(["opt", str(small), "-p", "estimate"]) == 1
    err = capsys.readouterr().err
    assert "error: ref.infer needs 625.25 KiB on GPU 0, 25,856 bytes more than its 600.00 KiB" in err
    assert "hint: breakdown: weights 449.25 KiB, activations 176.00 KiB" in err


def test_lower_prints_a_summary_by_default_and_the_folded_program_with_full(capsys):
    """``nereus lower``: a few tables (per round and link, per rank; the totals and the makespan);
    ``--full``: the whole program with layers.A..B ranges, which unfolds to the per-layer one."""
    from nereus import parse, run_pipeline
    from nereus.backend.fold import unfold_listing
    from nereus.backend.lower import lower
    from nereus.backend.program import print_program

    case = GOLDEN / "plan-transition" / "tp4_to_tp2.nir"
    argv = ["lower", str(case), "-p", "plan-transition{to=@b},schedule-transfers"]
    assert main(argv) == 0
    summary = capsys.readouterr().out
    m = run_pipeline(parse(case.read_text(), str(case)), "plan-transition{to=@b},schedule-transfers")
    prog = lower(m, "a_to_b")
    sent = sum(prog.sent_bytes(r) for r in range(prog.world))
    assert sent == m.transitions["a_to_b"].bytes_moved
    assert f"moves {sent:,} bytes in " in summary
    assert "per round" in summary and "per rank" in summary and "estimated makespan 80us" in summary
    assert len(summary.splitlines()) < 40
    assert main([*argv, "--full"]) == 0
    full = capsys.readouterr().out
    per_layer = print_program(prog)
    assert "layers.0..3." in full and len(full.splitlines()) * 2 < len(per_layer.splitlines())
    assert unfold_listing(full.splitlines()) == per_layer.splitlines()


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--join", "foo"], "--join 'foo': give the job's store as HOST:PORT"),
        (["--join", "node1:http"], "--join 'node1:http': the port must be a number"),
        (["--master", "node1:99999"], "--master 'node1:99999': the port must be a number"),
    ],
)
def test_launch_says_what_is_wrong_with_an_address_before_starting_anything(flags, said, capsys, tmp_path):
    script = tmp_path / "never.py"
    script.write_text(f"open({str(tmp_path / 'ran')!r}, 'w')\n")
    assert main(["launch", "--nproc", "1", *flags, str(script)]) == 2
    assert f"nereus launch: {said}" in capsys.readouterr().err
    assert not (tmp_path / "ran").exists()
