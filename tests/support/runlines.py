"""Run the ``// RUN:`` lines of a golden case, as lit does for LLVM's and xDSL's tests.

A golden case (``tests/golden/<pass>/NAME.nir``) starts with one or more RUN lines::

    // RUN: nereus opt %s -p estimate
    // RUN: nereus lower %s -p 'plan-transition{to=@b,into=@t}' --broadcast p2p --bucket 64KiB
    // RUN: nereus opt %s -p plan-transition{to=@b} | filecheck %s
    // RUN: nereus opt %s -p plan-transition{to=@b} | filecheck %s --check-prefix=SEND

``%s`` is the case's path. The command is split as a shell would (quotes, no expansion) and
runs in this process (``nereus.cli.main``), its standard output captured; a command that exits
with a status other than 0 fails the case. After ``| filecheck %s`` the output is piped to the
``filecheck`` package (a Python clone of LLVM's FileCheck), which checks it against the case's
``// CHECK:`` lines (or those of ``--check-prefix``). A RUN line without a pipe is compared with
a whole expected file beside the case (``NAME.nir.expected``; ``opt`` only).

The printer keeps ``//`` comments, so the CHECK lines come back in the output, at the top of the
module (they lead its first declaration). A case must therefore begin its checks with a
``CHECK-LABEL`` anchored to the start of a line, ``{{^}}transition @a_to_b {``, which the echoed
comment (it starts with ``//``) cannot match; every later check searches after it.
"""

from __future__ import annotations

import contextlib
import functools
import io
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from nereus.cli import main

_RUN = re.compile(r"^//\s*RUN:\s*(.*?)\s*$")
_CHECK = re.compile(r"^//\s*([A-Z][A-Z0-9_-]*?)(?:-(?:NEXT|NOT|LABEL|SAME|EMPTY|DAG|COUNT-\d+))?:")


class RunError(AssertionError):
    pass


@dataclass(frozen=True)
class RunLine:
    """``nereus ARGV`` and, after ``| filecheck %s``, filecheck's further arguments (None: no pipe)."""

    argv: tuple[str, ...]
    filecheck: tuple[str, ...] | None

    @property
    def command(self) -> str:
        return self.argv[0]


def run_lines(path: Path) -> list[RunLine]:
    """The RUN lines at the top of ``path`` (before its first line that is not a comment)."""
    found = []
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("//"):
            break
        m = _RUN.match(line.strip())
        if not m:
            continue
        stages = [shlex.split(s) for s in m.group(1).split(" | ")]
        if not 1 <= len(stages) <= 2 or stages[0][:1] != ["nereus"] or "%s" not in stages[0]:
            raise RunError(
                f"{path}: RUN line {line!r}: expected 'nereus COMMAND %s ...' and at most one '| filecheck %s'"
            )
        check = None
        if len(stages) == 2:
            if stages[1][:2] != ["filecheck", "%s"]:
                raise RunError(f"{path}: RUN line {line!r}: the pipe goes to 'filecheck %s [OPTIONS]'")
            check = tuple(stages[1][2:])
        argv = tuple(str(path) if a == "%s" else a for a in stages[0][1:])
        found.append(RunLine(argv, check))
    if not found:
        raise RunError(f"{path}: no '// RUN: nereus ...' line at the top of the file")
    return found


def has_checks(path: Path) -> bool:
    """Whether the case carries FileCheck lines (``// CHECK:``, ``// SEND-COUNT-3:``, ...)."""
    return any(run.filecheck is not None for run in run_lines(path))


@functools.lru_cache(maxsize=32)
def run_nereus(argv: tuple[str, ...]) -> str:
    """``nereus ARGV`` in this process: its standard output. Cached: several RUN lines of one case
    run the same command and pipe it to filecheck with different prefixes."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(argv))
        except SystemExit as e:  # argparse: a usage error
            rc = e.code
    if rc != 0:
        raise RunError(f"nereus {shlex.join(argv)} exited with {rc}:\n{err.getvalue()}")
    return out.getvalue()


def filecheck(check_file: Path, text: str, options: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Pipe ``text`` to ``filecheck CHECK_FILE OPTIONS`` (the filecheck package, in a subprocess)."""
    return subprocess.run(
        [sys.executable, "-m", "filecheck", str(check_file), *options],
        input=text,
        capture_output=True,
        text=True,
        timeout=120,
    )


def filecheck_quietly(check_file: Path, text: str, options: tuple[str, ...] = ()) -> int:
    """filecheck's exit status, in this process (for the many runs of the mutation test)."""
    from filecheck.matcher import Matcher
    from filecheck.options import parse_argv_options

    text_file = check_file.with_name(check_file.name + ".input")
    text_file.write_text(text)
    opts = parse_argv_options(["filecheck", str(check_file), *options, f"--input-file={text_file}"])
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return Matcher.from_opts(opts).run()


def run_case(path: Path) -> list[tuple[RunLine, str]]:
    """Run every RUN line of ``path`` that pipes to filecheck; raise RunError on the first failure.
    Returns each such line with the output it checked."""
    done = []
    for run in run_lines(path):
        if run.filecheck is None:
            continue
        out = run_nereus(run.argv)
        r = filecheck(path, out, run.filecheck)
        if r.returncode != 0:
            raise RunError(
                f"filecheck {path.name} {' '.join(run.filecheck)} failed on the output of "
                f"nereus {shlex.join(run.argv)}:\n{r.stdout}{r.stderr}"
            )
        done.append((run, out))
    return done


def check_prefixes(run: RunLine) -> list[str]:
    """The prefixes a filecheck RUN line checks (``CHECK`` unless ``--check-prefix(es)`` names others)."""
    prefixes: list[str] = []
    opts = list(run.filecheck or ())
    for i, opt in enumerate(opts):
        for name in ("--check-prefix", "--check-prefixes"):
            if opt == name:
                prefixes += opts[i + 1].split(",")
            elif opt.startswith(name + "="):
                prefixes += opt.split("=", 1)[1].split(",")
    return prefixes or ["CHECK"]


def check_lines(path: Path) -> list[tuple[str, str]]:
    """``(prefix, line)`` for each FileCheck directive line in ``path``."""
    found = []
    for line in path.read_text().splitlines():
        m = _CHECK.match(line.strip())
        if m and m.group(1) not in ("RUN", "COM"):
            found.append((m.group(1), line))
    return found
