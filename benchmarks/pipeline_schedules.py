"""The pipeline schedules, TP overlap and pipeline-send overlap of one plan, costed by the model
and played by the event truth side by side: Korthikanti et al.'s GPT-3 175B (TP 8 x PP 8 on 64 A100s, SP) with each
schedule a layout can name, with TP communication behind its GEMMs, and with its pipeline sends
posted or waited on (``pp_overlap``; Megatron's default: posted where interleaved).

    python benchmarks/pipeline_schedules.py [--micro-batches 64]

The truth plays every micro-batch of an optimizer step's flush (64 here: 64 samples of one
micro-batch on one replica) whatever ``micro_batches`` says; at fewer the two read different
pipelines (the model's bubble is that of ``micro_batches``).

The two read the mechanisms independently (the model in closed form, the truth operation by
operation on torch's own action lists, from its kernel and collective times); neither is a
measurement: no published figure ran a zero-bubble schedule or TP overlap on this plan.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

import nereus
from nereus.passes.cost.estimate import estimate_plan
from nereus.sim.truth.stages import train_or_infer

BASE = (Path(__file__).resolve().parents[1] / "validation" / "korthikanti_2022.nir").read_text()
STAGES = ", ".join(f"{12 * i}..{12 * i + 11}" for i in range(8))
LAYOUT = f"tp = 8, pp = 8, dp = 1, layers = [{STAGES}], mesh = [0..63], sp = true"
VARIANTS = [
    ("1F1B (default)", ""),
    ("GPipe", ", schedule = gpipe"),
    ("ZB-H1 (zero_bubble)", ", schedule = zero_bubble"),
    ("interleaved, vpp 2", ", vpp = 2"),
    ("zero_bubble, vpp 2", ", vpp = 2, schedule = zero_bubble"),
    ("ZBV", ", vpp = 2, schedule = zbv"),
    ("1F1B + tp_overlap", ", tp_overlap = true"),
    ("ZBV + tp_overlap", ", vpp = 2, schedule = zbv, tp_overlap = true"),
    ("interleaved, vpp 4", ", vpp = 4"),
    ("interleaved, vpp 4, pp_overlap = false", ", vpp = 4, pp_overlap = false"),
    ("interleaved, vpp 2, pp_overlap = false", ", vpp = 2, pp_overlap = false"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--micro-batches", type=int, default=64)
    args = ap.parse_args()
    table = Table(title=f"GPT-3 175B, TP 8 x PP 8, SP, {args.micro_batches} micro-batches per flush")
    for col in ("layout", "model s", "model GiB", "truth s", "truth GiB", "model / truth"):
        table.add_column(col, justify="left" if col == "layout" else "right")
    for label, extra in VARIANTS:
        plan = "plan @probe {\n  workload = @w175b\n  cluster = @selene\n"
        plan += f"  layout gpt175b.train {{ {LAYOUT}, micro_batches = {args.micro_batches}{extra} }}\n}}\n"
        m = nereus.verify(nereus.parse(BASE + "\n" + plan))
        problems = estimate_plan(m, m.plans["probe"])
        lay = m.plans["probe"].layouts["gpt175b.train"]
        w = m.workloads["w175b"]
        lengths = np.full(w.samples, w.prompt_len_mean + w.response_len_mean)
        seconds, peak = train_or_infer(m.models["gpt175b"], lay, w, m.clusters["selene"], lengths, "train")
        assert lay.time is not None and lay.memory is not None
        table.add_row(
            label + (" (does not fit)" if problems else ""),
            f"{lay.time:.2f}",
            f"{lay.memory / 2**30:.1f}",
            f"{seconds:.2f}",
            f"{peak / 2**30:.1f}",
            f"{lay.time / seconds:.2f}",
        )
    Console().print(table)


if __name__ == "__main__":
    main()
