"""``nereus bench parse``: parse + verify + print of the 70B PPO job with all EMUs of actor.train.

Sizes 128, 256, 512 and 1,024 GPUs (actor.train is TP 8 x PP 4 x DP gpus/32, so one shard per
GPU). Two texts of the same module are timed: the canonical one, where replicas holding the same
slices print as one ``emu`` block, and the expanded one with one block per replica (what a
tool that does not group would read). Figures are medians of repeated runs in this process,
after one warm-up that also builds the LALR tables (timed separately). The round trip is also
split into its parts, each timed on its own: parse (of which lark's LALR parse of the text, with
its tree transformer), verify and print.
"""

from __future__ import annotations

import statistics
import time

from rich.console import Console
from rich.table import Table

from ..ir import parse, print_ir, verify
from ..testing.jobs import ppo_70b

SIZES = (128, 256, 512, 1024)
TARGET_MS = 200.0


def roundtrip(text: str) -> str:
    """The benchmarked work: text -> verified module -> canonical text."""
    return print_ir(verify(parse(text)))


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run(quick: bool = False, json_output: bool = False) -> dict:
    from ..ir.parser import lark_parser

    t0 = time.perf_counter()
    lark_parser()
    grammar_ms = (time.perf_counter() - t0) * 1e3
    repeats = 2 if quick else 9
    rows = []
    for gpus in SIZES:
        canonical = ppo_70b(gpus)
        m = parse(canonical)
        expanded = print_ir(m, group_replicas=False)
        assert roundtrip(canonical) == canonical and parse(expanded) == m
        row = {"gpus": gpus, "emus": len(m.emus), "shards": sum(len(e.shards) for e in m.emus.values())}
        for label, text in (("canonical", canonical), ("expanded", expanded)):
            roundtrip(text)  # warm-up
            ms = _median_ms(lambda: roundtrip(text), repeats)
            row[f"{label}_lines"] = text.count("\n")
            row[f"{label}_ms"] = round(ms, 2)
            row[f"{label}_us_per_gpu"] = round(ms * 1e3 / gpus, 1)
            module = parse(text)
            row[f"{label}_parse_ms"] = round(_median_ms(lambda: parse(text), repeats), 2)
            row[f"{label}_lark_ms"] = round(_median_ms(lambda: lark_parser().parse(text), repeats), 2)
            row[f"{label}_verify_ms"] = round(_median_ms(lambda: verify(module), repeats), 2)
            row[f"{label}_print_ms"] = round(_median_ms(lambda: print_ir(module), repeats), 2)
        rows.append(row)
    result = {"benchmark": "parse", "grammar_build_ms": round(grammar_ms, 1), "repeats": repeats,
              "target_ms_1024": TARGET_MS, "rows": rows}
    if not json_output:
        table = Table(title="parse + verify + print, 70B PPO job, all EMUs of actor.train (median ms)", title_justify="left")
        for col in ("GPUs", "EMUs", "shards", "lines", "canonical ms", "us/GPU", "expanded lines", "expanded ms", "us/GPU "):
            table.add_column(col, justify="right")
        for r in rows:
            table.add_row(str(r["gpus"]), str(r["emus"]), str(r["shards"]), str(r["canonical_lines"]),
                          f"{r['canonical_ms']:.1f}", f"{r['canonical_us_per_gpu']:.0f}", str(r["expanded_lines"]),
                          f"{r['expanded_ms']:.1f}", f"{r['expanded_us_per_gpu']:.0f}")
        console = Console(width=140)
        console.print(table)
        split = Table(title="the round trip in parts (median ms, each timed on its own)", title_justify="left")
        for col in ("GPUs", "text", "parse", "of which lark", "verify", "print"):
            split.add_column(col, justify="left" if col == "text" else "right")
        for r in rows:
            for label in ("canonical", "expanded"):
                split.add_row(str(r["gpus"]), label, *(f"{r[f'{label}_{k}_ms']:.1f}" for k in ("parse", "lark", "verify", "print")))
        console.print(split)
        last = rows[-1]
        verdict = "meets" if last["canonical_ms"] < TARGET_MS else "misses"
        console.print(f"1,024 GPUs, canonical text: {last['canonical_ms']:.1f} ms ({verdict} the {TARGET_MS:.0f} ms target); "
                      f"expanded text: {last['expanded_ms']:.1f} ms. LALR table build, once per process: {grammar_ms:.0f} ms.")
    return result
