"""The grammar ships inside the wheel: install the built wheel elsewhere and parse with it."""

import subprocess
import sys
import textwrap

import pytest

from ..support import ROOT


@pytest.mark.slow
def test_wheel_install_finds_packaged_grammar(tmp_path):
    dist = tmp_path / "dist"
    build = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = dist.glob("nereus-*.whl")
    target = tmp_path / "site"
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert pip.returncode == 0, pip.stdout + pip.stderr
    script = textwrap.dedent(f"""
        import nereus, pathlib
        from nereus.ir.parser import grammar_path
        assert pathlib.Path(nereus.__file__).is_relative_to({str(target)!r}), nereus.__file__
        assert grammar_path().is_relative_to({str(target)!r}), grammar_path()
        text = pathlib.Path({str(ROOT / "examples" / "grpo_7b_8gpu.nir")!r}).read_text()
        assert nereus.print_ir(nereus.verify(nereus.parse(text))) == text
        # the script template ships too
        from nereus.testing.cases import case_module
        from nereus.backend.lower import lower
        from nereus.backend.script import render_script
        m = nereus.run_pipeline(case_module("pp2-pp4", 4, hidden=64, layers=4), "plan-transition{{to=@b}}")
        assert "torchrun" in render_script(lower(m, "a_to_b"))
        print("ok")
    """)
    # PYTHONPATH puts the installed wheel ahead of the editable checkout; run from elsewhere.
    r = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr
