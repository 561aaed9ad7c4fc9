"""Passes and pipelines, shaped like xDSL's: a pass is a frozen dataclass whose fields are its
options and whose ``name`` is its pipeline name; a pipeline string ``a,b{key=value,...}``
names passes and sets options. The module is verified after every pass (or, by the caller's
``verify`` policy, once at the end, or not at all), and a failure names the pass and the ones
that ran before it.

Options are typed once, by their annotation: ``bool``, ``int``, ``float``, ``str``, ``Ref``
(a symbol reference written ``@name``), ``Size`` (bytes, written with a unit: ``64MiB``) and
``Gpus`` (GPU numbers, written as the IR writes integer lists: ``[0..3, 8]``). An option whose
field says ``metadata={"api": True}`` (``api_option``) takes a Python value (a callable, measured
records) and is set by callers in Python only; a pipeline string cannot name it.

A pass that needs another pass's results says so in ``requires(module)``; the pass manager
runs what it returns first, as pipeline steps of their own (verified, and shown by
``--print-ir-after-all``), so no pass runs another behind the pipeline's back.

Which passes exist is not this module's business: ``run_pipeline`` and ``parse_pipeline`` take
a registry (name -> pass class). This layer's own passes are in ``PASSES``; the registry of
every layer's passes is ``nereus.registry.get_all_passes()``, above the layers, as xDSL's is.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ClassVar, NewType

from ...ir import Diagnostic, DiagnosticError, Loc, Module, print_ir
from ...ir import verify as verify_module
from ...ir.units import UnitError, parse_size

if TYPE_CHECKING:
    # At run time these are markers that ``_coerce`` finds by identity in a pass's annotations;
    # to the type checker they are the values they hold (a ``Gpus`` option left unset is None).
    Ref = str
    Size = int
    Gpus = tuple[int, ...] | None
else:
    Ref = NewType("Ref", str)
    """An option that names a plan or transition: written ``@name``, stored as the bare name (the
    ``@`` taken off once, when the pass is made, whether a pipeline or Python gave it; ``""``: none)."""
    Size = NewType("Size", int)
    """An option in bytes, written with a unit in pipelines (``64MiB``) or as a plain integer."""
    Gpus = NewType("Gpus", tuple)
    """An option that names GPUs: a sorted tuple of ints, written ``[0..3, 8]`` in pipelines."""

VERIFY = ("each", "end", "off")
"""When ``run_pipeline`` verifies the module: after every pass, once after the last, or never
(a caller that verifies itself, or one that says why it can do without)."""


def api_option(default=None):
    """A pass option set from Python only (``metadata={"api": True}``): not compared, not
    printed in pipelines, refused in pipeline strings."""
    return dataclasses.field(default=default, compare=False, metadata={"api": True})


def pipeline_options(cls: type[ModulePass]) -> list[dataclasses.Field]:
    """The options a pipeline string may set (every field but the ``api_option`` ones)."""
    return [f for f in dataclasses.fields(cls) if not f.metadata.get("api")]


@dataclass(frozen=True)
class ModulePass:
    """Base class: subclasses set ``name`` and implement ``apply``."""

    name: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for key in _ref_options(type(self)):
            value = getattr(self, key)
            if isinstance(value, str) and value.startswith("@"):
                object.__setattr__(self, key, value[1:])

    def apply(self, module: Module) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def requires(self, module: Module) -> list[ModulePass]:
        """Passes that must run on ``module`` before this one (none by default)."""
        return []


_REFS: dict[type, tuple[str, ...]] = {}  # a pass class's Ref options, read from its annotations once


def _ref_options(cls: type) -> tuple[str, ...]:
    refs = _REFS.get(cls)
    if refs is None:
        hints = typing.get_type_hints(cls)
        refs = _REFS[cls] = tuple(f.name for f in dataclasses.fields(cls) if hints.get(f.name) is Ref)
    return refs


def no_such(module: Module, pass_name: str, kind: str, name: str) -> DiagnosticError:
    """``pass_name: no plan @x``, naming what the module has (or that ``kind=@name`` is missing),
    with a did-you-mean when a name is close."""
    from ...ir.diagnostics import closest

    table = getattr(module, kind + "s")
    have = ", ".join("@" + n for n in table) or "none"
    if not name:
        option = "to" if pass_name in ("plan-transition", "remap") else kind
        example = list(table)[-1] if table else "name"
        return DiagnosticError(
            [
                Diagnostic(
                    Loc(0, 0, module.filename),
                    f"{pass_name} needs a {kind}: the module's {kind}s: {have}",
                    f"{pass_name}{{{option}=@{example}}}",
                )
            ]
        )
    close = closest(name, table)
    hint = f"did you mean @{close}?" if close else None
    return DiagnosticError(
        [Diagnostic(Loc(0, 0, module.filename), f"{pass_name}: no {kind} @{name}; the module's {kind}s: {have}", hint)]
    )


def check_time_limit(module: Module, pass_name: str, time_limit: float) -> None:
    """A solver's ``time_limit`` (s) must be a positive, finite number of seconds: a limit of 0 or
    -1 would give up at once and read as "raise time_limit" to the user."""
    if not 0 < time_limit < math.inf:
        raise DiagnosticError(
            [
                Diagnostic(
                    Loc(0, 0, module.filename),
                    f"{pass_name}: time_limit must be a positive number of seconds, got {time_limit:g}",
                    f"{pass_name}{{time_limit=10}} gives the solver 10 s",
                )
            ]
        )


PASSES: dict[str, type[ModulePass]] = {}
"""The passes of this layer (``nereus.passes``), by name."""

Registry = Mapping[str, type[ModulePass]]


def register(cls: type[ModulePass]) -> type[ModulePass]:
    """Class decorator: add a pass of this layer to ``PASSES`` by its ``name``."""
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
        if kind is Size:
            return parse_size(text)
        if kind is Ref:
            if not _REF.fullmatch(text):
                raise ValueError
            return text
        if kind is Gpus:
            return parse_gpus(text)
    except (ValueError, UnitError):
        raise PipelineError(f"option {key} of pass {cls.name} expects {option_type(cls, key)}, got '{text}'") from None
    return text


_REF = re.compile(r"@[A-Za-z_][A-Za-z0-9_.-]*")
_TYPE_NAMES = {Ref: "@name", Size: "a size such as 64MiB", Gpus: "GPUs such as [0..3, 8]"}
_SPAN = re.compile(r"\s*(\d+)\s*(?:\.\.\s*(\d+)\s*)?\Z")


def parse_gpus(text: str) -> tuple[int, ...]:
    """``[0..3, 8]`` -> ``(0, 1, 2, 3, 8)`` (``[]``: none); ValueError otherwise."""
    text = text.strip()
    if not (text.startswith("[") and text.endswith("]")):
        raise ValueError
    out: set[int] = set()
    for item in filter(str.strip, text[1:-1].split(",")):
        m = _SPAN.match(item)
        if m is None or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
            raise ValueError
        out.update(range(int(m.group(1)), int(m.group(2) or m.group(1)) + 1))
    return tuple(sorted(out))


def _split_options(body: str) -> list[str]:
    """``a=1,b=[0..3, 8]`` -> ``["a=1", "b=[0..3, 8]"]``: commas inside brackets stay."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(body):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            items.append(body[start:i])
            start = i + 1
    items.append(body[start:])
    return items


