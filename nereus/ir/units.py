"""Quantities with units: sizes, bandwidths, times and FLOP rates.

Every quantity is stored in its base unit (bytes, bytes/s, seconds, FLOP/s) so that two
modules that mean the same thing compare equal whatever units their authors wrote. Parsing
multiplies exactly (``Decimal``) and rounds once; the printer picks the largest unit that
prints short and parses back to the identical value, so ``parse(print(x)) == x`` always.
A quantity's number may carry a decimal exponent before its unit (``3.35e3GB/s``, ``5e-6s``): no
unit starts with ``e`` and a digit, so the two cannot be confused; the printer never writes one
(``3.35e3GB/s`` prints as ``3.35TB/s``). Other numbers are plain decimals.
"""

from __future__ import annotations

import re
from decimal import Decimal, localcontext
from enum import Enum


class Dim(Enum):
    """Physical dimension of a quantity; names are what diagnostics show."""

    SIZE = "size"
    BANDWIDTH = "bandwidth"
    TIME = "time"
    FLOPS = "FLOP rate"

    @property
    def example(self) -> str:
        return {Dim.SIZE: "80GiB", Dim.BANDWIDTH: "450GB/s", Dim.TIME: "2us", Dim.FLOPS: "989TFLOPs"}[self]


_SI = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15}
_BIN = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}

# unit text -> (dimension, factor to base unit). Factor is int or Decimal.
UNITS: dict[str, tuple[Dim, Decimal]] = {}
for _p, _f in _SI.items():
    UNITS[f"{_p}B"] = (Dim.SIZE, Decimal(_f))
    UNITS[f"{_p}B/s"] = (Dim.BANDWIDTH, Decimal(_f))
    UNITS[f"{_p}b/s"] = (Dim.BANDWIDTH, Decimal(_f) / 8)  # network links are quoted in bits
    UNITS[f"{_p}FLOPs"] = (Dim.FLOPS, Decimal(_f))
    UNITS[f"{_p}FLOP/s"] = (Dim.FLOPS, Decimal(_f))
for _p, _f in _BIN.items():
    UNITS[f"{_p}B"] = (Dim.SIZE, Decimal(_f))
    UNITS[f"{_p}B/s"] = (Dim.BANDWIDTH, Decimal(_f))
UNITS.update(
    {
        "ns": (Dim.TIME, Decimal("1e-9")),
        "us": (Dim.TIME, Decimal("1e-6")),
        "ms": (Dim.TIME, Decimal("1e-3")),
        "s": (Dim.TIME, Decimal(1)),
        "min": (Dim.TIME, Decimal(60)),
        "h": (Dim.TIME, Decimal(3600)),
    }
)

# Units the printer may choose, largest first, per dimension.
_PRINT_UNITS: dict[Dim, list[str]] = {
    Dim.SIZE: ["PiB", "PB", "TiB", "TB", "GiB", "GB", "MiB", "MB", "KiB", "KB", "B"],
    Dim.BANDWIDTH: ["TB/s", "GB/s", "MB/s", "KB/s", "B/s"],
    Dim.TIME: ["s", "ms", "us", "ns"],
    Dim.FLOPS: ["PFLOPs", "TFLOPs", "GFLOPs", "MFLOPs", "KFLOPs", "FLOPs"],
}


BASE_UNIT = {Dim.SIZE: "B", Dim.BANDWIDTH: "B/s", Dim.TIME: "s", Dim.FLOPS: "FLOPs"}
_BASE_UNIT = BASE_UNIT


