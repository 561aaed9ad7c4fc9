"""Warnings for hardware figures whose unit is most likely a slip: ``gpu_memory = 80MiB`` (meant
80GiB), ``hbm_bandwidth = 3.35Tb/s`` (bits; HBM is quoted in bytes: 3.35TB/s), ``latency = 2ms``
(meant 2us).

Valid IR either way, so these are warnings that ``nereus check`` prints, never errors of
``verify``: a figure far outside what any accelerator (or the CPU a test runs on) has is
flagged, with the figure the same number would be in the unit such figures are quoted in.
Where the module was parsed from text, the unit the author wrote is read back from the source
(bits or bytes cannot be told apart from the value alone).
"""

from __future__ import annotations

import re

from .attributes import Link
from .diagnostics import Diagnostic
from .module import Module
from .units import UNITS, Dim, UnitError, format_quantity, parse_quantity, split_quantity

GiB, TiB = 2**30, 2**40

# key -> (dimension, low, high, the unit such figures are quoted in, what the figure is)
_RANGES: dict[str, tuple[Dim, float, float, str, str]] = {
    "gpu_memory": (Dim.SIZE, GiB, TiB, "GiB", "the memory of one GPU"),
    "host_memory": (Dim.SIZE, GiB, 64 * TiB, "GiB", "the host memory of one node"),
    "hbm_bandwidth": (Dim.BANDWIDTH, 1e9, 100e12, "TB/s", "the HBM bandwidth of one GPU"),
    "peak_flops": (Dim.FLOPS, 1e9, 100e15, "TFLOPs", "the peak of one GPU"),
    "peak_flops_fp8": (Dim.FLOPS, 1e9, 100e15, "TFLOPs", "the FP8 peak of one GPU"),
    "latency": (Dim.TIME, 1e-9, 1e-3, "us", "a link's latency"),
    "bandwidth": (Dim.BANDWIDTH, 1e6, 100e12, "GB/s", "a link's per-GPU bandwidth"),
}


def unit_warnings(m: Module) -> list[Diagnostic]:
    """Hardware figures of every cluster that are far outside any real GPU's (or CPU's), at the
    attribute's line; call it on a verified module."""
    lines = m.source.split("\n") if m.source else None
    out = []
    for c in m.clusters.values():
        for key in ("gpu_memory", "host_memory", "hbm_bandwidth", "peak_flops", "peak_flops_fp8"):
            value = getattr(c, key)
            if value is not None:
                loc = c.locs.get(key, c.loc)
                written = _written(lines, loc.line, loc.col, key)
                out.extend(_check(key, key, value, written, loc))
        for key in ("intra_node", "inter_node", "host_link"):
            link: Link | None = getattr(c, key)
            if link is None:
                continue
            loc = c.locs.get(key, c.loc)
            for field in ("bandwidth", "latency"):
                written = _written(lines, loc.line, loc.col, field)
                out.extend(_check(f"{key} {field}", field, getattr(link, field), written, loc))
    return out


def _check(label: str, key: str, value: float, written: str | None, loc) -> list[Diagnostic]:
    dim, lo, hi, unit, what = _RANGES[key]
    shown = written or format_quantity(dim, value)
    if key == "hbm_bandwidth" and written and split_quantity(written)[1].endswith("b/s"):
        # HBM is quoted in bytes per second; a figure in bits is 8 times too small
        return [
            Diagnostic(
                loc,
                f"{label} = {shown} is in bits per second ({format_quantity(dim, value)}); HBM bandwidth is "
                "quoted in bytes per second",
                f"did you mean {_in(written, unit)}?",
                severity="warning",
            )
        ]
    if lo <= value <= hi:
        return []
    side = f"under {_figure(dim, lo)}" if value < lo else f"over {_figure(dim, hi)}"
    guess = _in(written, unit) if written else None
    plausible = False
    if guess is not None:
        try:
            plausible = lo <= parse_quantity(guess)[1] <= hi
        except UnitError:
            pass
    hint = f"did you mean {guess}?" if plausible else f"{what} is quoted in {unit}, e.g. {_example(key)}"
    return [Diagnostic(loc, f"{label} = {shown} is {side}, implausible for {what}", hint, severity="warning")]


def _in(written: str, unit: str) -> str:
    """The number the author wrote, in ``unit``: ``80MiB`` -> ``80GiB``."""
    number, _ = split_quantity(written)
    return f"{number}{unit}"


def _figure(dim: Dim, value: float) -> str:
    return format_quantity(dim, int(value) if dim is Dim.SIZE else value)


def _example(key: str) -> str:
    return {
        "gpu_memory": "80GiB",
        "host_memory": "2048GiB",
        "hbm_bandwidth": "3.35TB/s",
        "peak_flops": "989TFLOPs",
        "peak_flops_fp8": "1979TFLOPs",
        "latency": "2us",
        "bandwidth": "450GB/s",
    }[key]


_QUANTITY = re.compile(r"-?[0-9][0-9_.eE+-]*[A-Za-z]+(?:/s)?")


def _written(lines: list[str] | None, line: int, col: int, key: str) -> str | None:
    """The quantity written after ``key =`` on ``line`` from column ``col`` (1-based), if it is one."""
    if lines is None or not 1 <= line <= len(lines):
        return None
    text = lines[line - 1]
    found = re.compile(rf"\b{re.escape(key)}\s*=\s*").search(text, max(0, col - 1))
    if found is None:
        return None
    q = _QUANTITY.match(text, found.end())
    if q is None or split_quantity(q.group(0))[1] not in UNITS:
        return None
    return q.group(0)
