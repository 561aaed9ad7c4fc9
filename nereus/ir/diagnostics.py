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

    def render(self, source: str | None = None) -> str:
        lines = [f"{self.loc}: {self.severity}: {self.message}"]
        if source is not None and self.loc.line >= 1:
            src_lines = source.splitlines()
            if self.loc.line <= len(src_lines):
                text = src_lines[self.loc.line - 1].expandtabs(1)
                gutter = f"{self.loc.line:>5} | "
                lines.append(gutter + text)
                lines.append(" " * (len(gutter) - 2) + "| " + " " * max(self.loc.col - 1, 0) + "^")
        if self.hint:
            lines.append(f"hint: {self.hint}")
        return "\n".join(lines)


class DiagnosticError(Exception):
    """Raised by ``parse`` and ``verify``; carries every diagnostic found, sorted by position."""

    def __init__(self, diagnostics: list[Diagnostic], source: str | None = None):
        # Replicas parsed from one emu block share their lines: report a repeated error once.
        unique = list(dict.fromkeys(diagnostics))
        self.diagnostics = sorted(unique, key=lambda d: (d.loc.file or "", d.loc.line, d.loc.col))
        self.source = source
        super().__init__(self.render())

    def render(self, source: str | None = None) -> str:
        src = source if source is not None else self.source
        return "\n".join(d.render(src) for d in self.diagnostics)


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


def did_you_mean(word: str, choices) -> str | None:
    import difflib

    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"did you mean '{match[0]}'?" if match else None
