"""Golden tests of plans, for this project and for users.

A golden case is a ``.nir`` input whose first lines name the pipeline to run::

    // RUN: nereus opt %s -p estimate

and, beside it, ``NAME.nir.expected``: the printed IR the pipeline must produce. A user checks
such pairs into their repository as regression tests of their cluster configuration: when a
Nereus upgrade or a changed cluster file moves a plan, the diff shows exactly what moved.

- the ``nir_golden`` fixture: ``nir_golden("path/case.nir")`` runs and compares;
- ``--update-goldens`` rewrites the ``.expected`` files and fails the test, so that a person
  reads the diff before committing;
- ``nereus opt FILE -p PIPELINE --golden FILE.expected`` does the same from the command line.

The fixture lives in ``nereus.testing.plugin``, registered through the ``pytest11`` entry point,
so installing Nereus makes the fixture and the option available in any project's tests. This
module does not import pytest: the command line uses it.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

_RUN = re.compile(r"^//\s*RUN:\s*nereus opt %s -p (\S+)\s*$")
_PIPED_RUN = re.compile(r"^//\s*RUN:\s*nereus opt %s -p (\S+)\s*(\|.*)?$")  # lit's form: ... | filecheck %s


class GoldenMismatch(AssertionError):
    pass


def run_header(text: str, piped: bool = False) -> str:
    """The pipeline named by a ``// RUN: nereus opt %s -p PIPELINE`` line (``piped``: also one
    that goes on to ``| filecheck %s``, as the CHECK-line goldens write it)."""
    for line in text.splitlines():
        m = (_PIPED_RUN if piped else _RUN).match(line.strip())
        if m:
            return m.group(1)
        if line.strip() and not line.startswith("//"):
            break
    raise ValueError("no '// RUN: nereus opt %s -p PIPELINE' line at the top of the file")


def produce(path: Path, pipeline: str | None = None) -> str:
    """Parse, verify, run the pipeline and print: what the golden file must contain."""
    from .. import parse, print_ir, run_pipeline, verify

    text = path.read_text()
    module = verify(parse(text, str(path)))
    run_pipeline(module, pipeline or run_header(text))
    return print_ir(module)


def unified_diff(expected: str, actual: str, name: str) -> str:
    return "".join(
        difflib.unified_diff(
            expected.splitlines(True), actual.splitlines(True), fromfile=f"{name} (golden)", tofile=f"{name} (produced)"
        )
    )


def compare(actual: str, expected_path: Path, update: bool) -> None:
    """Raise GoldenMismatch with a unified diff when ``actual`` differs from the golden file."""
    expected = expected_path.read_text() if expected_path.exists() else ""
    if actual == expected:
        return
    if update:
        expected_path.write_text(actual)
        raise GoldenMismatch(
            f"rewrote {expected_path}; read the diff and commit it:\n"
            + unified_diff(expected, actual, expected_path.name)
        )
    if not expected_path.exists():
        raise GoldenMismatch(f"{expected_path} does not exist; run with --update-goldens to create it")
    raise GoldenMismatch(f"output differs from {expected_path}:\n" + unified_diff(expected, actual, expected_path.name))
