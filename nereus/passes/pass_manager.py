"""Passes and pipelines, shaped like xDSL's: a pass is a frozen dataclass whose fields are its
options and whose ``name`` is its pipeline name; a pipeline string ``a,b{key=value,...}``
names passes and sets options. The module is verified after every pass, and a failure names
the pass and the ones that ran before it.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass
from typing import Callable, ClassVar

from ..ir import Diagnostic, DiagnosticError, Loc, Module, print_ir, verify


@dataclass(frozen=True)
class ModulePass:
    """Base class: subclasses set ``name`` and implement ``apply``."""

    name: ClassVar[str] = ""

    def apply(self, module: Module) -> None:  # pragma: no cover - abstract
        raise NotImplementedError


PASSES: dict[str, type[ModulePass]] = {}


def register(cls: type[ModulePass]) -> type[ModulePass]:
    """Class decorator: make a pass available to pipelines by its ``name``."""
    assert cls.name and cls.name not in PASSES, f"pass name {cls.name!r} missing or taken"
    PASSES[cls.name] = cls
    return cls


class PipelineError(ValueError):
    """A pipeline string that names an unknown pass or option, or has a malformed value."""


_ITEM = re.compile(r"\s*([A-Za-z][A-Za-z0-9_-]*)\s*(\{([^{}]*)\})?\s*(,|$)")


def _coerce(cls: type[ModulePass], key: str, text: str):
    hints = typing.get_type_hints(cls)
    kind = hints[key]
    text = text.strip()
    try:
        if kind is bool:
            if text not in ("true", "false"):
                raise ValueError
            return text == "true"
        if kind is int:
            return int(text)
        if kind is float:
            return float(text)
    except ValueError:
        raise PipelineError(f"option {key} of pass {cls.name} expects {kind.__name__}, got '{text}'") from None
    return text


def parse_pipeline(spec: str) -> list[ModulePass]:
    """``"derive-emus{plan=@p}"`` -> ``[DeriveEmus(plan="@p")]``; raises PipelineError."""
    passes: list[ModulePass] = []
    pos = 0
    spec = spec.strip()
    while pos < len(spec):
        m = _ITEM.match(spec, pos)
        if m is None or m.end() == pos:
            raise PipelineError(f"malformed pipeline at column {pos + 1}: {spec[pos:]!r}; expected name or name{{key=value,...}}")
        name, _, body, _sep = m.groups()
        cls = PASSES.get(name)
        if cls is None:
            raise PipelineError(f"unknown pass '{name}'; known passes: {', '.join(sorted(PASSES)) or '(none)'}")
        fields = {f.name for f in dataclasses.fields(cls)}
        options = {}
        for item in (body or "").split(","):
            if not item.strip():
                continue
            key, eq, value = item.partition("=")
            key = key.strip()
            if not eq:
                raise PipelineError(f"option '{item.strip()}' of pass {name} needs a value: key=value")
            if key not in fields:
                raise PipelineError(f"pass {name} has no option '{key}'; options: {', '.join(sorted(fields)) or '(none)'}")
            options[key] = _coerce(cls, key, value)
        try:
            passes.append(cls(**options))
        except TypeError as e:
            raise PipelineError(f"pass {name}: {e}") from None
        pos = m.end()
    return passes


def run_pipeline(module: Module, spec: str | list[ModulePass],
                 after_each: Callable[[ModulePass, Module], None] | None = None) -> Module:
    """Run the passes of ``spec`` on ``module`` in place, verifying after each one.

    A pass that reports problems raises DiagnosticError itself; a pass that leaves invalid IR
    behind raises DiagnosticError whose first diagnostic names it and the passes before it.
    """
    passes = parse_pipeline(spec) if isinstance(spec, str) else spec
    ran: list[str] = []
    for p in passes:
        p.apply(module)
        try:
            verify(module)
        except DiagnosticError as e:
            before = ", ".join(ran) or "none"
            head = Diagnostic(Loc(0, 0, module.filename), f"IR is invalid after pass {p.name} (passes before it: {before})")
            raise DiagnosticError([head, *e.diagnostics], print_ir(module)) from None
        ran.append(p.name)
        if after_each is not None:
            after_each(p, module)
    return module
