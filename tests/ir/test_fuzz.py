"""Mutation fuzzing of the example files: bad input only ever produces diagnostics.

Every mutant of an example (a character or line deleted, duplicated or swapped, random
printable characters inserted, the file truncated) must either parse and verify, or raise
``nereus.DiagnosticError`` whose diagnostics point at a real position (line and column >= 1)
and render. The command line must never print a traceback.

The mutation loop is a seeded ``random.Random``: deterministic, and a failure names the seed,
the mutation and the file so that it can be replayed with ``mutate(text, seed)``.
"""

from __future__ import annotations

import random
import string

import pytest

import nereus
from nereus import cli

from ..support import EXAMPLES as EXAMPLE_FILES

TEXTS = {p.name: p.read_text() for p in EXAMPLE_FILES}

# Characters the language gives meaning to, weighted in beside the whole printable set so that
# insertions often make almost-valid text.
SPECIAL = "{}[]()=,:.@%/\n 0123456789"
PRINTABLE = string.printable


def _mutate_once(text: str, rng: random.Random) -> tuple[str, str]:
    kind = rng.choice(
        ["del_char", "del_line", "dup_line", "swap_chars", "swap_lines", "insert", "truncate", "dup_span"]
    )
    lines = text.split("\n")
    if kind == "del_char" and text:
        i = rng.randrange(len(text))
        return text[:i] + text[i + 1 :], f"{kind}@{i}"
    if kind == "del_line" and len(lines) > 1:
        i = rng.randrange(len(lines))
        return "\n".join(lines[:i] + lines[i + 1 :]), f"{kind}@{i + 1}"
    if kind == "dup_line" and lines:
        i = rng.randrange(len(lines))
        return "\n".join(lines[: i + 1] + [lines[i]] + lines[i + 1 :]), f"{kind}@{i + 1}"
    if kind == "swap_chars" and len(text) > 1:
        i, j = sorted(rng.sample(range(len(text)), 2))
        if rng.random() < 0.5:  # neighbours: typos
            j = min(i + 1, len(text) - 1)
        t = list(text)
        t[i], t[j] = t[j], t[i]
        return "".join(t), f"{kind}@{i},{j}"
    if kind == "swap_lines" and len(lines) > 1:
        i, j = rng.sample(range(len(lines)), 2)
        lines[i], lines[j] = lines[j], lines[i]
        return "\n".join(lines), f"{kind}@{i + 1},{j + 1}"
    if kind == "insert":
        i = rng.randrange(len(text) + 1)
        alphabet = SPECIAL if rng.random() < 0.5 else PRINTABLE
        ins = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
        return text[:i] + ins + text[i:], f"{kind}@{i}:{ins!r}"
    if kind == "truncate":
        i = rng.randrange(len(text) + 1)
        return text[:i], f"{kind}@{i}"
    if kind == "dup_span" and text:
        i = rng.randrange(len(text))
        j = min(len(text), i + rng.randint(1, 40))
        return text[:j] + text[i:j] + text[j:], f"{kind}@{i}:{j}"
    return text, "noop"


def mutate(text: str, seed: int) -> tuple[str, list[str]]:
    """One to three stacked mutations of ``text``, determined by ``seed``."""
    rng = random.Random(seed)
    done = []
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        text, what = _mutate_once(text, rng)
        done.append(what)
    return text, done


def check_text(text: str, filename: str = "mutant.nir"):
    """Parse and verify; return the module or the DiagnosticError. Anything else propagates."""
    try:
        return nereus.verify(nereus.parse(text, filename))
    except nereus.DiagnosticError as err:
        assert err.diagnostics, "a DiagnosticError with no diagnostic"
        for d in err.diagnostics:
            assert d.loc.line >= 1 and d.loc.col >= 1, f"diagnostic without a position: {d}"
            rendered = d.render(text)
            assert d.message in rendered
            assert rendered.startswith(f"{filename}:{d.loc.line}:{d.loc.col}: error: ")
        err.render()
        err.render(text)
        str(err)
        return err


# name, number of mutants: the 70B example is large, so it gets fewer
PLAN = [("grpo_7b_8gpu.nir", 600), ("ppo_8b_16gpu.nir", 400), ("ppo_70b_1024gpu.nir", 60)]


@pytest.mark.parametrize("name, count", PLAN)
def test_mutants_give_diagnostics_only(name, count):
    text = TEXTS[name]
    failures = []
    for seed in range(count):
        mutant, what = mutate(text, seed)
        try:
            check_text(mutant, name)
        except Exception as e:  # noqa: BLE001 - the point is to catch everything else
            failures.append(f"{name} seed={seed} {what}: {type(e).__name__}: {str(e)[:300]}")
    assert not failures, f"{len(failures)} of {count} mutants escaped:\n" + "\n".join(failures[:15])


@pytest.mark.parametrize("name, count", PLAN)
def test_mutants_that_parse_roundtrip(name, count):
    """A mutant the parser accepts is a module like any other: it prints, and the print round-trips."""
    text = TEXTS[name]
    failures = []
    for seed in range(count):
        mutant, what = mutate(text, seed)
        try:
            m = nereus.parse(mutant, name)
        except nereus.DiagnosticError:
            continue
        try:
            printed = nereus.print_ir(m)
            again = nereus.parse(printed)
            assert again == m, "parse(print_ir(m)) != m"
            assert nereus.print_ir(again) == printed, "print_ir is not a fixed point"
        except Exception as e:  # noqa: BLE001
            failures.append(f"{name} seed={seed} {what}: {type(e).__name__}: {str(e)[:300]}")
    assert not failures, f"{len(failures)} mutants failed to round-trip:\n" + "\n".join(failures[:15])


