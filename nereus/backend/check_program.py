"""Checks on a lowered program: every destination byte is written exactly once, and every piece
reads and writes inside the shards of its rank (stage 7 of ``lower``)."""

from __future__ import annotations

from ..ir import Diagnostic, DiagnosticError, Loc
from .program import STEP_KINDS, Program
from .shards import ShardSpec, StateKey


def _error(msg: str) -> DiagnosticError:
    return DiagnosticError([Diagnostic(Loc(0, 0, None), msg)])


def check_coverage(
    dst: dict[int, list[ShardSpec]],
    kept: set[tuple[int, StateKey]],
    written: dict[tuple[int, StateKey], int],
    restore: bool = False,
) -> None:
    """Every destination shard that does not stay in place is written exactly once (by volume);
    with ``restore`` (a transition that leaves what only failed GPUs held to a checkpoint), at
    most once: the rest is read from the checkpoint."""
    for r, specs in dst.items():
        for spec in specs:
            if (r, spec.key) in kept:
                continue
            if restore and written[(r, spec.key)] <= spec.nbytes:
                continue
            if written[(r, spec.key)] != spec.nbytes:
                raise _error(
                    f"lower-collectives: rank {r} receives {written[(r, spec.key)]:,} of the {spec.nbytes:,} "
                    f"bytes of {spec.key} {list(spec.box)}: the transition does not deliver it exactly once"
                )


def _inside(box, outer) -> bool:
    return all(outer_lo <= lo and hi <= outer_hi for (lo, hi), (outer_lo, outer_hi) in zip(box, outer))


def check_slices(prog: Program) -> None:
    """Every piece reads inside a shard the rank holds and writes inside one it will hold; an
    unstage reads a staging buffer that an earlier step of the rank wrote."""
    for r, steps in prog.steps.items():
        src = {s.key: s.box for s in prog.src.get(r, [])}
        dst = {s.key: s.box for s in prog.dst.get(r, [])}
        staged: set[tuple] = set()
        for step in steps:
            kind = STEP_KINDS[step.kind]
            if kind.stages and (step.piece.src, step.piece.box) not in staged:
                raise _error(
                    f"lower-collectives: rank {r} unstages {step.piece.src} {list(step.piece.box)} before it is staged"
                )
            # a copy reads and writes its piece; an unstage writes it (it reads a staging buffer)
            reads = (
                ([step.piece] if not kind.stages else [])
                if kind.holds == "piece"
                else [p for m in step.sends for p in m.pieces]
            )
            writes = [step.piece] if kind.holds == "piece" else [p for m in step.recvs for p in m.pieces]
            if kind.holds == "message":
                (reads if step.group[0] == r else writes).extend(step.message.pieces)
            for p in reads:
                held = (dst if p.arrived else src).get(p.src)
                if held is None or not _inside(p.box, held):
                    raise _error(f"lower-collectives: rank {r} reads {p.src} {list(p.box)}, which it does not hold")
            for p in writes:
                if p.staged and not kind.stages:
                    staged.add((p.dst, p.box))
                if p.dst not in dst or not _inside(p.box, dst[p.dst]):
                    raise _error(f"lower-collectives: rank {r} writes {p.dst} {list(p.box)} outside its shard")
