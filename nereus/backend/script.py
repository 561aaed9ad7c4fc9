"""Render a collective program as a standalone Python script (jinja2), runnable under torchrun.

Nothing from an IR file reaches the script as code: names are checked against the grammar's
identifier shape (``ident``) where they appear in prose, and every value the script uses as
data (keys, boxes, dtypes, steps) is written by ``pyrepr``, which emits Python literals of
strings, numbers, tuples, lists and dicts only, and refuses anything else.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import jinja2

from ..ir.emu import split_tensor_name
from .fold import fold_runs
from .program import Program, Step
from .shards import StateKey

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*\Z")


def ident(name: str) -> str:
    if not isinstance(name, str) or not _IDENT.match(name):
        raise ValueError(f"not an identifier: {name!r}")
    return name


def pyrepr(value) -> str:
    """A Python literal for plain data; raises TypeError for anything else."""
    if value is None or isinstance(value, (bool, int, str)):
        return repr(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, tuple):
        inner = ", ".join(pyrepr(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, list):
        return "[" + ", ".join(pyrepr(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{pyrepr(k)}: {pyrepr(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"pyrepr: {type(value).__name__} is not plain data")


class _Tables:
    """The script's tables: every key, box and shape once, keys of consecutive layers at
    consecutive indices (so that per-layer repetition folds into runs)."""

    def __init__(self, prog: Program):
        keys: set[StateKey] = set()
        for by_rank in (prog.src, prog.dst):
            for specs in by_rank.values():
                keys.update(s.key for s in specs)
        for steps in prog.steps.values():
            for s in steps:
                keys.update(s.keys)
                for p in _pieces(s):
                    keys.add(p.src)
                    keys.add(p.dst)
        runs: dict[tuple[str, str], list[int]] = defaultdict(list)
        plain: list[str] = []
        for k in keys:
            text = str(k)
            split = split_tensor_name(k.tensor)
            fam, layers = split if split is not None else (None, None)
            if layers is not None and layers[0] == layers[1]:
                prefix, suffix = f"{k.model_stage}:{k.state}:layers.", "." + fam
                if f"{prefix}{layers[0]}{suffix}" == text:
                    runs[(prefix, suffix)].append(layers[0])
                    continue
            plain.append(text)
        self.key_runs: list = []  # a key, or [prefix, suffix, first layer, last layer]
        self.key: dict[str, int] = {}
        for text in sorted(plain):
            self.key[text] = len(self.key)
            self.key_runs.append(text)
        for (prefix, suffix), layers in sorted(runs.items()):
            layers.sort()
            for first, n in fold_runs(layers, lambda x: ((), (x,))):
                for i in range(first, first + n):
                    self.key[f"{prefix}{i}{suffix}"] = len(self.key)
                self.key_runs.append([prefix, suffix, first, first + n - 1])
        self.boxes: list[tuple[int, ...]] = []
        self._box: dict = {}
        self.shapes: list[tuple[int, ...]] = []
        self._shape: dict = {}
        self.dtypes: list[str] = []
        self._by_id: dict[int, int] = {}

    def k(self, key: StateKey) -> int:
        i = self._by_id.get(id(key))  # the program holds every key: ids are stable while it renders
        if i is None:
            i = self._by_id[id(key)] = self.key[str(key)]
        return i

    def box(self, box) -> int:
        i = self._box.get(box)
        if i is None:
            i = self._box[box] = len(self.boxes)
            self.boxes.append(tuple(x for span in box for x in span))
        return i

    def shape(self, shape) -> int:
        i = self._shape.get(shape)
        if i is None:
            i = self._shape[shape] = len(self.shapes)
            self.shapes.append(tuple(shape))
        return i

    def dtype(self, dtype: str) -> int:
        if dtype not in self.dtypes:
            self.dtypes.append(dtype)
        return self.dtypes.index(dtype)


def _pieces(s: Step):
    if s.piece is not None:
        yield s.piece
    for m in s.sends + s.recvs:
        yield from m.pieces
    if s.message is not None:
        yield from s.message.pieces


def _specs(tab: _Tables, specs) -> list[int]:
    """A rank's shards as runs: key, count, shape, box, dtype (``count`` keys from ``key`` on)."""
    rows = [(tab.k(s.key), tab.shape(s.shape), tab.box(s.box), tab.dtype(s.dtype)) for s in specs]
    out: list[int] = []
    for (key, shape, box, dtype), n in fold_runs(rows, lambda r: (r[1:], r[:1])):
        out += [key, n, shape, box, dtype]
    return out


