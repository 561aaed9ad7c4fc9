"""The layers of docs/ARCHITECTURE.md hold: import-linter's contracts pass on the package, and
the same contracts fail on a copy of it with one wrong-way import added."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")


def lint(where: Path, contract: str | None = None) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(where), "PATH": "/usr/bin:/bin", "NO_COLOR": "1"}
    only = ["--contract", contract] if contract else []
    return subprocess.run(
        [str(LINT), "--no-cache", *only], cwd=where, env=env, capture_output=True, text=True, timeout=300
    )


def copy_package(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "nereus", tmp_path / "nereus", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


@pytest.mark.slow
def test_the_contracts_hold():
    done = lint(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "broken" in done.stdout and " 0 broken" in done.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "module, line, contract",
    [
        ("nereus/backend/lower.py", "from ..runtime.state import torch_dtype", "layers"),
        ("nereus/passes/transition/admit.py", "from ...backend.lower import lower", "layers"),
        ("nereus/ir/units.py", "import torch", "no-torch-below-runtime"),
        ("nereus/cli.py", "import pytest", "no-pytest-at-runtime"),
        ("nereus/control/decide.py", "import torch.distributed", "control"),
        ("nereus/control/triggers.py", "from ..backend.lower import lower", "control"),
        ("nereus/sim/simulated_cluster.py", "import torch", "sim"),
        ("nereus/sim/policies.py", "from ..runtime.state import torch_dtype", "sim"),
        ("nereus/integrations/job.py", "from ..sim.trace import read_trace", "integrations"),
    ],
)
def test_a_wrong_way_import_breaks_a_contract(tmp_path, module, line, contract):
    where = copy_package(tmp_path)
    path = where / module
    text = path.read_text()
    head, sep, rest = text.partition("from __future__ import annotations\n")
    path.write_text(head + sep + line + "\n" + rest if sep else line + "\n" + text)
    done = lint(where, contract)
    assert done.returncode == 1 and "1 broken" in done.stdout, done.stdout + done.stderr
    assert line.split()[-1] in done.stdout or line.split()[1].lstrip(".") in done.stdout  # the report names the import


def test_importing_the_command_line_imports_neither_pytest_nor_torch():
    code = (
        "import nereus.cli, nereus.registry, nereus.backend.lower, sys; "
        "print('pytest' in sys.modules, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.split() == ["False", "False"]
