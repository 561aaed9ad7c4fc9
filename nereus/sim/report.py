"""What ``nereus simulate`` shows: a table, JSON, and PNG plots."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

COLUMNS = (
    ("policy", "policy", "{}"),
    ("completed", "steps run", "{}"),
    ("mean_s", "mean step s", "{:.1f}"),
    ("p99_s", "p99 step s", "{:.1f}"),
    ("throughput_samples_per_s", "samples/s", "{:.2f}"),
    ("transitions", "moves", "{}"),
    ("transition_share", "moves % of run", "{:.3%}"),
    ("lost_s", "lost to OOM/GPUs s", "{:.0f}"),
    ("decide_s", "decision s (wall)", "{:.1f}"),
)


def summaries(result: dict) -> list[dict]:
    rows = [run.summary() for run in result["runs"].values()]
    by = {r["policy"]: r for r in rows}
    for r in rows:
        for base in ("fixed", "verl", "openrlhf", "oracle"):
            if base in by and by[base]["throughput_samples_per_s"]:
                r[f"throughput_vs_{base}"] = r["throughput_samples_per_s"] / by[base]["throughput_samples_per_s"]
        for base in ("fixed", "fixed-dp"):
            if base in by and by[base]["mean_s"]:
                r[f"latency_cut_vs_{base}"] = 1 - r["mean_s"] / by[base]["mean_s"]
    return rows


def table(result: dict, console: Console | None = None) -> None:
    rows = summaries(result)
    t = Table(
        title=f"simulate {result['trace']} ({result['steps']} steps, job {result['job']}, seed {result['seed']}, "
        f"{result.get('truth', 'formula')} truth; "
        f"simulated in {result['wall_s']:.0f} s)",
        title_justify="left",
    )
    for _, head, _ in COLUMNS:
        t.add_column(head, justify="left" if head == "policy" else "right")
    cuts = [b for b in ("fixed", "fixed-dp") if any(r["policy"] == b for r in rows)]
    for extra in [f"latency cut vs {b}" for b in cuts] + [
        "throughput / verl",
        "throughput / openrlhf",
        "throughput / oracle",
    ]:
        t.add_column(extra, justify="right")
    for r in rows:
        cells = [fmt.format(r[k]) for k, _, fmt in COLUMNS]
        cells += [f"{r[f'latency_cut_vs_{b}']:+.1%}" if r["policy"] != b else "" for b in cuts]
        for base in ("verl", "openrlhf", "oracle"):
            v = r.get(f"throughput_vs_{base}")
            cells.append(f"{v:.2f}x" if v is not None else "")
        t.add_row(*cells)
    (console or Console(width=200)).print(t)


def to_json(result: dict) -> dict:
    runs = result["runs"]
    return {
        "truth": result.get("truth", "formula"),
        "trace": result["trace"],
        "job": result["job"],
        "steps": result["steps"],
        "seed": result["seed"],
        "wall_s": result["wall_s"],
        "policies": summaries(result),
        "latency": {n: r.latency for n, r in runs.items()},
        "step": {n: r.step for n, r in runs.items()},
        "moves": {n: r.moves for n, r in runs.items()},
    }


def plots(result: dict, out: str | Path, gantt=None) -> list[Path]:
    """``latency.png``: step latency over the run per policy, moves marked; ``gantt.png``: the
    transfer schedule of one Nereus transition (``gantt``: (step, rows))."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files = []
    fig, ax = plt.subplots(figsize=(11, 5))
    for name, run in result["runs"].items():
        (line,) = ax.plot(range(len(run.latency)), run.latency, lw=0.9, label=name)
        for s in run.moves:
            ax.plot([s], [run.latency[s]], marker="v", color=line.get_color(), ms=6)
    ax.set_xlabel("step")
    ax.set_ylabel("step latency (s)")
    ax.set_title(f"{result['trace']}: step latency per policy (triangles: moves)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    files.append(out / f"{result['trace']}_latency.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)
    if gantt:
        step, rows = gantt
        gpus = sorted({g for g, *_ in rows})
        row_of = {g: k for k, g in enumerate(gpus)}
        fig, ax = plt.subplots(figsize=(11, max(3, min(12, len(gpus) * 0.05 + 2))))
        bars: dict[tuple[str, int], list] = {}
        for g, start, dur, kind in rows:
            bars.setdefault((kind, row_of[g]), []).append((start, dur))
        colors = {kind: f"C{k}" for k, kind in enumerate(sorted({kind for kind, _ in bars}))}
        for (kind, row), spans in bars.items():  # one call per GPU and kind: thousands of ops stay fast
            ax.broken_barh(spans, (row - 0.4, 0.8), color=colors[kind])
        for kind, c in colors.items():
            ax.plot([], [], color=c, lw=6, label=kind)
        ax.set_xlabel("seconds into the transition")
        ax.set_ylabel(f"receiving GPU (row; {len(gpus)} GPUs)")
        ax.set_title(f"{result['trace']}: transfer schedule of Nereus's move before step {step + 1}")
        ax.legend(loc="upper right")
        fig.tight_layout()
        files.append(out / f"{result['trace']}_gantt.png")
        fig.savefig(files[-1], dpi=110)
        plt.close(fig)
    return files
