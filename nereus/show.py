"""``nereus show``: a rich summary of a module: GPUs, model-stages, layouts, memory, EMUs."""

from __future__ import annotations

import sys
from collections import defaultdict
from dataclasses import dataclass, field

from rich.console import Console
from rich.table import Table

from .ir import Module
from .ir.attributes import compress_ints
from .ir.diagnostics import plural
from .ir.model import state_dtype_bytes
from .ir.units import Dim, format_bytes, format_quantity


def _size(n: int | None) -> str:
    return "" if n is None else format_bytes(n)


def _count(n: float) -> str:
    """A parameter count in the unit that fits (K, M, B)."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f}"


@dataclass
class Today:
    """A module as it stands now: every plan estimated again against its cluster and workload
    (on a copy: the file is not changed), with what that found."""

    module: Module
    problems: dict[str, list[str]] = field(default_factory=dict)  # plan -> what does not fit
    stale: dict[str, list[str]] = field(default_factory=dict)  # plan -> stored figures that differ from today's
    unestimated: set[str] = field(default_factory=set)  # plans the file had no estimates for


def today(m: Module) -> Today:
    """Estimate every plan of ``m`` again. A stored estimate was made for the job as it was when
    it was written (responses since grown, a cluster edited): displayed as it is, it once showed a
    plan at 246 s and 60 GiB that needed 130.95 GiB. Today's figures replace it, and what
    differs is listed as stale."""
    import copy

    from .passes.cost.estimate import estimate_plan

    now = copy.deepcopy(m)
    out = Today(now)
    for p in now.plans.values():
        old = m.plans[p.name]
        if old.step_time is None and all(lay.time is None for lay in old.layouts.values()):
            out.unestimated.add(p.name)
        try:
            out.problems[p.name] = [d.message for d in estimate_plan(now, p)]
        except (KeyError, ValueError) as e:  # a plan the verifier let through but the cost model cannot cost
            out.problems[p.name] = [f"estimate failed: {e}"]
            continue
        if p.name in out.unestimated:
            continue
        changed = []
        if not _close(old.step_time, p.step_time):
            changed.append(f"step time {_time(old.step_time)} in the file, {_time(p.step_time)} today")
        for ms, lay in p.layouts.items():
            was = old.layouts[ms]
            if not _close(was.memory, lay.memory, 2**21):
                changed.append(f"{ms} memory {_size(was.memory) or 'none'} in the file, {_size(lay.memory)} today")
            elif not _close(was.time, lay.time):
                changed.append(f"{ms} time {_time(was.time)} in the file, {_time(lay.time)} today")
        if changed:
            out.stale[p.name] = changed
    return out


def _close(a: float | None, b: float | None, tol: float = 0.0) -> bool:
    if a is None or b is None:
        return a is b
    return abs(a - b) <= max(tol, 1e-4 * abs(b))


def _time(x: float | None) -> str:
    return format_quantity(Dim.TIME, x) if x is not None else "none"


def memory_flag(m: Module, p, lay) -> str:
    """'over GPU memory' or 'over the headroom it was searched with', or ''."""
    if lay.memory is None:
        return ""
    cap = m.clusters[p.cluster].gpu_memory
    if lay.memory > cap:
        return "over GPU memory"
    if p.search and p.search.headroom and lay.memory > cap * (1 - p.search.headroom):
        return f"over the {p.search.headroom:.0%} headroom searched with"
    return ""


def _flagged(m: Module, p, lay) -> str:
    flag = memory_flag(m, p, lay)
    return _size(lay.memory) + (f" [red]({flag})[/red]" if flag else "")


def breakdown_table(p, console: Console) -> None:
    """Plan ``p``'s time and memory per model-stage, by component (docs/IR.md, Breakdowns):
    only the components some model-stage has."""
    from .ir.plan import MemoryBreakdown, TimeBreakdown

    lays = [lay for lay in p.layouts.values() if lay.time_breakdown is not None]
    if not lays:
        return
    times = [f for f in TimeBreakdown.__dataclass_fields__ if any(getattr(x.time_breakdown, f) for x in lays)]
    mems = [
        f
        for f in MemoryBreakdown.__dataclass_fields__
        if any(x.memory_breakdown and getattr(x.memory_breakdown, f) for x in lays)
    ]
    for what, fields, fmt, get in (
        ("time", times, lambda x: format_quantity(Dim.TIME, x), lambda x: x.time_breakdown),
        ("memory per GPU", mems, _size, lambda x: x.memory_breakdown),
    ):
        t = Table(title=f"plan @{p.name}: {what} by component (docs/IR.md, Breakdowns)", title_justify="left")
        t.add_column("model-stage")
        for f in fields:
            t.add_column(f, justify="right")
        for lay in lays:
            parts = get(lay)
            t.add_row(lay.model_stage, *(fmt(getattr(parts, f)) if parts and getattr(parts, f) else "" for f in fields))
        console.print(t)


def show(m: Module, title: str, console: Console | None = None, breakdown: bool = False) -> None:
    """Print the module's tables. Plans without estimates are estimated here (the file is not
    changed) and say so; ``nereus opt FILE -p estimate`` writes them into the IR."""
    # Plans are wide; without a terminal rich would wrap at 80 columns.
    console = console or Console(width=None if sys.stdout.isatty() else 160)
    now = today(m)
    m = now.module
    for c in m.clusters.values():
        t = Table(title=f"{title}: cluster @{c.name}", title_justify="left")
        for col in ("GPUs", "available", "nodes x GPUs", "GPU memory", "peak", "HBM", "NVLink", "NIC"):
            t.add_column(col, justify="right")
        t.add_row(
            str(c.num_gpus),
            str(len(c.available_gpus())),
            f"{c.nodes} x {c.gpus_per_node}",
            format_quantity(Dim.SIZE, c.gpu_memory),
            format_quantity(Dim.FLOPS, c.peak_flops),
            format_quantity(Dim.BANDWIDTH, c.hbm_bandwidth),
            format_quantity(Dim.BANDWIDTH, c.intra_node.bandwidth),
            format_quantity(Dim.BANDWIDTH, c.inter_node.bandwidth),
        )
        console.print(t)
    if m.models:
        t = Table(title="models", title_justify="left")
        for col in ("model", "params", "layers", "hidden", "heads/kv", "dtype", "head", "trained"):
            t.add_column(col, justify="right")
        for md in m.models.values():
            t.add_row(
                "@" + md.name,
                _count(md.num_params()),
                str(md.layers),
                str(md.hidden),
                f"{md.heads}/{md.kv_heads}",
                md.dtype,
                md.head,
                "yes" if md.trained else "no",
            )
        console.print(t)
    held = _emu_bytes(m)
    for p in m.plans.values():
        w = m.workloads.get(p.workload)
        order = {ms: i for i, ms in enumerate(w.model_stages())} if w else {}
        t = Table(title=f"plan @{p.name} (workload @{p.workload} on @{p.cluster})", title_justify="left")
        for col in (
            "model-stage",
            "TP",
            "PP",
            "DP",
            "EP",
            "GPUs",
            "micro",
            "ZeRO",
            "offload",
            "time",
            "memory/GPU",
            "EMU bytes/GPU",
        ):
            t.add_column(col, justify="right" if col not in ("model-stage", "GPUs", "offload") else "left")
        for lay in sorted(p.layouts.values(), key=lambda x: order.get(x.model_stage, len(order))):
            group = next((g for g in p.colocate if lay.model_stage in g), None)
            ms = lay.model_stage + (" *" if group else "")
            t.add_row(
                ms,
                str(lay.tp),
                str(lay.pp),
                str(lay.dp),
                str(lay.ep) + (f" x {lay.expert_tp}" if lay.expert_tp != lay.tp else ""),
                compress_ints(lay.mesh),
                str(lay.micro_batches),
                str(lay.zero),
                ",".join(lay.offload),
                format_quantity(Dim.TIME, lay.time) if lay.time is not None else "",
                _flagged(m, p, lay),
                _size(held.get((p.name, lay.model_stage))),
            )
        console.print(t)
        if breakdown:
            breakdown_table(p, console)
        if p.colocate:
            console.print("  * colocated: " + "; ".join(" + ".join(g) for g in p.colocate))
        step = (
            format_quantity(Dim.TIME, p.step_time) if p.step_time is not None else "none (a model-stage does not fit)"
        )
        how = (
            " (estimated by show; `nereus opt FILE -p estimate` writes the estimates into the IR)"
            if p.name in now.unestimated
            else ""
        )
        console.print(f"  step time: {step}{how}")
        if p.name in now.stale:
            console.print(
                "  [yellow]stale:[/yellow] the file's estimates were made for another job; today's are shown: "
                + "; ".join(now.stale[p.name])
            )
        for problem in now.problems.get(p.name, []):
            console.print(f"  [red]estimate:[/red] {problem}")
        if p.search:
            s = p.search
            console.print(
                f"  plan-search: {s.status}, objective {format_quantity(Dim.TIME, s.objective)}, bound "
                f"{format_quantity(Dim.TIME, s.bound)}, gap {s.gap:.2%}, {plural(s.candidates, 'candidate', fmt=',')}"
                + (f", headroom {s.headroom:.0%}" if s.headroom is not None else "")
                + (f", bottleneck {s.bottleneck}" if s.bottleneck else "")
            )
        ups = [(lay.model_stage, lay.runner_up) for lay in p.layouts.values() if lay.runner_up]
        for ms, r in ups:
            console.print(
                f"  runner-up for {ms}: TP {r.tp} x PP {r.pp} x DP {r.dp}"
                + (f" ZeRO {r.zero}" if r.zero else "")
                + f", step {format_quantity(Dim.TIME, r.step_time)}"
            )
    for tr in m.transitions.values():
        transition_table(tr, console)


def transition_table(tr, console: Console) -> None:
    """A transition's bytes, schedule and admission, as one table and a line."""
    t = Table(title=f"transition @{tr.name}: @{tr.source} -> @{tr.target}", title_justify="left")
    for col in (
        "operations",
        "bytes moved",
        "lower bound",
        "makespan",
        "port bound",
        "schedule",
        "admit",
        "cost",
        "saving/step",
        "horizon",
        "break-even",
    ):
        t.add_column(col, justify="right")
    a = tr.admit
    fmt_t = lambda x: format_quantity(Dim.TIME, x) if x is not None else ""
    t.add_row(
        f"{len(tr.ops):,}",
        _size(tr.bytes_moved),
        _size(tr.lower_bound),
        fmt_t(tr.makespan),
        fmt_t(tr.port_bound),
        tr.schedule_status or "",
        (f"forced ({a.forced_by})" if a.decision == "forced" else a.decision) if a else "",
        fmt_t(a.cost) if a else "",
        fmt_t(a.saving) if a else "",
        plural(a.horizon, "step") if a and a.horizon is not None else "",
        plural(a.break_even, "step")
        if a and a.break_even is not None
        else ("never" if a and a.decision != "forced" else ""),
    )
    console.print(t)
    if a:
        from .passes.transition.admit import describe

        console.print(f"  admit: {a.decision}: {describe(a)}")


