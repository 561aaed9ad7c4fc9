"""Render a collective program as a standalone Python script (jinja2), runnable under torchrun.

Nothing from an IR file reaches the script as code: names are checked against the grammar's
identifier shape (``ident``) where they appear in prose, and every value the script uses as
data (keys, boxes, dtypes, steps) is written by ``pyrepr``, which emits Python literals of
strings, numbers, tuples, lists and dicts only, and refuses anything else.
"""

from __future__ import annotations

import re
from pathlib import Path

import jinja2

from .program import Program, Step

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


def _step(rank: int, s: Step) -> list[tuple]:
    """One program step as the script's tuples (several for keep and alloc, one per key)."""
    if s.kind in ("keep", "alloc"):
        return [(s.kind, str(k)) for k in s.keys]
    if s.kind == "copy":
        p = s.piece
        return [("copy", str(p.src), str(p.dst), p.box, p.arrived, p.staged)]
    if s.kind == "unstage":
        p = s.piece
        return [("unstage", str(p.src), str(p.dst), p.box)]
    if s.kind == "round":
        msgs = sorted([(m.id, "send", m.receiver, [(str(p.src), p.box, p.arrived) for p in m.pieces]) for m in s.sends]
                      + [(m.id, "recv", m.sender, [(str(p.dst), p.box, p.staged) for p in m.pieces]) for m in s.recvs])
        return [("round", [(verb, peer, pieces) for _, verb, peer, pieces in msgs])]
    if s.kind == "broadcast":
        root = s.group[0]
        pieces = [(str(p.src if rank == root else p.dst), p.box) for p in s.message.pieces]
        return [("broadcast", root, s.group, pieces)]
    return []  # load, release, offload: the script's state lives where the launcher put it


def render_script(prog: Program) -> str:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
                             undefined=jinja2.StrictUndefined, autoescape=False, keep_trailing_newline=True)
    env.filters["pyrepr"] = pyrepr
    env.filters["ident"] = ident

    def specs(by_rank):  # the template reads key, shape, box and dtype; keys as their text
        return [(r, [{"key": str(s.key), "shape": s.shape, "box": s.box, "dtype": s.dtype} for s in by_rank.get(r, [])])
                for r in range(prog.world)]

    steps = [(r, [t for s in prog.steps.get(r, []) for t in _step(r, s)]) for r in range(prog.world)]
    return env.get_template("transition_script.py.j2").render(prog=prog, src=specs(prog.src), dst=specs(prog.dst),
                                                             program_steps=steps)