class UnitError(ValueError):
    """A quantity whose unit is unknown or whose value cannot be represented."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint


# digits may be grouped with single underscores (4_096GiB), as the grammar's numbers are
_NUMBER = re.compile(r"-?(?:[0-9]+(?:_[0-9]+)*(?:\.(?:[0-9]+(?:_[0-9]+)*)?)?|\.[0-9]+(?:_[0-9]+)*)(?:[eE][+-]?[0-9]+)?")
MAX_EXPONENT = 30  # 1e30 bytes, 1e-30 s: beyond any real quantity, and bounded work for Decimal


def split_quantity(text: str) -> tuple[str, str]:
    """``"80GiB"`` -> ``("80", "GiB")``, ``"3.35e3GB/s"`` -> ``("3.35e3", "GB/s")``; a leading ``-``
    stays with the number."""
    m = _NUMBER.match(text)
    i = m.end() if m else 0
    return text[:i], text[i:]


def suggest_unit(unit: str) -> str | None:
    lower = {u.lower(): u for u in UNITS}
    if unit.lower() in lower:
        return lower[unit.lower()]
    if unit.lower() + "/s" in lower:
        return lower[unit.lower() + "/s"]
    return None


def parse_quantity(text: str) -> tuple[Dim, int | float]:
    """Parse ``"80GiB"`` into ``(Dim.SIZE, 85899345920)``; sizes are whole bytes (int)."""
    number, unit = split_quantity(text)
    if not number:
        raise UnitError(f"'{text}' has no number before its unit", "write the number first, e.g. 80GiB")
    if unit not in UNITS:
        guess = suggest_unit(unit)
        hint = (
            f"did you mean '{number}{guess}'?"
            if guess
            else "known units: "
            + ", ".join(["B", "KiB", "MiB", "GiB", "GB", "GB/s", "Gb/s", "TFLOPs", "ns", "us", "ms", "s"])
        )
        raise UnitError(f"unknown unit '{unit}' in '{text}'", hint)
    dim, factor = UNITS[unit]
    _, e, exponent = number.lower().partition("e")
    if e and abs(int(exponent)) > MAX_EXPONENT:
        raise UnitError(
            f"exponent {int(exponent)} in '{text}' is out of range",
            f"exponents go from -{MAX_EXPONENT} to {MAX_EXPONENT}; pick a larger or smaller unit",
        )
    with localcontext() as ctx:
        ctx.prec = 400
        exact = Decimal(number) * factor
    if dim is Dim.SIZE:
        if exact != exact.to_integral_value():
            raise UnitError(f"'{text}' is not a whole number of bytes")
        return dim, int(exact)
    return dim, float(exact)


def _plain(d: Decimal) -> str:
    s = format(d.normalize(), "f")
    return s


SHORT_MAX = 2**20
"""A quantity prints with at most 4 fractional digits in a unit where it is under this many
units (``41838MiB``, ``1.5GiB``); one that has no such text prints in the largest unit it is at
least 1 of, with the digits it needs (``93.395022336GB``, not ``91206076.5KiB``)."""


def format_quantity(dim: Dim, value: int | float) -> str:
    """Canonical text of a quantity, parsing back to exactly ``value``: the largest unit whose
    short decimal (at most 4 fractional digits, under ``SHORT_MAX`` units) is exact, else the
    largest unit of its family the value is at least 1 of (binary or decimal: the one that needs
    fewer digits), with as many digits as exactness needs (a whole number of bytes is exact in GB
    with at most 9)."""
    if value == 0:
        return "0" + _PRINT_UNITS[dim][-1 if dim is not Dim.TIME else 0]
    with localcontext() as ctx:
        ctx.prec = 400  # enough for any float's exact decimal expansion, and any int we print
        exact = Decimal(value) if dim is Dim.SIZE else Decimal(repr(float(value)))
        units = [(u, exact / UNITS[u][1]) for u in _PRINT_UNITS[dim]]
        units = [(u, mag) for u, mag in units if abs(mag) >= 1]
        for unit, mag in units:
            if abs(mag) < SHORT_MAX:
                text = _round_trip(mag, unit, value, range(0, 5))
                if text is not None:
                    return text
        # no short text: the largest unit of each family (GiB and GB) that the value is at least 1
        # of, in whichever needs fewer digits (a whole number of bytes: GB, with at most 9)
        top = [(u, mag) for u, mag in units if abs(mag) < 1024] or units[:1]
        texts = [t for t in (_round_trip(mag, u, value, range(5, 31)) for u, mag in top) if t is not None]
        if texts:
            return min(texts, key=lambda t: len(split_quantity(t)[0].partition(".")[2]))
        # The base unit (factor 1) with the exact decimal of the value always round-trips.
        return _plain(exact) + _BASE_UNIT[dim]


def _round_trip(mag: Decimal, unit: str, value: int | float, digits: range) -> str | None:
    """The shortest decimal of ``mag`` with ``digits`` fractional digits whose text parses back to ``value``."""
    for d in digits:
        text = _plain(round(mag, d)) + unit
        try:
            if parse_quantity(text)[1] == value:
                return text
        except UnitError:
            pass
    return None


def parse_size(text: str) -> int:
    """A size as options write it: ``64MiB`` or a plain number of bytes; UnitError otherwise
    (the CLI's size flags and the pass manager's ``Size`` options)."""
    text = text.strip()
    if text.isdigit():
        return int(text)
    dim, value = parse_quantity(text)
    if dim is not Dim.SIZE or value != int(value):
        raise UnitError(f"'{text}' is not a size (64MiB, 1GiB or bytes)")
    return int(value)


def format_bytes(n: float, sep: str = " ") -> str:
    """Bytes for people (tables, messages, summaries): the largest binary unit that keeps at
    least 1, with 2 decimals (``73.41 GiB``, ``625.25 KiB``), whole bytes below 1 KiB (``512 B``).
    ``sep``: between the number and the unit (the lowered program's dump writes none). The IR
    itself prints sizes with ``format_quantity``, exactly."""
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= k:
            return f"{n / k:.2f}{sep}{unit}"
    return f"{int(n)}{sep}B"


def format_number(value: int | float) -> str:
    """Plain decimals, never exponent notation; ints stay ints."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    text = _plain(Decimal(repr(value)))
    if "." not in text:
        text += ".0"
    return text