def _emu_bytes(m: Module) -> dict[tuple[str, str], int]:
    """Largest bytes held by one GPU, per (plan, model-stage), from the declared EMUs."""
    per_gpu: dict[tuple[str, str], dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for emu in m.emus.values():
        plan = m.plans.get(emu.plan)
        lay = plan.layouts.get(emu.model_stage) if plan else None
        model = m.models.get(lay.model) if lay else None
        if model is None:
            continue
        for s in emu.shards:
            per_gpu[(emu.plan, emu.model_stage)][s.gpu] += sum(
                e.numel() * state_dtype_bytes(model, e.state) for e in s.entries
            )
    return {k: max(v.values()) for k, v in per_gpu.items() if v}


def _layout_text(lay) -> str:
    parts = [f"TP {lay.tp} x PP {lay.pp} x DP {lay.dp}" + (f" x CP {lay.cp}" if lay.cp > 1 else "")]
    if lay.pp > 1:
        parts += ["layers " + "|".join(f"{lo}..{hi}" for lo, hi in lay.layers)]
    parts += [f"VPP {lay.vpp}"] if lay.vpp > 1 else []
    parts += (
        [f"EP {lay.ep}" + (f" x ETP {lay.expert_tp}" if lay.expert_tp != lay.tp else "")] if lay.carves_experts else []
    )
    parts += ["SP"] if lay.sp else []
    parts += ["FP8"] if lay.fp8 else []
    parts += [f"{lay.grad_dtype} grads"] if lay.grad_dtype != "bf16" else []
    parts += [f"ZeRO {lay.zero}"] if lay.zero else []
    parts += [f"micro {lay.micro_batches}"] if lay.micro_batches > 1 else []
    parts += ["recompute"] if lay.recompute else []
    parts += ["offload " + "+".join(lay.offload)] if lay.offload else []
    return ", ".join(parts) + f" on {compress_ints(lay.mesh)}"


def _change(a: float | None, b: float | None) -> str:
    if a is None or b is None or not a:
        return ""
    return f"{(b - a) / a:+.1%}"


def diff(ma: Module, a: str, mb: Module, b: str, title: str, console: Console | None = None) -> None:
    """Plan ``a`` of ``ma`` beside plan ``b`` of ``mb``: every model-stage's layout, time and
    peak memory per GPU, and the step time, with the change from A to B. Plans without
    estimates are estimated first (the files are not changed)."""
    console = console or Console(width=None if sys.stdout.isatty() else 200)
    ta = today(ma)
    tb = today(mb) if mb is not ma else ta
    ma, mb = ta.module, tb.module
    pa, pb = ma.plans[a], mb.plans[b]
    t = Table(title=title, title_justify="left")
    for col in ("model-stage", f"@{a}", f"@{b}", "time A", "time B", "change", "memory A", "memory B", "change "):
        t.add_column(col, justify="left" if col in ("model-stage", f"@{a}", f"@{b}") else "right")
    order = list(pa.layouts) + [ms for ms in pb.layouts if ms not in pa.layouts]
    for ms in order:
        la, lb = pa.layouts.get(ms), pb.layouts.get(ms)
        same = la is not None and lb is not None and _layout_text(la) == _layout_text(lb)
        t.add_row(
            ms,
            _layout_text(la) if la else "-",
            ("same" if same else _layout_text(lb)) if lb else "-",
            format_quantity(Dim.TIME, la.time) if la and la.time is not None else "",
            format_quantity(Dim.TIME, lb.time) if lb and lb.time is not None else "",
            _change(la and la.time, lb and lb.time),
            _flagged(ma, pa, la) if la else "",
            _flagged(mb, pb, lb) if lb else "",
            _change(la and la.memory, lb and lb.memory),
        )
    fmt = lambda x: format_quantity(Dim.TIME, x) if x is not None else "none"
    t.add_row(
        "step",
        "",
        "",
        fmt(pa.step_time),
        fmt(pb.step_time),
        _change(pa.step_time, pb.step_time),
        "",
        "",
        "",
        style="bold",
    )
    console.print(t)
    for name, now in ((a, ta), (b, tb)):
        if name in now.stale:
            console.print(
                f"  [yellow]@{name} stale:[/yellow] today's estimates are shown: " + "; ".join(now.stale[name])
            )
        for problem in now.problems.get(name, []):
            console.print(f"  [red]@{name} does not fit:[/red] {problem}")
    if pa.colocate != pb.colocate:
        for name, p in ((a, pa), (b, pb)):
            console.print(f"  @{name} colocates: " + ("; ".join(" + ".join(g) for g in p.colocate) or "nothing"))


def show_decision(decision, notes: list[str] = (), console: Console | None = None) -> None:  # type: ignore[assignment]
    """What ``nereus replan`` prints: why the core re-planned, plan A beside plan B (today's
    estimates), the move's bytes, schedule and cost, and the decision."""
    console = console or Console(width=None if sys.stdout.isatty() else 200)
    for note in notes:
        console.print(f"  {note}")
    for t in decision.triggers:
        console.print(f"  trigger {t.kind}{' (forced)' if t.forced else ''}: {t.detail}")
    m = decision.module
    if m is not None and decision.target in m.plans:
        diff(m, decision.source, m, decision.target, f"@{decision.source} -> @{decision.target}", console)
        if decision.transition in m.transitions:
            transition_table(m.transitions[decision.transition], console)
    style = {"transition": "green", "stay": "yellow", "infeasible": "red"}[decision.action]
    console.print(f"[bold {style}]{decision.action}[/bold {style}]: {decision.message}")
