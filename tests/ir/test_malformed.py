"""A corpus of malformed .nir files: every diagnostic at the right place, and nothing else.

Each file in ``tests/malformed/`` holds one mistake, made in a trimmed copy of the GRPO
example, and starts with a header naming what ``nereus check`` must report::

    // EXPECT: LINE:COL: message fragment     (one line per error; the verifier reports all)
    // HINT: hint fragment                    (optional: some hint line contains it)
    // mistake: what was broken

For every EXPECT line some diagnostic ``FILE:LINE:COL: error: ...`` contains the fragment and
is followed by the source line and a caret under COL; there are exactly as many errors as
EXPECT lines (no cascades, no duplicates), exit status 1 and no traceback. The file name's
prefix is the rule category; every category has files.
"""

from __future__ import annotations

import re
import traceback
from pathlib import Path

import pytest

from nereus.cli import main

MALFORMED = Path(__file__).resolve().parent / "malformed"
FILES = sorted(MALFORMED.glob("*.nir"))

CATEGORIES = (
    "syntax_",
    "unit_",
    "attr_",
    "name_",
    "cluster_",
    "model_",
    "workload_",
    "plan_",
    "layout_",
    "colocate_",
    "emu_",
    "transition_",
)

_EXPECT = re.compile(r"// EXPECT: (\d+):(\d+): (.+?)\s*$")
_HINT = re.compile(r"// HINT: (.+?)\s*$")
_ERROR = re.compile(r"^(.*):(\d+):(\d+): error: ")


def _header(path: Path) -> tuple[list[tuple[int, int, str]], list[str]]:
    expects, hints = [], []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("//"):
            break
        if m := _EXPECT.match(line):
            expects.append((int(m[1]), int(m[2]), m[3]))
        elif m := _HINT.match(line):
            hints.append(m[1])
    return expects, hints


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_malformed_file(path: Path, capsys):
    expects, hints = _header(path)
    assert expects, f"{path.name}: no '// EXPECT: LINE:COL: fragment' header"
    try:
        status = main(["check", str(path)])
    except BaseException:  # noqa: BLE001 - a crash is the finding; show it
        pytest.fail(f"nereus check {path.name} raised instead of reporting:\n{traceback.format_exc()}")
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert status == 1, f"exit status {status}, expected 1\n{err}"

    out = err.splitlines()
    source = path.read_text(encoding="utf-8").splitlines()
    errors = [i for i, line in enumerate(out) if _ERROR.match(line)]
    for i in errors:
        assert _ERROR.match(out[i])[1] == str(path), f"diagnostic names another file: {out[i]}"

    for line, col, fragment in expects:
        head = f"{path}:{line}:{col}: error:"
        hits = [i for i in errors if out[i].startswith(head) and fragment in out[i]]
        assert hits, f"expected '{head} ...{fragment}...'; nereus check printed:\n{err}"
        i = hits[0]
        # the offending source line, then a caret under the column
        assert i + 2 < len(out), f"no source line and caret after:\n{out[i]}\n{err}"
        text = source[line - 1].expandtabs(1)
        shown, caret = out[i + 1], out[i + 2]
        assert shown.endswith(text), f"source line {line} not printed after the diagnostic:\n{err}"
        gutter = len(shown) - len(text)
        assert shown[:gutter].strip() == f"{line} |", f"bad gutter {shown!r}"
        assert caret.rstrip().endswith("^") and caret.index("^") == gutter + col - 1, (
            f"caret not under column {col}:\n{shown}\n{caret}"
        )

    for fragment in hints:
        assert any(h.startswith("hint: ") and fragment in h for h in out), (
            f"expected a hint containing {fragment!r}; nereus check printed:\n{err}"
        )

    assert len(errors) == len(expects), (
        f"{len(errors)} error(s) reported, {len(expects)} expected (a cascade or a duplicate?):\n{err}"
    )


def test_corpus_size():
    assert len(FILES) >= 45, f"only {len(FILES)} malformed files"


def test_every_category_is_covered():
    for path in FILES:
        assert path.name.startswith(CATEGORIES), f"{path.name}: file name has no known category prefix"
        assert path.read_text(encoding="utf-8").startswith("// EXPECT: "), f"{path.name}: header must come first"
    missing = [c for c in CATEGORIES if not any(p.name.startswith(c) for p in FILES)]
    assert not missing, f"no malformed file for categories: {', '.join(missing)}"
