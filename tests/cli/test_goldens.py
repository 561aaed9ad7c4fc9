"""Golden cases: tests/golden/<pass>/NAME.nir, each starting with the RUN lines that check it.

Two kinds (see ``tests/support/runlines.py``):

- ``// RUN: nereus opt %s -p PIPELINE | filecheck %s`` (or ``nereus lower %s ... | filecheck %s``):
  the output must satisfy the case's ``// CHECK:`` lines (FileCheck, as in LLVM and xDSL): the
  facts that matter, written in the input where they can be read. Every case has them;
- ``// RUN: nereus opt %s -p PIPELINE``: the printed module must equal ``NAME.nir.expected``.
  One case keeps such a whole-file golden, estimate/grpo_7b_8gpu.nir: the example the
  ``nir_golden`` fixture and ``nereus opt --golden`` are tested on (here and in test_user_path).

The folder names the pass a case is about: the first of its pipeline, or the last where the
pass needs others before it (``plan-transition{to=@b},schedule-transfers`` in schedule-transfers/).

Run ``pytest tests/cli/test_goldens.py --update-goldens`` to rewrite the whole-file golden (the
run fails so that the diff is read before it is committed); CHECK lines are edited by hand.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

import nereus
from nereus.cli import main
from nereus.testing.cases import case_module
from nereus.testing.golden import GoldenMismatch, compare

from ..support import GOLDEN
from ..support.runlines import (
    RunError,
    check_lines,
    check_prefixes,
    filecheck,
    filecheck_quietly,
    has_checks,
    run_case,
    run_lines,
    run_nereus,
)

CASES = sorted(GOLDEN.glob("*/*.nir"))
IDS = {p: f"{p.parent.name}/{p.name}" for p in CASES}
WHOLE = [(p, run) for p in CASES for run in run_lines(p) if run.filecheck is None]
CHECKED = [p for p in CASES if has_checks(p)]


def expected_file(path: Path, command: str) -> Path:
    return path.with_suffix(".program") if command == "lower" else path.with_name(path.name + ".expected")


@pytest.mark.parametrize("path", [p for p, run in WHOLE if run.command == "opt"], ids=IDS.get)
def test_golden(path, nir_golden):
    out = nir_golden(path)
    # a golden is valid IR (verified before it is trusted) and canonical
    m = nereus.verify(nereus.parse(out))
    assert nereus.print_ir(m) == out
    assert run_nereus(next(r for r in run_lines(path) if r.filecheck is None).argv) == out  # the RUN line says the same


@pytest.mark.parametrize("path", CHECKED, ids=IDS.get)
def test_filecheck_golden(path):
    try:
        done = run_case(path)
    except RunError as e:
        failure = str(e)
    else:
        failure = None
    if failure:
        pytest.fail(failure, pytrace=False)
    # every prefix the file uses is checked by some RUN line, and every RUN line's prefix is used
    used = {prefix for prefix, _ in check_lines(path)}
    run = {p for r, _ in done for p in check_prefixes(r)}
    assert used == run, f"prefixes without a RUN line: {used - run}; RUN lines without checks: {run - used}"


def _mutants(line: str) -> list[str]:
    """The directive ``line`` with one fact changed: a ``-COUNT-n`` one more and one less, else its
    last digit outside ``{{regex}}`` (else its last letter) moved by one; none for ``}``."""
    head, _, pattern = line.partition(":")
    m = re.search(r"-COUNT-(\d+)$", head)
    if m:
        return [head[: m.start(1)] + str(int(m.group(1)) + d) + ":" + pattern for d in (1, -1)]
    plain = re.sub(r"\{\{.*?\}\}", lambda m: "\0" * len(m.group()), pattern)
    for chars in ("0123456789", "abcdefghijklmnopqrstuvwxyz"):
        at = max((i for i, c in enumerate(plain) if c in chars), default=None)
        if at is not None:
            new = chars[(chars.index(pattern[at]) + 1) % len(chars)]
            return [head + ":" + pattern[:at] + new + pattern[at + 1 :]]
    return []


@pytest.mark.parametrize("path", CHECKED, ids=IDS.get)
def test_every_positive_check_line_is_needed(path, tmp_path):
    """Change a fact in any positive CHECK line (a count, a number, else a name) and filecheck
    fails: the checks are not satisfied by the CHECK lines themselves, which the printer echoes
    (their comments lead the module), nor by some other line further down."""
    runs = {}
    for run in run_lines(path):
        for prefix in check_prefixes(run):
            runs[prefix] = (run.filecheck, run_nereus(run.argv), run.command)
    text = path.read_text()
    check = tmp_path / path.name
    check.write_text(text)
    for options, out, _ in runs.values():
        assert filecheck_quietly(check, out, options) == 0  # in this process, as in the subprocess
    tried = 0
    for prefix, line in check_lines(path):
        if re.match(rf"^//\s*{prefix}-NOT:", line.strip()):
            continue  # a negative check only gets weaker
        options, out, command = runs[prefix]
        if command == "opt":  # the printed module echoes the comment, which the mutant replaces too
            assert line in out  # (a collective program, nereus lower's output, does not)
        for mutant in _mutants(line):
            check.write_text(text.replace(line, mutant, 1))
            assert filecheck_quietly(check, out.replace(line, mutant, 1), options) != 0, (
                f"filecheck still passes with {mutant.strip()!r} instead of {line.strip()!r}"
            )
            tried += 1
    assert tried >= 10


def test_a_wrong_value_fails_the_case(tmp_path):
    """End to end: a case whose CHECK line states a wrong number of bytes fails, and its diagnostic
    names the line."""
    case = GOLDEN / "plan-transition" / "dp8_to_dp4.nir"
    wrong = tmp_path / case.name
    wrong.write_text(case.read_text().replace("bytes_moved = 35009.625KiB", "bytes_moved = 35009.626KiB"))
    assert wrong.read_text() != case.read_text()
    with pytest.raises(RunError, match=r"(?s)Couldn't match.*bytes_moved = 35009\.626KiB"):
        run_case(wrong)
    run_case(case)
    # and a wrong count of operations
    wrong.write_text(case.read_text().replace("SEND-COUNT-84:", "SEND-COUNT-83:"))
    with pytest.raises(RunError, match="SEND-NOT"):
        run_case(wrong)


def test_filecheck_is_the_package_and_fails_loudly(tmp_path):
    check = tmp_path / "c.txt"
    check.write_text("// CHECK: bytes_moved = 1KiB\n")
    assert filecheck(check, "bytes_moved = 1KiB\n").returncode == 0
    r = filecheck(check, "bytes_moved = 2KiB\n")
    assert r.returncode != 0 and "Couldn't match" in r.stdout + r.stderr
    assert subprocess.run(
        [sys.executable, "-m", "filecheck", "--version"], capture_output=True, text=True
    ).stdout.startswith("filecheck")


def pipeline_passes(spec: str) -> list[str]:
    """The pass names of ``spec``, in order (commas inside a pass's ``{...}`` options do not split)."""
    return [p.split("{")[0] for p in re.split(r",(?![^{]*\})", spec)]


def test_pipeline_passes():
    assert pipeline_passes("estimate") == ["estimate"]
    assert pipeline_passes("plan-transition{to=@b,into=@t},schedule-transfers,admit{horizon=240,margin=0}") == [
        "plan-transition",
        "schedule-transfers",
        "admit",
    ]


def test_every_pass_with_goldens_names_its_folder():
    for path in CASES:
        for run in run_lines(path):
            if run.command == "opt":
                passes = pipeline_passes(run.argv[run.argv.index("-p") + 1])
                named = passes[0] if passes[0] == path.parent.name else passes[-1]
            else:
                named = run.command
            assert named == path.parent.name, f"{path}: RUN line runs {named}"


def test_every_golden_file_has_its_case_and_every_case_is_checked():
    for path in sorted(GOLDEN.glob("*/*")):
        if path.suffix == ".nir":
            assert has_checks(path), f"{path}: no RUN line pipes to filecheck"
            for run in run_lines(path):
                if run.filecheck is None:
                    assert run.command == "opt", f"{path}: a whole-file golden of {run.command}: pipe it to filecheck"
                    assert expected_file(path, run.command).exists(), (
                        f"{path}: no {expected_file(path, run.command).name}"
                    )
            continue
        if path.name.endswith(".nir.expected"):
            case = path.with_name(path.name.removesuffix(".expected"))
        else:
            assert path.suffix == ".program", f"{path}: neither a case (.nir) nor an expected output"
            case = path.with_suffix(".nir")
        assert case.exists() and any(
            expected_file(case, r.command) == path for r in run_lines(case) if r.filecheck is None
        ), f"{path}: stale: no case in this folder whose RUN line it is the output of"


@pytest.mark.parametrize("case,mode", [("pp2-pp4", "p2p"), ("train-gen", "collective")])
def test_lower_inputs_are_the_reshard_cases(case, mode):
    """The lower goldens' inputs are nereus.testing.cases' modules (4 GPUs, 4 layers, hidden 64)."""
    text = (GOLDEN / "lower" / f"{case}.{mode}.nir").read_text()
    assert nereus.parse(text) == case_module(case, 4, hidden=64, layers=4)


def test_mismatch_shows_unified_diff_and_update_rewrites(tmp_path):
    golden = tmp_path / "x.nir.expected"
    golden.write_text("a\nb\n")
    with pytest.raises(GoldenMismatch, match=r"(?s)--- x.nir.expected \(golden\).*-b\n\+c"):
        compare("a\nc\n", golden, update=False)
    with pytest.raises(GoldenMismatch, match="rewrote"):
        compare("a\nc\n", golden, update=True)
    assert golden.read_text() == "a\nc\n"
    compare("a\nc\n", golden, update=False)


def test_opt_golden_flag(capsys):
    case = GOLDEN / "estimate" / "grpo_7b_8gpu.nir"
    expected = str(case) + ".expected"
    assert main(["opt", str(case), "-p", "estimate", "--golden", expected]) == 0
    assert main(["opt", str(case), "-p", "derive-emus", "--golden", expected]) == 1
    assert "output differs" in capsys.readouterr().err