def option_type(cls: type[ModulePass], key: str) -> str:
    """How an option's value is written, for messages and ``nereus passes``."""
    kind = typing.get_type_hints(cls)[key]
    return _TYPE_NAMES.get(kind, getattr(kind, "__name__", str(kind)))


def parse_pipeline(spec: str, registry: Registry | None = None) -> list[ModulePass]:
    """``"derive-emus{plan=@p}"`` -> ``[DeriveEmus(plan="@p")]``; raises PipelineError.
    ``registry``: the passes a pipeline may name (default: this layer's, ``PASSES``)."""
    registry = PASSES if registry is None else registry
    passes: list[ModulePass] = []
    pos = 0
    spec = spec.strip()
    while pos < len(spec):
        m = _ITEM.match(spec, pos)
        if m is None or m.end() == pos:
            raise PipelineError(
                f"malformed pipeline at column {pos + 1}: {spec[pos:]!r}; expected name or name{{key=value,...}}"
            )
        name, _, body, _sep = m.groups()
        cls = registry.get(name)
        if cls is None:
            raise PipelineError(f"unknown pass '{name}'; known passes: {', '.join(sorted(registry)) or '(none)'}")
        fields = {f.name for f in pipeline_options(cls)}
        options = {}
        for item in _split_options(body or ""):
            if not item.strip():
                continue
            key, eq, value = item.partition("=")
            key = key.strip()
            if not eq:
                raise PipelineError(f"option '{item.strip()}' of pass {name} needs a value: key=value")
            if key not in fields and key in {f.name for f in dataclasses.fields(cls)}:
                raise PipelineError(
                    f"option '{key}' of pass {name} takes a Python value: set it from Python, not in a pipeline"
                )
            if key not in fields:
                raise PipelineError(
                    f"pass {name} has no option '{key}'; options: {', '.join(sorted(fields)) or '(none)'}"
                )
            options[key] = _coerce(cls, key, value)
        try:
            passes.append(cls(**options))
        except TypeError as e:
            raise PipelineError(f"pass {name}: {e}") from None
        pos = m.end()
    return passes


