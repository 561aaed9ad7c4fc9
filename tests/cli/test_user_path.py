"""What a new user trips on after the plan is valid (issue 18): plans that explain their
numbers, admit's cost in parts and units, `nereus diff`, pass errors that name what exists,
`--version`, goldens that find their files, and pipelines on invalid input."""

import re
import subprocess
import sys
import textwrap

import pytest

import nereus
from nereus.cli import main

from ..support import GOLDEN, example

GRPO = example("grpo_7b_8gpu.nir")
TP4_TO_TP2 = GOLDEN / "plan-transition" / "tp4_to_tp2.nir"


def _plan_only(path) -> str:
    """The example without estimates: the user's file before `estimate`."""
    m = nereus.parse(path.read_text(), str(path))
    for p in m.plans.values():
        p.step_time = None
        for lay in p.layouts.values():
            lay.time = lay.memory = lay.time_breakdown = lay.memory_breakdown = None
    return nereus.print_ir(m)


def test_show_estimates_a_plan_that_has_none_and_says_so(tmp_path, capsys):
    src = tmp_path / "job.nir"
    src.write_text(_plan_only(GRPO))
    assert main(["show", str(src)]) == 0
    out = capsys.readouterr().out
    m = nereus.run_pipeline(nereus.parse(src.read_text()), "estimate")
    step = nereus.ir.units.format_quantity(nereus.ir.units.Dim.TIME, m.plans["grpo_p0"].step_time)
    assert (
        f"step time: {step} (estimated by show; `nereus opt FILE -p estimate` writes the estimates into the IR)" in out
    )
    assert src.read_text() == _plan_only(GRPO)  # the file is not changed


