"""IR -> canonical text.

Canonical means: declarations grouped by kind (clusters, models, workloads, plans, EMUs,
transitions) in source order within a kind; attributes in schema order; optional attributes at
their default omitted; quantities in the largest unit that prints exactly; integer lists with
runs written as ranges; two-space indentation. Replicas of a model-stage whose shards hold the
same slices print as one ``emu`` block with one GPU per replica. ``//`` comments stay with the
declaration, attribute or item they preceded.

``print_ir(parse(print_ir(m))) == print_ir(m)`` and ``parse(print_ir(m)) == m``.
"""

from __future__ import annotations

from .attributes import compress_ints, format_attrs, format_value
from .cluster import CLUSTER_ATTRS
from .emu import SHARD_ATTRS, Emu, SliceEntry
from .model import MODEL_ATTRS
from .module import Module
from .plan import LAYOUT_ATTRS, PLAN_ATTRS

ANALYSIS_DIGITS = 5
"""Significant digits of the analysis results passes record (times, costs): a model's estimate
carries no more, and the printed IR stays readable."""


def printed_precision(x: float, digits: int = ANALYSIS_DIGITS) -> float:
    """``x`` at the precision the IR records analysis results in (``digits`` significant
    digits); passes store this value, so that printing and parsing it back is exact. Non-finite
    values pass through."""
    return float(f"{x:.{digits}g}") if x == x and abs(x) != float("inf") else x


# below ``printed_precision``, which the node modules import from here
from .transition import OP_ATTRS, TRANSITION_ATTRS, Op  # noqa: E402
from .workload import STAGE_ATTRS, WORKLOAD_ATTRS  # noqa: E402

IND = "  "


class _Out:
    def __init__(self):
        self.lines: list[str] = []

    def comments(self, node, key, depth) -> str:
        """Emit the leading comments of ``node``'s ``key``; return its trailing ones as a suffix."""
        trailing = ""
        for text, is_trailing in node.comments.get(key, ()):
            if is_trailing:
                trailing += "  " + text
            else:
                self.lines.append(IND * depth + text)
        return trailing

    def line(self, node, key, depth, text):
        suffix = self.comments(node, key, depth)
        self.lines.append(IND * depth + text + suffix)

    def attrs(self, specs, node, depth):
        for spec, line in zip(_printed_specs(specs, node), format_attrs(specs, node)):
            self.line(node, spec.key, depth, line)


def _printed_specs(specs, node):
    return [s for s in specs if s.required or (getattr(node, s.key) is not None and getattr(node, s.key) != s.default)]


def _block(out: _Out, header: str, node, specs, depth=0, body=None):
    out.line(node, None, depth, header + " {")
    out.attrs(specs, node, depth + 1)
    if body:
        body()
    out.lines.append(IND * depth + "}")


def format_box(box) -> str:
    return "[" + ", ".join(f"{lo}:{hi}" for lo, hi in box) + "]"


def format_entry(e: SliceEntry | Op) -> str:
    state = "" if e.state == "weight" else e.state + " "
    return f"{state}{e.tensor} {format_box(e.box)}"


def _same_slices(a: Emu, b: Emu) -> bool:
    if len(a.shards) != len(b.shards) or b.comments or any(s.comments for s in b.shards):
        return False
    return all(
        x.pp == y.pp and x.tp == y.tp and x.entries == y.entries and x.kv_cache == y.kv_cache
        for x, y in zip(a.shards, b.shards)
    )


def _emu_groups(m: Module, group: bool = True) -> list[list[Emu]]:
    groups: list[list[Emu]] = []
    for key in sorted(m.emus):
        emu = m.emus[key]
        g = groups[-1] if groups else None
        if group and g and g[0].plan == emu.plan and g[0].model_stage == emu.model_stage and _same_slices(g[0], emu):
            g.append(emu)
        else:
            groups.append([emu])
    return groups


def _print_emu_group(out: _Out, group: list[Emu]) -> None:
    first = group[0]
    replicas = compress_ints([e.replica for e in group])
    out.line(first, None, 0, f"emu @{first.plan} {first.model_stage}[{replicas}] {{")
    for i, shard in enumerate(first.shards):
        gpus = compress_ints([e.shards[i].gpu for e in group])
        out.line(shard, None, 1, f"shard [{shard.pp}, {shard.tp}] gpus [{gpus}] {{")
        out.lines.extend(f"{IND * 2}{line}" for line in format_attrs(SHARD_ATTRS, shard))
        out.lines.extend(f"{IND * 2}{format_entry(e)}" for e in shard.entries)
        out.lines.append(IND + "}")
    out.lines.append("}")


def format_op(op: Op) -> str:
    parts = [f"{op.id} = {op.kind} {format_entry(op)}"]
    if op.src:
        parts.append("from [" + ", ".join(map(str, op.src)) + "]")
    if op.dst:
        parts.append("to [" + ", ".join(map(str, op.dst)) + "]")
    parts.append("{ " + ", ".join(format_attrs(OP_ATTRS, op)) + " }")
    return " ".join(parts)


def print_ir(m: Module, group_replicas: bool = True) -> str:
    """The canonical text of a module (ends with a newline).

    ``group_replicas=False`` prints one ``emu`` block per replica (same module, longer text).
    """
    out = _Out()
    sections: list[list[str]] = []

    def section(fn):
        out.lines = []
        fn()
        sections.append(out.lines)

    for c in m.clusters.values():
        section(lambda c=c: _block(out, f"cluster @{c.name}", c, CLUSTER_ATTRS))
    for md in m.models.values():
        section(lambda md=md: _block(out, f"model @{md.name}", md, MODEL_ATTRS))
    for w in m.workloads.values():

        def stages(w=w):
            for st in w.stages:
                if any(k is not None for k in st.comments):
                    _block(out, f"stage {st.name}", st, STAGE_ATTRS, depth=1)
                else:
                    body = ", ".join(f"{s.key} = {format_value(s, getattr(st, s.key))}" for s in STAGE_ATTRS)
                    out.line(st, None, 1, f"stage {st.name} {{ {body} }}")

        section(lambda w=w: _block(out, f"workload @{w.name}", w, WORKLOAD_ATTRS, body=stages))
    for p in m.plans.values():

        def layouts(p=p):
            order = {}
            w = m.workloads.get(p.workload)
            if w is not None:
                order = {ms: i for i, ms in enumerate(w.model_stages())}
            for lay in sorted(p.layouts.values(), key=lambda x: order.get(x.model_stage, len(order))):
                _block(out, f"layout {lay.model_stage}", lay, LAYOUT_ATTRS, depth=1)

        section(lambda p=p: _block(out, f"plan @{p.name}", p, PLAN_ATTRS, body=layouts))
    for group in _emu_groups(m, group_replicas):
        section(lambda g=group: _print_emu_group(out, g))
    for t in m.transitions.values():

        def ops(t=t):
            for op in t.ops:
                suffix = "".join(
                    out.comments(op, key, 1) for key in sorted(op.comments, key=lambda k: (k is not None, k or ""))
                )
                out.lines.append(IND + format_op(op) + suffix)

        section(lambda t=t: _block(out, f"transition @{t.name}", t, TRANSITION_ATTRS, body=ops))
    text = "\n\n".join("\n".join(s) for s in sections)
    if m.trailing_comments:
        text += ("\n\n" if text else "") + "\n".join(m.trailing_comments)
    return text + "\n" if text else ""