def run_pipeline(
    module: Module,
    spec: str | list[ModulePass],
    after_each: Callable[[ModulePass, Module], None] | None = None,
    registry: Registry | None = None,
    verify_input: bool = True,
    verify: str = "each",
) -> Module:
    """Run the passes of ``spec`` on ``module`` in place; before each pass, the passes it
    ``requires`` (recursively), as steps of their own.

    ``verify`` (``VERIFY``): after each pass (the default), once at the end, or off. The input
    is verified first (``verify_input``; the CLI has just verified it), so invalid input is
    reported as such, not blamed on the first pass. A pass that reports problems raises
    DiagnosticError itself; a pass that leaves invalid IR behind raises DiagnosticError whose
    first diagnostic names it and the passes before it (with ``verify="end"``: the passes that
    ran, the last of them named).
    """
    if verify not in VERIFY:
        raise ValueError(f"verify is one of {', '.join(VERIFY)}, got {verify!r}")
    passes = parse_pipeline(spec, registry) if isinstance(spec, str) else spec
    if verify_input:
        try:
            verify_module(module)
        except DiagnosticError as e:
            head = Diagnostic(Loc(0, 0, module.filename), "the input IR is invalid (before any pass ran)")
            raise DiagnosticError([head, *e.diagnostics], e.source or module.source) from None
    ran: list[str] = []
    for p in passes:
        _run(module, p, ran, after_each, depth=0, each=verify == "each")
    if verify == "end" and ran:
        _verify_after(module, ran[-1], ran[:-1])
    return module


def _run(module: Module, p: ModulePass, ran: list[str], after_each, depth: int, each: bool) -> None:
    if depth > 8:
        raise PipelineError(f"pass {p.name}: its requirements do not end ({' <- '.join(ran[-8:])})")
    for q in p.requires(module):
        _run(module, q, ran, after_each, depth + 1, each)
    try:
        p.apply(module)
    except DiagnosticError as e:  # diagnostics at IR the pass made have no file: they are in this module's
        if all(d.loc.file is not None for d in e.diagnostics):
            raise
        named = [
            d
            if d.loc.file is not None
            else dataclasses.replace(d, loc=dataclasses.replace(d.loc, file=module.filename))
            for d in e.diagnostics
        ]
        raise DiagnosticError(named, e.source) from None
    if each:
        _verify_after(module, p.name, ran)
    ran.append(p.name)
    if after_each is not None:
        after_each(p, module)


def _verify_after(module: Module, name: str, before: list[str]) -> None:
    try:
        verify_module(module)
    except DiagnosticError as e:
        head = Diagnostic(
            Loc(0, 0, module.filename),
            f"IR is invalid after pass {name} (passes before it: {', '.join(before) or 'none'})",
        )
        raise DiagnosticError([head, *e.diagnostics], print_ir(module)) from None
