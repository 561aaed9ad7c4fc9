"""``nereus show``: a rich summary of a module: GPUs, model-stages, layouts, memory, EMUs."""

from __future__ import annotations

import sys
from collections import defaultdict

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


def _estimated(m: Module) -> tuple[Module, dict[str, list[str]]]:
    """``m`` with every plan that lacks estimates estimated (on a copy: the file is not changed),
    and per plan the problems estimate found (out of memory), as text."""
    import copy

    from .passes.cost.estimate import estimate_plan

    todo = [p for p in m.plans.values() if p.step_time is None or any(lay.time is None for lay in p.layouts.values())]
    if not todo:
        return m, {}
    m = copy.deepcopy(m)
    problems = {}
    for p in todo:
        try:
            problems[p.name] = [d.message for d in estimate_plan(m, m.plans[p.name])]
        except (KeyError, ValueError) as e:  # a plan the verifier let through but the cost model cannot cost
            problems[p.name] = [f"estimate failed: {e}"]
    return m, problems


def show(m: Module, title: str, console: Console | None = None) -> None:
    """Print the module's tables. Plans without estimates are estimated here (the file is not
    changed) and say so; ``nereus opt FILE -p estimate`` writes them into the IR."""
    # Plans are wide; without a terminal rich would wrap at 80 columns.
    console = console or Console(width=None if sys.stdout.isatty() else 160)
    m, estimated = _estimated(m)
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
                compress_ints(lay.mesh),
                str(lay.micro_batches),
                str(lay.zero),
                ",".join(lay.offload),
                format_quantity(Dim.TIME, lay.time) if lay.time is not None else "",
                _size(lay.memory),
                _size(held.get((p.name, lay.model_stage))),
            )
        console.print(t)
        if p.colocate:
            console.print("  * colocated: " + "; ".join(" + ".join(g) for g in p.colocate))
        step = (
            format_quantity(Dim.TIME, p.step_time) if p.step_time is not None else "none (a model-stage does not fit)"
        )
        how = (
            " (estimated by show; `nereus opt FILE -p estimate` writes the estimates into the IR)"
            if p.name in estimated
            else ""
        )
        console.print(f"  step time: {step}{how}")
        for problem in estimated.get(p.name, []):
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
            a.decision if a else "",
            fmt_t(a.cost) if a else "",
            fmt_t(a.saving) if a else "",
            plural(a.horizon, "step") if a and a.horizon is not None else "",
            plural(a.break_even, "step") if a and a.break_even is not None else ("never" if a else ""),
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
    ma, _ = _estimated(ma)
    mb, _ = _estimated(mb) if mb is not ma else (ma, {})
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
            _size(la and la.memory),
            _size(lb and lb.memory),
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
    if pa.colocate != pb.colocate:
        for name, p in ((a, pa), (b, pb)):
            console.print(f"  @{name} colocates: " + ("; ".join(" + ".join(g) for g in p.colocate) or "nothing"))
