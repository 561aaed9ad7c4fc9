"""Traces for ``nereus simulate``: what a long RL run meets, step by step, as JSON lines.

Line 1 is the header, one object:

    {"trace": "combined", "job": "ppo_70b_1024gpu", "gpus": 1024, "steps": 1000, "seed": 0,
     "description": "...", "sources": ["DeepSeek-R1 (arXiv:2501.12948) Fig. 3: ...", ...]}

``job`` names the IR job the trace is run on (an example of ``nereus.testing.jobs`` or a
``.nir`` file next to the trace); ``gpus`` is how many GPUs the trace's ids range over (0 to
gpus - 1: at most the job's cluster). Every other line is one step, in order from 0:

    {"step": 0, "response_len_dist": [700, 950, 1200, 1400, 1600, 1900, 2300, 3500],
     "unavailable": [[512, 1023]], "leaving": []}

- ``response_len_dist``: the lengths (tokens) of equal shares of the step's responses, sorted
  (a workload's ``response_len_dist``: 8 shares of 1/8 each here);
- ``unavailable``: the GPUs the job cannot use this step, as inclusive ranges;
- ``leaving``: GPUs announced to leave after this step (usable now, and they can still send
  their state: a preemption with notice); a GPU that fails without notice is simply unavailable
  from its step on.

A key left out of a step line keeps its previous value (``{"step": 7}`` changes nothing), so a
long run with few events is a short file. A malformed line is a diagnostic with its line number.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..ir import Diagnostic, DiagnosticError, Loc

HEADER_KEYS = {"trace", "job", "gpus", "steps", "seed", "description", "sources"}
STEP_KEYS = {"step", "response_len_dist", "unavailable", "leaving"}


@dataclass(frozen=True)
class TraceStep:
    step: int
    response_len_dist: tuple[int, ...]
    unavailable: frozenset[int]
    leaving: frozenset[int] = frozenset()

    @property
    def response_len_mean(self) -> int:
        return max(1, round(sum(self.response_len_dist) / len(self.response_len_dist)))


@dataclass
class Trace:
    name: str
    job: str
    gpus: int
    steps: list[TraceStep]
    seed: int | None = None
    description: str = ""
    sources: list[str] = field(default_factory=list)
    path: Path | None = None

    def available(self, i: int) -> list[int]:
        down = self.steps[i].unavailable
        return [g for g in range(self.gpus) if g not in down]


def ranges(ids) -> list[list[int]]:
    """Sorted ids as inclusive ranges: [0, 1, 2, 5] -> [[0, 2], [5, 5]]."""
    out: list[list[int]] = []
    for g in sorted(ids):
        if out and g == out[-1][1] + 1:
            out[-1][1] = g
        else:
            out.append([g, g])
    return out


def write_trace(trace: Trace, path: str | Path) -> None:
    """The trace as JSON lines, each step line holding only what changed."""
    head = {
        "trace": trace.name,
        "job": trace.job,
        "gpus": trace.gpus,
        "steps": len(trace.steps),
        "seed": trace.seed,
        "description": trace.description,
        "sources": trace.sources,
    }
    lines = [json.dumps(head)]
    prev = None
    for s in trace.steps:
        row: dict = {"step": s.step}
        if prev is None or s.response_len_dist != prev.response_len_dist:
            row["response_len_dist"] = list(s.response_len_dist)
        if prev is None or s.unavailable != prev.unavailable:
            row["unavailable"] = ranges(s.unavailable)
        if s.leaving or (prev is not None and prev.leaving):
            row["leaving"] = sorted(s.leaving)
        lines.append(json.dumps(row))
        prev = s
    Path(path).write_text("\n".join(lines) + "\n")


def read_trace(path: str | Path) -> Trace:
    """Parse and check a trace; every problem is a diagnostic at its line."""
    path = Path(path)
    errors: list[Diagnostic] = []

    def err(line: int, msg: str, hint: str = "") -> None:
        errors.append(Diagnostic(Loc(line, 1, str(path)), msg, hint))

    lines = path.read_text().splitlines()
    if not lines:
        raise DiagnosticError([Diagnostic(Loc(1, 1, str(path)), "empty trace: line 1 must be the header")])
    rows = []
    for i, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            err(i, f"not JSON: {e.msg} at column {e.colno}")
            continue
        if not isinstance(obj, dict):
            err(i, f"a trace line is a JSON object, got {type(obj).__name__}")
            continue
        rows.append((i, obj))
    if errors:
        raise DiagnosticError(errors)
    (hline, head), steps = rows[0], rows[1:]
    unknown = set(head) - HEADER_KEYS
    if unknown or "trace" not in head:
        err(
            hline,
            'line 1 must be the header {"trace": ..., "job": ..., "gpus": ...}'
            + (f"; unknown keys {sorted(unknown)}" if unknown else ""),
        )
    gpus = head.get("gpus")
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
        err(hline, f"gpus must be a positive integer, got {gpus!r}")
        gpus = 0
    if not isinstance(head.get("job"), str):
        err(hline, "job must name the IR job the trace runs on")
    out: list[TraceStep] = []
    dist: tuple[int, ...] | None = None
    down: frozenset[int] = frozenset()
    leaving: frozenset[int] = frozenset()
    for line, obj in steps:
        unknown = set(obj) - STEP_KEYS
        if unknown:
            err(
                line, f"unknown keys {sorted(unknown)}", "a step line has step, response_len_dist, unavailable, leaving"
            )
        if obj.get("step") != len(out):
            err(line, f"step {obj.get('step')!r} out of order: expected {len(out)}")
        if "response_len_dist" in obj:
            d = obj["response_len_dist"]
            if (
                not isinstance(d, list)
                or not d
                or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in d)
                or d != sorted(d)
            ):
                err(line, f"response_len_dist must be positive integers in increasing order, got {d!r}")
            else:
                dist = tuple(d)
        if "unavailable" in obj:
            ids = _ids(obj["unavailable"], gpus, line, "unavailable", err)
            if ids is not None:
                down = ids
        if "leaving" in obj:
            ids = _ids(
                [[g, g] for g in obj["leaving"]] if isinstance(obj["leaving"], list) else obj["leaving"],
                gpus,
                line,
                "leaving",
                err,
            )
            if ids is not None:
                leaving = ids
        else:
            leaving = frozenset()
        if dist is None:
            err(line, "the first step needs response_len_dist")
            dist = (1,)
        if leaving & down:
            err(line, f"GPUs {sorted(leaving & down)[:5]} are both unavailable and leaving")
        out.append(TraceStep(len(out), dist, down, leaving))
    if not out and not errors:
        err(hline, "the trace has no steps")
    if "steps" in head and head["steps"] != len(out) and not errors:
        err(hline, f"the header says {head['steps']} steps, the file has {len(out)}")
    if errors:
        raise DiagnosticError(errors)
    return Trace(
        name=str(head["trace"]),
        job=head["job"],
        gpus=gpus,
        steps=out,
        seed=head.get("seed"),
        description=str(head.get("description", "")),
        sources=list(head.get("sources", [])),
        path=path,
    )


def _ids(value, gpus: int, line: int, key: str, err) -> frozenset[int] | None:
    if not isinstance(value, list) or not all(
        isinstance(r, list) and len(r) == 2 and all(isinstance(x, int) for x in r) for r in value
    ):
        err(line, f"{key} must be a list of inclusive [first, last] GPU ranges, got {value!r}")
        return None
    ids: set[int] = set()
    for lo, hi in value:
        if not 0 <= lo <= hi < gpus:
            err(line, f"{key} range [{lo}, {hi}] is outside GPUs 0..{gpus - 1} of the trace")
            return None
        ids.update(range(lo, hi + 1))
    return frozenset(ids)
