"""Golden files of passes: tests/golden/<pass>/*.nir with a RUN line, and NAME.nir.expected.

Run ``pytest tests/test_goldens.py --update-goldens`` to rewrite them (the run fails so that
the diff is read before it is committed).
"""

from pathlib import Path

import pytest

import nereus
from nereus.cli import main
from nereus.testing.golden import GoldenMismatch, compare, run_header

GOLDEN = Path(__file__).resolve().parent / "golden"
CASES = sorted(GOLDEN.glob("*/*.nir"))


@pytest.mark.parametrize("path", CASES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_golden(path, nir_golden):
    out = nir_golden(path)
    # a golden is valid IR (verified before it is trusted) and canonical
    m = nereus.verify(nereus.parse(out))
    assert nereus.print_ir(m) == out


def test_every_pass_with_goldens_names_its_folder():
    for path in CASES:
        assert run_header(path.read_text()).split("{")[0] == path.parent.name


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
