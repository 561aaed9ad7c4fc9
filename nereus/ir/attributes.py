"""Attribute schemas: which ``key = value`` lines a block accepts, their types and units.

The grammar accepts any ``NAME = value``; the schema decides what a key means. One table per
block kind drives three things so they cannot drift apart: the builder (typed values,
unknown-key and wrong-unit diagnostics), the printer (canonical order and formatting) and the
language reference in docs/IR.md (``nereus.ir.docs_reference``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .diagnostics import DiagnosticSink, Loc, did_you_mean
from .units import BASE_UNIT as _BASE_UNIT
from .units import Dim, UnitError, format_number, format_quantity, parse_quantity, split_quantity

REQUIRED = object()


@dataclass(frozen=True)
class Link:
    """A point-to-point link: per-GPU bandwidth (bytes/s) and latency (s)."""

    bandwidth: float
    latency: float


@dataclass(frozen=True)
class V:
    """A syntactic value before it is given a type: kind, payload, location."""

    kind: str  # quantity | int | float | symbol | name | dotted | opid | list | range | call
    value: Any
    loc: Loc
    text: str | None = None  # a float as written (989e12), for messages


@dataclass(frozen=True)
class AttrSpec:
    key: str
    kind: str
    default: Any = REQUIRED
    choices: tuple[str, ...] = ()
    doc: str = ""
    record: "RecordSpec | None" = None
    signed: bool = False  # a quantity that may be negative (admit's saving); others may not

    @property
    def required(self) -> bool:
        return self.default is REQUIRED


@dataclass(frozen=True)
class RecordSpec:
    """A structured value written as a call, ``link(bandwidth = 450GB/s, latency = 2us)``."""

    name: str
    fields: tuple[AttrSpec, ...]
    cls: type

    def example(self) -> str:
        return f"{self.name}(" + ", ".join(f"{f.key} = ..." for f in self.fields if f.required) + ")"


LINK = RecordSpec("link", (AttrSpec("bandwidth", "bandwidth"), AttrSpec("latency", "time")), Link)


def record(key: str, rec: RecordSpec, default: Any = REQUIRED, doc: str = "") -> AttrSpec:
    return AttrSpec(key, "record", default=default, doc=doc, record=rec)


_DIM_KINDS = {"size": Dim.SIZE, "bandwidth": Dim.BANDWIDTH, "time": Dim.TIME, "flops": Dim.FLOPS}


class TypeMismatch(Exception):
    def __init__(self, loc: Loc, message: str, hint: str | None = None):
        super().__init__(message)
        self.loc, self.message, self.hint = loc, message, hint


def _describe(v: V) -> str:
    if v.kind == "quantity":
        try:
            dim, _ = parse_quantity(v.value)
            return f"a {dim.value} '{v.value}'"
        except UnitError:
            return f"'{v.value}'"
    names = {
        "int": "an integer",
        "float": "a number",
        "symbol": "a reference",
        "name": "a name",
        "dotted": "a dotted name",
        "opid": "an operation id",
        "list": "a list",
        "range": "a range",
        "call": "a call",
    }
    shown = (v.text or v.value) if v.kind in ("int", "float", "symbol", "name", "dotted", "opid") else None
    return names[v.kind] + (f" '{shown}'" if shown is not None else "")


def _expect_int(v: V, what: str = "an integer") -> int:
    if v.kind != "int":
        raise TypeMismatch(v.loc, f"expected {what}, got {_describe(v)}", _whole_hint(v))
    return v.value


def _whole_hint(v: V) -> str | None:
    """``1e3`` where an integer is expected: the integer written out, when it is one."""
    if v.kind == "float" and v.value == int(v.value) and abs(v.value) < 1e30:
        return f"integers are written in full, without an exponent: {int(v.value)}"
    return None


def _as_quantity(want: Dim, v: V) -> str:
    """What to write for a plain number given where a quantity is expected (``peak_flops = 989e12``):
    the number read in the base unit (bytes, B/s, seconds, FLOP/s), with its unit."""
    general = f"write a {want.value} with its unit, e.g. {want.example}"
    value = v.value
    if v.kind not in ("int", "float") or value <= 0 or (want is Dim.SIZE and value != int(value)):
        return general
    text = format_quantity(want, int(value) if want is Dim.SIZE else value)
    if split_quantity(text)[1] == _BASE_UNIT[want]:
        return general  # `peak_flops = 989`: a count of the base unit is no likely reading
    return f"a {want.value} carries its unit: write {text} (if {v.text or v.value} is in {_BASE[want]})"


_BASE = {Dim.SIZE: "bytes", Dim.BANDWIDTH: "bytes/s", Dim.TIME: "seconds", Dim.FLOPS: "FLOP/s"}


_ITEMS = {
    "symbols": "references such as [@name]",
    "dotteds": "model-stages such as [actor.train]",
    "names": "names",
    "opids": "operation ids such as [%0]",
}


def expand_ints(v: V) -> list[int]:
    """``[0..3, 8]`` -> ``[0, 1, 2, 3, 8]``."""
    if v.kind != "list":
        raise TypeMismatch(v.loc, f"expected a list of integers such as [0..7], got {_describe(v)}")
    out: list[int] = []
    for item in v.value:
        if item.kind == "range":
            lo, hi = item.value
            if hi < lo:
                raise TypeMismatch(item.loc, f"empty range {lo}..{hi}", "ranges are inclusive and ascending: 0..7")
            out.extend(range(lo, hi + 1))
        else:
            out.append(_expect_int(item))
    return out


def is_probability(x: object) -> bool:
    """A number in [0, 1), not a bool: what a ``probability`` attribute holds (a dropout rate;
    also checked where a Hugging Face config is read, ``hf_config``)."""
    return isinstance(x, int | float) and not isinstance(x, bool) and 0 <= x < 1


def convert(spec: AttrSpec, v: V) -> Any:
    """Turn a syntactic value into the typed value ``spec`` asks for, or raise TypeMismatch."""
    k = spec.kind
    if k in _DIM_KINDS:
        want = _DIM_KINDS[k]
        if v.kind != "quantity":
            if v.kind in ("int", "float"):  # `peak_flops = 989e12`: a number is no quantity
                raise TypeMismatch(
                    v.loc, f"'{spec.key}' expects a {want.value}, got {_describe(v)}", _as_quantity(want, v)
                )
            hint: str | None = f"write a {want.value} with its unit, e.g. {want.example}"
            raise TypeMismatch(v.loc, f"'{spec.key}' expects a {want.value}, got {_describe(v)}", hint)
        try:
            dim, value = parse_quantity(v.value)
        except UnitError as e:
            raise TypeMismatch(v.loc, str(e), e.hint) from None
        if dim is not want:
            raise TypeMismatch(
                v.loc, f"'{spec.key}' expects a {want.value} (e.g. {want.example}), got a {dim.value} '{v.value}'"
            )
        if value < 0 and not spec.signed:
            raise TypeMismatch(v.loc, f"'{spec.key}' must not be negative, got '{v.value}'")
        return value
    if k in ("int", "posint", "natural"):
        value = _expect_int(v)
        if k == "posint" and value < 1:
            raise TypeMismatch(v.loc, f"'{spec.key}' must be at least 1, got {value}")
        return value
    if k == "float":
        if v.kind not in ("int", "float"):
            raise TypeMismatch(v.loc, f"'{spec.key}' expects a number, got {_describe(v)}")
        return float(v.value)
    if k == "probability":
        if v.kind not in ("int", "float"):
            raise TypeMismatch(v.loc, f"'{spec.key}' expects a probability, got {_describe(v)}")
        if not is_probability(v.value):
            raise TypeMismatch(v.loc, f"'{spec.key}' must be a probability below 1, got '{v.text or v.value}'")
        return float(v.value)
    if k == "bool":
        if v.kind != "name" or v.value not in ("true", "false"):
            raise TypeMismatch(v.loc, f"'{spec.key}' expects true or false, got {_describe(v)}")
        return v.value == "true"
    if k == "choice":
        if v.kind != "name" or v.value not in spec.choices:
            hint = (did_you_mean(str(v.value), spec.choices) if v.kind == "name" else None) or (
                "one of: " + ", ".join(spec.choices)
            )
            raise TypeMismatch(
                v.loc, f"'{spec.key}' expects one of {', '.join(spec.choices)}, got {_describe(v)}", hint
            )
        return v.value
    if k == "symbol":
        if v.kind != "symbol":
            hint = f"references start with '@': @{v.value}" if v.kind == "name" else None
            raise TypeMismatch(v.loc, f"'{spec.key}' expects a reference such as @name, got {_describe(v)}", hint)
        return v.value[1:]
    if k == "dotted":
        if v.kind != "dotted":
            raise TypeMismatch(v.loc, f"'{spec.key}' expects a model-stage such as actor.train, got {_describe(v)}")
        return v.value
    if k == "ints":
        return expand_ints(v)
    if k == "ranges":
        if v.kind != "list":
            raise TypeMismatch(
                v.loc, f"'{spec.key}' expects a list of ranges such as [0..15, 16..31], got {_describe(v)}"
            )
        out = []
        for item in v.value:
            if item.kind == "range":
                out.append(tuple(item.value))
            elif item.kind == "int":
                out.append((item.value, item.value))
            else:
                raise TypeMismatch(item.loc, f"expected a range such as 0..15, got {_describe(item)}")
        return out
    if k in ("symbols", "dotteds", "names", "opids"):
        item_kind = {"symbols": "symbol", "dotteds": "dotted", "names": "name", "opids": "opid"}[k]
        if v.kind != "list":
            if k == "symbols" and v.kind == "name":  # `roles = actor`
                raise TypeMismatch(
                    v.loc, f"'{spec.key}' expects a list of references, got {_describe(v)}", f"write [@{v.value}]"
                )
            raise TypeMismatch(
                v.loc,
                f"'{spec.key}' expects a list, got {_describe(v)}",
                f"write [{v.value}]" if v.kind == item_kind else None,
            )
        out = []
        for item in v.value:
            if item.kind != item_kind:
                hint = None
                if k == "symbols" and item.kind == "name":  # `roles = [actor, ref]`: the fix, in the user's names
                    fixed = [
                        "@" + i.value if i.kind == "name" else i.value for i in v.value if i.kind in ("name", "symbol")
                    ]
                    hint = (
                        f"references start with '@': write [{', '.join(fixed)}]"
                        if len(fixed) == len(v.value)
                        else f"references start with '@': write @{item.value}"
                    )
                raise TypeMismatch(item.loc, f"'{spec.key}' expects a list of {_ITEMS[k]}, got {_describe(item)}", hint)
            if k == "names" and spec.choices and item.value not in spec.choices:
                raise TypeMismatch(
                    item.loc,
                    f"'{item.value}' is not one of {', '.join(spec.choices)}",
                    did_you_mean(item.value, spec.choices),
                )
            out.append(item.value[1:] if k == "symbols" else item.value)
        return out
    if k == "dotted_groups":
        if v.kind != "list":
            raise TypeMismatch(
                v.loc, f"'{spec.key}' expects a list of groups such as [[a.infer, b.infer]], got {_describe(v)}"
            )
        return [convert(AttrSpec(spec.key, "dotteds"), g) for g in v.value]
    if k == "record":
        rec = spec.record
        assert rec is not None  # kind "record" is made only by record(), which sets it
        if v.kind != "call" or v.value[0] != rec.name:
            raise TypeMismatch(v.loc, f"'{spec.key}' expects {rec.example()}, got {_describe(v)}")
        fields = {f.key: f for f in rec.fields}
        got: dict[str, Any] = {}
        for key, val, loc in v.value[1]:
            if key not in fields:
                raise TypeMismatch(
                    loc, f"{rec.name} has no field '{key}'", did_you_mean(key, fields) or "fields: " + ", ".join(fields)
                )
            if key in got:
                raise TypeMismatch(loc, f"duplicate field '{key}' in {rec.name}")
            got[key] = convert(fields[key], val)
        missing = [f.key for f in rec.fields if f.required and f.key not in got]
        if missing:
            raise TypeMismatch(v.loc, f"{rec.name} is missing {', '.join(missing)}")
        return rec.cls(**got)
    raise AssertionError(f"unknown attribute kind {k}")  # pragma: no cover


def build_attrs(
    kind: str, specs: list[AttrSpec], attrs: list[tuple[str, V, Loc]], block_loc: Loc, sink: DiagnosticSink
) -> tuple[dict[str, Any], dict[str, Loc]]:
    """Check ``attrs`` against ``specs``; returns typed values (defaults filled) and key locations.

    Every problem is reported to ``sink``; a key with a bad value is left out of the result,
    and the caller must not build the node when ``sink`` gained errors.
    """
    by_key = {s.key: s for s in specs}
    values: dict[str, Any] = {}
    locs: dict[str, Loc] = {}
    for key, v, loc in attrs:
        spec = by_key.get(key)
        if spec is None:
            sink.error(
                loc,
                f"unknown attribute '{key}' in {kind}",
                did_you_mean(key, by_key) or "known attributes: " + ", ".join(by_key),
            )
            continue
        if key in locs:
            sink.error(loc, f"duplicate attribute '{key}' in {kind}", f"first set at line {locs[key].line}")
            continue
        locs[key] = loc
        try:
            values[key] = convert(spec, v)
        except TypeMismatch as e:
            sink.error(e.loc, e.message, e.hint)
    for spec in specs:
        if spec.key not in locs:
            if spec.required:
                sink.error(
                    block_loc,
                    f"{kind} is missing required attribute '{spec.key}'",
                    f"add: {spec.key} = ..." + (f" ({spec.doc})" if spec.doc else ""),
                )
            else:
                values[spec.key] = spec.default
    return values, locs


# ---------------------------------------------------------------- printing


def compress_ints(xs: list[int]) -> str:
    """``[0, 1, 2, 3, 8]`` -> ``"0..3, 8"``: runs of three or more become ranges."""
    parts: list[str] = []
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{xs[i]}..{xs[j]}")
        else:
            parts.extend(str(x) for x in xs[i : j + 1])
        i = j + 1
    return ", ".join(parts)


def format_value(spec: AttrSpec, value: Any) -> str:
    k = spec.kind
    if k in _DIM_KINDS:
        return format_quantity(_DIM_KINDS[k], value)
    if k in ("int", "posint", "natural", "float", "probability", "bool"):
        return format_number(value)
    if k in ("choice", "dotted"):
        return value
    if k == "symbol":
        return "@" + value
    if k == "ints":
        return "[" + compress_ints(value) + "]"
    if k == "ranges":
        return "[" + ", ".join(f"{lo}..{hi}" for lo, hi in value) + "]"
    if k == "symbols":
        return "[" + ", ".join("@" + s for s in value) + "]"
    if k in ("dotteds", "names", "opids"):
        return "[" + ", ".join(value) + "]"
    if k == "dotted_groups":
        return "[" + ", ".join("[" + ", ".join(g) + "]" for g in value) + "]"
    if k == "record":
        rec = spec.record
        assert rec is not None  # kind "record" is made only by record(), which sets it
        fields = [
            f"{f.key} = {format_value(f, getattr(value, f.key))}"
            for f in rec.fields
            if f.required or getattr(value, f.key) != f.default
        ]
        return f"{rec.name}(" + ", ".join(fields) + ")"
    raise AssertionError(k)  # pragma: no cover


def format_attrs(specs: list[AttrSpec], node: Any) -> list[str]:
    """``key = value`` lines in schema order; optional attributes at their default are omitted."""
    out = []
    for spec in specs:
        value = getattr(node, spec.key)
        if not spec.required and (value is None or value == spec.default):
            continue
        out.append(f"{spec.key} = {format_value(spec, value)}")
    return out


# ---------------------------------------------------------------- documentation

_KIND_TEXT = {
    "posint": "integer >= 1",
    "int": "integer",
    "natural": "integer >= 0",
    "float": "number",
    "probability": "number, 0 <= p < 1",
    "bool": "true \\| false",
    "size": "size (80GiB)",
    "bandwidth": "bandwidth (450GB/s, 400Gb/s)",
    "time": "time (2us)",
    "flops": "FLOP rate (989TFLOPs)",
    "symbol": "@reference",
    "dotted": "model-stage",
    "ints": "integer list ([0..7, 9])",
    "ranges": "range list ([0..15, 16..31])",
    "symbols": "list of @references",
    "dotteds": "list of model-stages",
    "names": "list of names",
    "opids": "list of %ids",
    "dotted_groups": "list of lists of model-stages",
}


def describe(title: str, specs: list[AttrSpec]) -> str:
    """A markdown table of a block's attributes: the language reference in docs/IR.md."""
    rows = [f"### {title}", "", "| attribute | type | default | meaning |", "| --- | --- | --- | --- |"]
    for s in specs:
        if s.kind == "choice":
            kind = "one of " + " \\| ".join(s.choices)
        elif s.kind == "record":
            assert s.record is not None  # kind "record" is made only by record(), which sets it
            kind = f"{s.record.name}(" + ", ".join(f.key + ("" if f.required else "?") for f in s.record.fields) + ")"
        else:
            kind = _KIND_TEXT[s.kind]
        default = (
            "required"
            if s.required
            else ("none" if s.default is None else format_value(s, s.default) if s.default != [] else "[]")
        )
        rows.append(f"| `{s.key}` | {kind} | {default} | {s.doc} |")
    return "\n".join(rows) + "\n"
