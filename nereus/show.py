"""``nereus show``: a rich summary of a module: GPUs, model-stages, layouts, memory, EMUs."""

from __future__ import annotations

import sys
from collections import defaultdict

from rich.console import Console
from rich.table import Table

from .ir import Module
from .ir.attributes import compress_ints
from .ir.units import Dim, format_quantity
from .ir.model import state_dtype_bytes


def _size(n: int | None) -> str:
    return "" if n is None else format_quantity(Dim.SIZE, n) if n < 2**20 else f"{n / 2**30:.2f} GiB"


def show(m: Module, title: str, console: Console | None = None) -> None:
    # Plans are wide; without a terminal rich would wrap at 80 columns.
    console = console or Console(width=None if sys.stdout.isatty() else 160)
    for c in m.clusters.values():
        t = Table(title=f"{title}: cluster @{c.name}", title_justify="left")
        for col in ("GPUs", "available", "nodes x GPUs", "GPU memory", "peak", "HBM", "NVLink", "NIC"):
            t.add_column(col, justify="right")
        t.add_row(str(c.num_gpus), str(len(c.available_gpus())), f"{c.nodes} x {c.gpus_per_node}",
                  format_quantity(Dim.SIZE, c.gpu_memory), format_quantity(Dim.FLOPS, c.peak_flops),
                  format_quantity(Dim.BANDWIDTH, c.hbm_bandwidth), format_quantity(Dim.BANDWIDTH, c.intra_node.bandwidth),
                  format_quantity(Dim.BANDWIDTH, c.inter_node.bandwidth))
        console.print(t)
    if m.models:
        t = Table(title="models", title_justify="left")
        for col in ("model", "params", "layers", "hidden", "heads/kv", "dtype", "head", "trained"):
            t.add_column(col, justify="right")
        for md in m.models.values():
            t.add_row("@" + md.name, f"{md.num_params() / 1e9:.2f} B", str(md.layers), str(md.hidden),
                      f"{md.heads}/{md.kv_heads}", md.dtype, md.head, "yes" if md.trained else "no")
        console.print(t)
    held = _emu_bytes(m)
    for p in m.plans.values():
        w = m.workloads.get(p.workload)
        order = {ms: i for i, ms in enumerate(w.model_stages())} if w else {}
        t = Table(title=f"plan @{p.name} (workload @{p.workload} on @{p.cluster})", title_justify="left")
        for col in ("model-stage", "TP", "PP", "DP", "GPUs", "micro", "ZeRO", "offload", "time", "memory/GPU", "EMU bytes/GPU"):
            t.add_column(col, justify="right" if col not in ("model-stage", "GPUs", "offload") else "left")
        for lay in sorted(p.layouts.values(), key=lambda x: order.get(x.model_stage, len(order))):
            group = next((g for g in p.colocate if lay.model_stage in g), None)
            ms = lay.model_stage + (" *" if group else "")
            t.add_row(ms, str(lay.tp), str(lay.pp), str(lay.dp), compress_ints(lay.mesh), str(lay.micro_batches),
                      str(lay.zero), ",".join(lay.offload), format_quantity(Dim.TIME, lay.time) if lay.time is not None else "",
                      _size(lay.memory), _size(held.get((p.name, lay.model_stage))))
        console.print(t)
        if p.colocate:
            console.print("  * colocated: " + "; ".join(" + ".join(g) for g in p.colocate))
    for tr in m.transitions.values():
        t = Table(title=f"transition @{tr.name}: @{tr.source} -> @{tr.target}", title_justify="left")
        for col in ("operations", "bytes moved", "lower bound", "makespan", "port bound", "schedule", "admit", "cost", "saving/step", "break-even"):
            t.add_column(col, justify="right")
        a = tr.admit
        fmt_t = lambda x: format_quantity(Dim.TIME, x) if x is not None else ""
        t.add_row(f"{len(tr.ops):,}", _size(tr.bytes_moved), _size(tr.lower_bound), fmt_t(tr.makespan), fmt_t(tr.port_bound),
                  tr.schedule_status or "", a.decision if a else "", fmt_t(a.cost) if a else "",
                  f"{a.saving:g} s" if a else "", f"{a.break_even:g} steps" if a and a.break_even is not None else ("never" if a else ""))
        console.print(t)


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
            per_gpu[(emu.plan, emu.model_stage)][s.gpu] += sum(e.numel() * state_dtype_bytes(model, e.state) for e in s.entries)
    return {k: max(v.values()) for k, v in per_gpu.items() if v}