def _piece_runs(items: list[tuple[int, int, int]]) -> list[tuple[int, int, int, int]]:
    """(key, box, flag) per piece -> (key, box, flag, count): ``count`` pieces from ``key`` on."""
    return [(k, b, f, n) for (k, b, f), n in fold_runs(items, lambda x: (x[1:], x[:1]))]


OP = {"keep": 0, "alloc": 1, "copy": 2, "unstage": 3, "round": 4, "broadcast": 5}


def _steps(tab: _Tables, rank: int, steps: list[Step]) -> list[list[int]]:
    """A rank's steps as flat integer records (see the template's STEPS), per-layer repetition folded."""
    flat: list[tuple] = []  # (record without its count, counters) before folding
    for s in steps:
        if s.kind in ("keep", "alloc"):
            flat += [((OP[s.kind],), (tab.k(k),)) for k in s.keys]
        elif s.kind == "copy":
            p = s.piece
            flat.append(
                ((OP["copy"], tab.box(p.box), int(p.arrived) | 2 * int(p.staged)), (tab.k(p.src), tab.k(p.dst)))
            )
        elif s.kind == "unstage":
            p = s.piece
            flat.append(((OP["unstage"], tab.box(p.box)), (tab.k(p.src), tab.k(p.dst))))
        elif s.kind == "round":
            msgs = sorted(
                [
                    (m.id, 0, m.receiver, [(tab.k(p.src), tab.box(p.box), int(p.arrived)) for p in m.pieces])
                    for m in s.sends
                ]
                + [
                    (m.id, 1, m.sender, [(tab.k(p.dst), tab.box(p.box), int(p.staged)) for p in m.pieces])
                    for m in s.recvs
                ]
            )
            sigs = []
            for _, verb, peer, pieces in msgs:
                runs = _piece_runs(pieces)
                sigs.append(((verb, peer, tuple((b, f, n) for _, b, f, n in runs)), tuple(k for k, _, _, _ in runs)))
            record = [OP["round"]]
            for (shape, keys), n in fold_runs(sigs, lambda x: x):  # n messages, the i-th with every key plus i
                verb, peer, runs = shape
                record += [verb, peer, n, len(runs)]
                for k, (b, f, c) in zip(keys, runs):
                    record += [k, b, f, c]
            flat.append((tuple(record), ()))
        elif s.kind == "broadcast":
            root = s.group[0]
            pieces = [(tab.k(p.src if rank == root else p.dst), tab.box(p.box), 0) for p in s.message.pieces]
            record = [OP["broadcast"], root, len(s.group), *s.group]
            for k, b, _, c in _piece_runs(pieces):
                record += [k, b, c]
            flat.append((tuple(record), ()))
        # load, release, offload: the script's state lives where the launcher put it
    out: list[list[int]] = []
    for (record, keys), n in fold_runs(flat, lambda x: x):
        if record[0] in (OP["keep"], OP["alloc"]):
            out.append([record[0], keys[0], n])
        elif record[0] in (OP["copy"], OP["unstage"]):
            out.append([record[0], n, keys[0], keys[1], *record[1:]])
        else:
            out.append(list(record))
    return out


def render_script(prog: Program) -> str:
    """The standalone torchrun script of ``prog``: its data as integer tables that a loop interprets."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
    )
    env.filters["pyrepr"] = pyrepr
    env.filters["ident"] = ident
    tab = _Tables(prog)
    src = [(r, _specs(tab, prog.src.get(r, []))) for r in range(prog.world)]
    dst = [(r, _specs(tab, prog.dst.get(r, []))) for r in range(prog.world)]
    steps = [(r, _steps(tab, r, prog.steps.get(r, []))) for r in range(prog.world)]
    return env.get_template("transition_script.py.j2").render(
        prog=prog,
        key_runs=tab.key_runs,
        boxes=tab.boxes,
        shapes=tab.shapes,
        dtypes=tab.dtypes,
        src=src,
        dst=dst,
        program_steps=steps,
    )