def test_show_prints_the_search_record_and_runner_ups(tmp_path, capsys):
    out = tmp_path / "s.nir"
    assert main(["opt", str(GRPO), "-p", "plan-search{explain=true}", "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["show", str(out)]) == 0
    text = capsys.readouterr().out
    assert re.search(
        r"plan-search: optimal, objective [\d.]+s, bound [\d.]+s, gap 0\.00%, [\d,]+ candidates, headroom 10%, "
        r"bottleneck actor\.\w+",
        text,
    )
    assert "runner-up for actor.train: TP" in text


def test_show_uses_the_unit_that_fits_for_small_models(tmp_path, capsys):
    src = tmp_path / "tiny.nir"
    src.write_text("model @tiny { layers = 2, hidden = 64, heads = 4, kv_heads = 4, ffn = 128, vocab = 1000 }\n")
    assert main(["show", str(src)]) == 0
    out = capsys.readouterr().out
    assert "0.00 B" not in out
    params = nereus.parse(src.read_text()).models["tiny"].num_params()
    assert f"{params / 1e3:.2f} K" in out


def test_admit_breaks_its_cost_down_with_units_and_the_horizon(capsys):
    assert main(["opt", str(TP4_TO_TP2), "-p", "plan-transition{to=@b},schedule-transfers,admit{horizon=300}"]) == 0
    cap = capsys.readouterr()
    m = nereus.parse(cap.out)
    a = m.transitions["a_to_b"].admit
    assert a.cost == pytest.approx(a.makespan + a.pg_init + a.engine_restart, rel=1e-4)
    assert a.horizon == 300 and a.benefit == pytest.approx(a.saving * 300, rel=1e-3)
    line = next(x for x in cap.out.splitlines() if x.strip().startswith("admit = "))
    assert re.search(r"benefit = [\d.]+m?s, saving = [\d.]+m?s, horizon = 300", line)
    assert re.search(
        r"note: transition @a_to_b rejected: costs 32s \(makespan [\d.]+[mun]?s \+ process groups 2s \+ "
        r"engine restart 30s\), saves [\d.]+m?s per step, [\d.]+m?s over 300 steps",
        cap.err,
    )


def test_a_negative_saving_prints_and_parses_back():
    m = nereus.run_pipeline(
        nereus.parse(TP4_TO_TP2.read_text()), "plan-transition{to=@a,source=@b},schedule-transfers,admit"
    )
    a = next(iter(m.transitions.values())).admit
    assert a.saving < 0 and a.break_even is None
    text = nereus.print_ir(m)
    assert "saving = -" in text and nereus.print_ir(nereus.parse(text)) == text


def test_diff_shows_two_plans_side_by_side(tmp_path, capsys):
    out = tmp_path / "s.nir"
    assert main(["opt", str(GRPO), "-p", "plan-search", "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["diff", str(out)]) == 0
    text = capsys.readouterr().out
    m = nereus.run_pipeline(nereus.parse(out.read_text()), "estimate")  # what diff estimates
    a, b = m.plans["grpo_p0"], m.plans["grpo_searched"]
    change = f"{(b.step_time - a.step_time) / a.step_time:+.1%}"
    step = next(x for x in text.splitlines() if "│ step" in x)
    assert change in step
    lay = b.layouts["actor.train"]
    assert f"TP {lay.tp} x PP {lay.pp} x DP {lay.dp}" in text
    # two files, one plan each; a missing plan names the ones there
    assert main(["diff", str(GRPO), str(out), "--plans", "@grpo_p0", "@nope"]) == 1
    assert "has no plan @nope; its plans: @grpo_p0, @grpo_searched" in capsys.readouterr().err


def test_opt_takes_the_pipeline_from_the_run_line(tmp_path, capsys):
    case = GOLDEN / "estimate" / "grpo_7b_8gpu.nir"
    assert main(["opt", str(case), "--golden", str(case) + ".expected"]) == 0
    assert "matches" in capsys.readouterr().out
    plain = tmp_path / "plain.nir"
    plain.write_text(GRPO.read_text())
    assert main(["opt", str(plain)]) == 1
    assert "give -p PIPELINE" in capsys.readouterr().err


def test_version():
    r = subprocess.run([sys.executable, "-m", "nereus", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == f"nereus {nereus.__version__}"


def test_pass_errors_name_the_plans_there_and_keep_the_file_name(capsys):
    assert main(["opt", str(TP4_TO_TP2), "-p", "plan-transition{to=@c}"]) == 1
    assert f"{TP4_TO_TP2}: error: plan-transition: no plan @c; the module's plans: @a, @b" in capsys.readouterr().err
    assert main(["opt", str(TP4_TO_TP2), "-p", "plan-transition"]) == 1
    err = capsys.readouterr().err
    assert "plan-transition needs a plan: the module's plans: @a, @b" in err and "no plan @\n" not in err
    assert main(["opt", str(TP4_TO_TP2), "-p", "plan-transition{to=@bb}"]) == 1
    assert "hint: did you mean @b?" in capsys.readouterr().err
    # an error about IR a pass made carries the file's name, not <input>
    assert main(["opt", str(TP4_TO_TP2), "-p", "plan-transition{to=@b},admit"]) == 1
    err = capsys.readouterr().err
    assert f"{TP4_TO_TP2}:" in err and "<input>" not in err and "has no schedule" in err


def test_run_pipeline_on_invalid_input_blames_the_input():
    m = nereus.parse(GRPO.read_text().replace("tp = 2", "tp = 3", 1), "bad.nir")
    with pytest.raises(nereus.DiagnosticError) as e:
        nereus.run_pipeline(m, "estimate")
    text = str(e.value)
    assert "the input IR is invalid (before any pass ran)" in text
    assert "after pass estimate" not in text and "tp = 3 does not divide heads = 28" in text


def test_nir_golden_finds_its_files_from_any_working_directory(tmp_path):
    """A user's golden test beside its plans, run from the folder above: the path is the test's."""
    suite = tmp_path / "suite"
    (suite / "plans").mkdir(parents=True)
    case = suite / "plans" / "x.nir"
    case.write_text((GOLDEN / "estimate" / "grpo_7b_8gpu.nir").read_text())
    (suite / "plans" / "x.nir.expected").write_text((GOLDEN / "estimate" / "grpo_7b_8gpu.nir.expected").read_text())
    (suite / "test_plans.py").write_text(
        textwrap.dedent("""\
        def test_x(nir_golden):
            nir_golden("plans/x.nir")
        """)
    )
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "suite/test_plans.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 passed" in r.stdout


def test_the_examples_writer_takes_help_without_writing_a_folder(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "nereus.testing.jobs", "--help"], cwd=tmp_path, capture_output=True, text=True
    )
    assert r.returncode == 0 and "usage:" in r.stdout
    assert list(tmp_path.iterdir()) == []


def test_a_diagnostic_raised_in_a_pool_worker_reaches_the_parent():
    """It used to hang: the exception could not be unpickled, so the pool's result thread died."""
    import multiprocessing

    from ..support.jobs import parse_in_worker

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        with pytest.raises(nereus.DiagnosticError) as e:
            pool.apply_async(parse_in_worker, ("model @x { layers = }",)).get(timeout=120)
    assert e.value.diagnostics[0].loc.file == "worker.nir"


def test_estimate_without_a_plan_says_so(tmp_path, capsys):
    src = tmp_path / "job.nir"
    text = GRPO.read_text()
    src.write_text(text[: text.index("plan @")])
    assert main(["opt", str(src), "-p", "estimate"]) == 1
    assert "estimate: the module has no plan to estimate" in capsys.readouterr().err


def test_opt_reads_a_piped_run_line_and_diff_refuses_three_files(capsys):
    assert main(["opt", str(TP4_TO_TP2)]) == 0  # // RUN: nereus opt %s -p ... | filecheck %s
    assert "admit = admit(" in capsys.readouterr().out
    assert main(["diff", str(GRPO), str(GRPO), str(GRPO)]) == 1
    assert "not 3" in capsys.readouterr().err


def test_a_negative_size_or_a_unit_without_a_number_is_a_diagnostic(tmp_path, capsys):
    bad = tmp_path / "bad.nir"
    bad.write_text(GRPO.read_text().replace("host_memory = 2TiB", "host_memory = -2TiB"))
    assert main(["check", str(bad)]) == 1
    assert "'host_memory' must not be negative, got '-2TiB'" in capsys.readouterr().err
    from nereus.passes import PipelineError
    from nereus.registry import parse_pipeline

    with pytest.raises(PipelineError, match="expects a size such as 64MiB, got .e5MiB."):
        parse_pipeline("lower-collectives{bucket=e5MiB}")
