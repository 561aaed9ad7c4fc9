"""Folding per-layer repetition back into ``layers.A..B`` ranges, as the IR writes it.

A program names one tensor per layer (``layers.3.mlp.up_proj.weight``); the transition it was
lowered from names a family over a layer range (``layers.0..47.mlp.up_proj.weight``). Printed
per layer, a 48-layer transition repeats every line 48 times. ``fold_listing`` folds a printed
program back: consecutive *records* (a line and the lines indented under it: a message and its
pieces) that differ only in the layer index, every ``layers.N.`` of the record naming the same
layer and that layer one more than in the record before, become one record with
``layers.A..B.``; message ids ``#N`` in such records must step by one too and fold into
``#I..J``; the lines under a record (a bucket's pieces) are folded among themselves first, and a
record with lines under it folds with the next only where its first line shows the range (a
message id). Blocks (a line ending in ``{``, optionally followed by a ``//`` comment, up to the
``}`` at its indentation) are folded inside, never across. ``unfold_listing`` is the inverse:
``unfold_listing(fold_listing(lines)) == lines`` for any lines that hold no range of their own
(a printed program never does; a record that does is left as it is, never folded further).

The ranges are written with the IR's own helper (``ir.emu.tensor_name``: ``layers.A..B.family``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

from ..ir.emu import tensor_name

T = TypeVar("T")

_TOKEN = re.compile(r"layers\.(\d+)(\.\.\d+)?\.(?=\S)|#(\d+)(\.\.\d+)?")  # a layer or a message id (or a range of them)
_LAYER = re.compile(r"layers\.(\d+)\.(?=\S)")
_ID = re.compile(r"#(\d+)")
_LAYER_RANGE = re.compile(r"layers\.(\d+)\.\.(\d+)\.(?=\S)")
_ID_RANGE = re.compile(r"#(\d+)\.\.(\d+)")
_OPENS = re.compile(r"\{(\s+//.*)?$")

Record = tuple[str, ...]


def fold_runs(
    items: Sequence[T], signature: Callable[[T], tuple[Hashable, tuple[int, ...]] | None]
) -> list[tuple[T, int]]:
    """Runs of consecutive items that differ only in counters that each step by one.

    ``signature(item)`` is ``(shape, counters)`` or None for an item that never folds; items
    ``a, b`` continue a run when their shapes are equal, ``counters`` is not empty and every
    counter of ``b`` is the one of ``a`` plus one. Returns ``(first item, length)`` per run, in
    order; expanding each run back (the i-th item: counters plus i) gives ``items``.
    """
    firsts: list[T] = []
    counts: list[int] = []
    prev_shape: Hashable = None
    prev: tuple[int, ...] = ()  # the counters of the run's last item; () after an item that never folds
    for item in items:
        sig = signature(item)
        if sig is None:
            firsts.append(item)
            counts.append(1)
            prev = ()
            continue
        shape, counters = sig
        n = len(counters)
        if (
            n
            and n == len(prev)
            and shape == prev_shape
            and (counters[0] == prev[0] + 1 if n == 1 else all(c == p + 1 for c, p in zip(counters, prev)))
        ):
            counts[-1] += 1
        else:
            firsts.append(item)
            counts.append(1)
        prev_shape, prev = shape, counters
    return list(zip(firsts, counts))


def _signature(rec: Record) -> tuple[Hashable, tuple[int, ...]] | None:
    parts = _TOKEN.split(rec[0] if len(rec) == 1 else "\n".join(rec))
    # parts: text, then per match its 4 groups (layer, layer range, id, id range), then text ...
    layer = None
    ids: list[int] = []
    for i in range(1, len(parts), 5):
        lo, lrange, ident, irange = parts[i : i + 4]
        if lrange is not None or irange is not None:
            return None  # already a range: never folded, so that unfolding is exact
        if lo is not None:
            if layer is not None and lo != layer:
                return None  # several different layers
            layer = lo
            parts[i] = None
        else:
            ids.append(int(ident))
            parts[i + 2] = None
    if layer is None:
        return None
    if len(rec) > 1 and _TOKEN.search(rec[0]) is None:
        return None  # a record with lines under it folds only where its first line shows it (unfold_records)
    return tuple(parts), (int(layer), *ids)


def _folded(rec: Record, n: int) -> Record:
    if n == 1:
        return rec

    def layer(m: re.Match) -> str:
        lo = int(m.group(1))
        return tensor_name("", (lo, lo + n - 1))  # layers.A..B. (an empty family)

    def ident(m: re.Match) -> str:
        lo = int(m.group(1))
        return f"#{lo}..{lo + n - 1}"

    return tuple(_ID.sub(ident, _LAYER.sub(layer, line)) for line in rec)


def fold_records(records: Sequence[Record]) -> list[Record]:
    """Consecutive records that differ only in the layer (and message ids stepping with it),
    folded; the lines under a record (a bucket's pieces) are folded first, among themselves."""
    inner = [rec if len(rec) == 1 else (rec[0], *fold_listing(rec[1:])) for rec in records]
    return [_folded(rec, n) for rec, n in fold_runs(inner, _signature)]


def unfold_records(records: Sequence[Record]) -> list[Record]:
    """The inverse of ``fold_records``: a record whose first line holds a range (``layers.A..B.``,
    ``#I..J``) becomes B - A + 1 records; in another, the lines under it are unfolded."""
    out: list[Record] = []
    for rec in records:
        if not (_LAYER_RANGE.search(rec[0]) or _ID_RANGE.search(rec[0])):
            out.append(rec if len(rec) == 1 else (rec[0], *unfold_listing(rec[1:])))
            continue
        text = "\n".join(rec)
        spans = {(int(a), int(b)) for a, b in _LAYER_RANGE.findall(text)}
        if len(spans) != 1:
            raise ValueError(f"a folded record names no layer range or several: {rec[0]!r}")
        lo, hi = spans.pop()
        for i in range(hi - lo + 1):
            out.append(
                tuple(
                    _ID_RANGE.sub(lambda m: f"#{int(m.group(1)) + i}", _LAYER_RANGE.sub(f"layers.{lo + i}.", line))
                    for line in rec
                )
            )
    return out


def _opens(line: str) -> bool:
    return line.endswith("{") or ("{ " in line and _OPENS.search(line) is not None)


def _walk(
    lines: Sequence[str], i: int, end_indent: int | None, fn: Callable[[Sequence[Record]], list[Record]], out: list[str]
) -> int:
    """Records from ``lines[i:]`` up to the ``}`` at ``end_indent`` (or the end); blocks recursed into.
    Appends the transformed lines to ``out``; returns the index after the closing line."""
    pending: list[Record] = []

    def flush():
        for rec in fn(pending):
            out.extend(rec)
        pending.clear()

    n = len(lines)
    while i < n:
        line = lines[i]
        ind = len(line) - len(line.lstrip(" "))
        if end_indent is not None and ind == end_indent and line.strip() == "}":
            flush()
            out.append(line)
            return i + 1
        if _opens(line):  # a block: folded inside, never across
            flush()
            out.append(line)
            i = _walk(lines, i + 1, ind, fn, out)
            continue
        j = i + 1
        while j < n and lines[j].startswith(" " * (ind + 1)) and not _opens(lines[j]):
            j += 1
        pending.append(tuple(lines[i:j]))
        i = j
    flush()
    return i


def fold_listing(lines: Sequence[str]) -> list[str]:
    """A printed program with per-layer repetition folded into ``layers.A..B`` ranges (see the module docstring)."""
    out: list[str] = []
    _walk(lines, 0, None, fold_records, out)
    return out


def unfold_listing(lines: Sequence[str]) -> list[str]:
    """The inverse of ``fold_listing``."""
    out: list[str] = []
    _walk(lines, 0, None, unfold_records, out)
    return out