HANDCRAFTED = [
    "",
    "\n\n",
    "// only a comment",
    "cluster",
    "cluster @",
    "cluster @c {",
    "cluster @c { nodes = }",
    "cluster @c { nodes = -1 }",
    "cluster @c { nodes = 1e9 }",
    'model @m { dtype = "bf16" }',
    "model @m { layers = 1..2 }",
    "# a comment",
    "emu @p a.b[0] { shard [0, 0] gpus [] { } }",
    "emu @p a.b[0, 0] { }",
    "emu @p a.b[3..1] { }",
    "emu @p a.b[0] { shard [0, 0] gpus [0] { layers.x.mlp.up_proj.weight [0:1] } }",
    "emu @p a.b[0] { shard [0, 0] gpus [0] { layers.3..1.mlp.up_proj.weight [0:1] } }",
    "emu @p a.b[0] { shard [0, 0] gpus [0] { norm.weight [5:1] } }",
    "emu @p a.b[0] { shard [0, 0] gpus [0] { norm.weight [0:1.5] } }",
    "transition @t { %0 = teleport norm.weight [0:1] { bytes = 1B, link = local } }",
    "transition @t { source = @a, target = @b, %0 = free norm.weight [0:1] from [host[0]] { bytes = 1B, link = local "
    "} }",
    "cluster @c { gpu_memory = 80 GiB }",
    "cluster @c { gpu_memory = 80gib }",
    "cluster @c { gpu_memory = 1.5B }",
    "cluster @c { intra_node = link(bandwidth = 1GB/s, bandwidth = 2GB/s) }",
    "cluster @c { intra_node = link(speed = 1GB/s) }",
    "cluster @c { unavailable = [3..1] }",
    "\ufeffcluster @c { }",
    "cluster @c { nodes = 1 }\x00",
    "cluster @c\t{ nodes\t= 1 }",
    "cluster @c { nodes = 99999999999999999999999999999999999999 }",
]


@pytest.mark.parametrize("text", HANDCRAFTED)
def test_handcrafted_bad_inputs(text):
    check_text(text)


def test_cli_check_on_mutants(tmp_path, capsys):
    rng = random.Random(1234)
    names = ["grpo_7b_8gpu.nir", "ppo_8b_16gpu.nir"]
    for k in range(12):
        name = rng.choice(names)
        mutant, what = mutate(TEXTS[name], 10_000 + k)
        path = tmp_path / f"m{k}.nir"
        path.write_text(mutant)
        code = cli.main(["check", str(path)])
        out, err = capsys.readouterr()
        assert code in (0, 1), (what, code, err)
        assert "Traceback" not in out + err, what
        if code == 1:
            assert f"{path}:" in err, (what, err)
            assert "error" in err
        else:
            assert err == ""


def test_cli_check_examples_and_missing_file(tmp_path, capsys):
    assert cli.main(["check", *map(str, EXAMPLE_FILES)]) == 0
    capsys.readouterr()
    assert cli.main(["check", str(tmp_path / "nope.nir")]) == 1
    _, err = capsys.readouterr()
    assert "no such file" in err and "Traceback" not in err
    bad = tmp_path / "latin1.nir"
    bad.write_bytes(b"cluster @c { } // caf\xe9\n")
    assert cli.main(["check", str(bad)]) == 1
    _, err = capsys.readouterr()
    assert "UTF-8" in err and "Traceback" not in err


def test_cli_fmt_on_mutants_has_no_traceback(tmp_path, capsys):
    """``nereus fmt --check`` reads, verifies and prints: no input may make it crash."""
    rng = random.Random(99)
    for k in range(12):
        name = rng.choice(["grpo_7b_8gpu.nir", "ppo_8b_16gpu.nir"])
        mutant, what = mutate(TEXTS[name], 20_000 + k)
        path = tmp_path / f"f{k}.nir"
        path.write_text(mutant)
        code = cli.main(["fmt", "--check", str(path)])
        out, err = capsys.readouterr()
        assert code in (0, 1), (what, code)
        assert "Traceback" not in out + err, what


def test_cli_fmt_huge_and_tiny_quantities(tmp_path, capsys):
    """A file that ``check`` accepts must format without a crash, to text that means the same.

    Regression: quantities past ~1e28 of the largest unit made ``fmt`` die with
    decimal.InvalidOperation, and times below ~1e-49 s with UnitError.
    """
    text = TEXTS["grpo_7b_8gpu.nir"].replace(
        "host_memory = 2TiB", "host_memory = 10000000000000000000000000000000000000000B"
    )
    text = text.replace("latency = 10us", "latency = 0." + "0" * 70 + "1s")
    path = tmp_path / "huge.nir"
    path.write_text(text)
    assert cli.main(["check", str(path)]) == 0
    capsys.readouterr()
    assert cli.main(["fmt", "--stdout", str(path)]) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    assert nereus.parse(out) == nereus.parse(text)
