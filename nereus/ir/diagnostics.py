"""One diagnostic type for syntax and semantic errors, printed like a compiler's.

examples/bad.nir:12:17: error: tp = 3 does not divide heads = 32 of model @actor
   12 |     tp = 3
      |          ^
hint: choose tp from 1, 2, 4, 8, 16, 32
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, order=True)
class Loc:
    """A source position: 1-based line and column."""

    line: int = 0
    col: int = 0
    file: str | None = field(default=None, compare=False)

    def __str__(self) -> str:
        if self.line <= 0:  # not from a line of the file (a missing file, a result of a pass)
            return self.file or "<input>"
        return f"{self.file or '<input>'}:{self.line}:{self.col}"


NOWHERE = Loc()


@dataclass(frozen=True)
class Diagnostic:
    loc: Loc
    message: str
    hint: str | None = None
    severity: str = "error"

    def render(self, source: str | None = None, lines_of_source: list[str] | None = None) -> str:
        """The diagnostic, the source line (cut around the caret when long) and a caret under its column.

        ``lines_of_source`` is ``source`` split into lines, for a caller rendering many diagnostics.
        """
        lines = [f"{self.loc}: {self.severity}: {self.message}"]
        if source is not None and self.loc.line >= 1:
            src_lines = lines_of_source if lines_of_source is not None else source_lines(source)
            if self.loc.line <= len(src_lines):
                # clipped first: expandtabs(1) keeps every column where it is, and a 50 MB line is not copied
                text, caret = clip_line(src_lines[self.loc.line - 1], max(self.loc.col - 1, 0))
                text = text.expandtabs(1)
                gutter = f"{self.loc.line:>5} | "
                lines.append(gutter + text)
                lines.append(" " * (len(gutter) - 2) + "| " + " " * caret + "^")
        if self.hint:
            lines.append(f"hint: {self.hint}")
        return "\n".join(lines)


# Columns of a source line a diagnostic echoes; a longer line is cut around the caret. Lines a person
# writes, and the transition operations the printer writes (up to ~180 columns), are shown whole; a
# one-line layout of 64 pipeline stages (650 columns) or a 50 MB one-line file is not.
MAX_SHOWN = 200
_ELLIPSIS = "..."


def source_lines(source: str) -> list[str]:
    """``source`` split into lines as the parser counts them (at ``\\n`` only; a ``\\r`` before it dropped)."""
    return [line[:-1] if line.endswith("\r") else line for line in source.split("\n")]


def clip_line(text: str, caret: int, width: int = MAX_SHOWN) -> tuple[str, int]:
    """``text`` cut to ``width`` columns around column ``caret`` (0-based), with an ellipsis on each
    cut side; returns the text to show and the caret's column in it. A one-line 50 MB file must
    not be echoed whole."""
    if len(text) <= width:
        return text, caret
    start = max(0, min(caret - width // 2, len(text) - width))
    end = start + width
    head = _ELLIPSIS if start > 0 else ""
    tail = _ELLIPSIS if end < len(text) else ""
    return head + text[start:end] + tail, len(head) + caret - start


class DiagnosticError(Exception):
    """Raised by ``parse`` and ``verify``; carries every diagnostic found, sorted by position."""

    def __init__(self, diagnostics: list[Diagnostic], source: str | None = None):
        # Replicas parsed from one emu block share their lines: report a repeated error once.
        unique = list(dict.fromkeys(diagnostics))
        self.diagnostics = sorted(unique, key=lambda d: (d.loc.file or "", d.loc.line, d.loc.col))
        self.source = source
        super().__init__(self.render())

    def __reduce__(self):  # picklable (a pool worker's error must reach the parent, not hang it)
        return DiagnosticError, (self.diagnostics, self.source)

    def render(self, source: str | None = None) -> str:
        src = source if source is not None else self.source
        lines = source_lines(src) if src is not None and any(d.loc.line >= 1 for d in self.diagnostics) else None
        return "\n".join(d.render(src, lines) for d in self.diagnostics)


class DiagnosticSink:
    """Collects diagnostics so that a pass reports every error, not just the first."""

    def __init__(self, file: str | None = None):
        self.file = file
        self.diagnostics: list[Diagnostic] = []

    def error(self, loc: Loc, message: str, hint: str | None = None) -> None:
        self.diagnostics.append(Diagnostic(loc, message, hint))

    def __bool__(self) -> bool:
        return bool(self.diagnostics)

    def raise_if_any(self, source: str | None = None) -> None:
        if self.diagnostics:
            raise DiagnosticError(self.diagnostics, source)


def plural(n: float, noun: str, many: str | None = None, fmt: str | None = None) -> str:
    """``n`` and its noun, in the singular for one: ``1 plan``, ``2 plans``, ``1.5 steps``
    (``many``: an irregular plural, ``plural(n, "entry", "entries")``; ``fmt``: how ``n`` prints,
    ``","`` for ``1,024 GPUs``; by default ``d`` for an int, ``g`` for a float)."""
    shown = format(n, fmt if fmt is not None else ("d" if isinstance(n, int) else "g"))
    return f"{shown} {noun if n == 1 else (many or noun + 's')}"


def closest(word: str, choices) -> str | None:
    """The choice ``word`` most likely misspells, if any is close enough."""
    import difflib

    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return match[0] if match else None


def did_you_mean(word: str, choices) -> str | None:
    match = closest(word, choices)
    return f"did you mean '{match}'?" if match else None
