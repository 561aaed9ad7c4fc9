"""What ``nereus lower`` writes: the summary (its figures recounted here from the program's
pieces), the full listing with per-layer repetition folded into ``layers.A..B`` ranges (and
unfolded back), and the compact torchrun script (its tables expand to exactly the program's
steps; small whatever the number of layers; its selftest passes under torchrun)."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from nereus.backend.fold import fold_records, fold_runs, unfold_listing, unfold_records
from nereus.backend.lower import lower
from nereus.backend.program import Program, print_program
from nereus.backend.script import render_script
from nereus.backend.summary import COMMIT, LINK_KINDS, format_summary, summarize
from nereus.passes.transition.plan_transition import plan_transition
from nereus.runtime.launch import free_port
from nereus.testing.cases import CASES, case_module

from .test_lower import staged


def planned(case: str, n: int = 4, layers: int = 4, hidden: int = 64):
    m = case_module(case, n, hidden=hidden, layers=layers)
    m.transitions["t"] = plan_transition(m, "a", "b", "t")
    return m


def cluster_of(m, per_node: int | None = None):
    c = m.clusters[m.plans["b"].cluster]
    if per_node is None:
        return c
    return dataclasses.replace(c, nodes=c.num_gpus // per_node, gpus_per_node=per_node)


# -- folding ----------------------------------------------------------------------------------


def test_fold_runs_folds_counters_that_step_by_one():
    items = [("a", 0), ("a", 1), ("a", 2), ("b", 3), ("a", 4), ("a", 6), ("a", 7), ("x", 8)]

    def sig(x):
        return None if x[0] == "x" else (x[0], (x[1],))

    assert fold_runs(items, sig) == [(("a", 0), 3), (("b", 3), 1), (("a", 4), 1), (("a", 6), 2), (("x", 8), 1)]
    assert fold_runs([], sig) == []


def test_fold_records_only_where_the_layer_alone_differs():
    recs = [(f"keep m:weight:layers.{i}.mlp.up_proj.weight [0:4, 0:8]",) for i in range(3)]
    assert fold_records(recs) == [("keep m:weight:layers.0..2.mlp.up_proj.weight [0:4, 0:8]",)]
    # a message and its piece, ids stepping with the layer
    msgs = [
        (f"send #{10 + i} -> 3: direct, 1.00KiB", f"  m:weight:layers.{4 + i}.x [0:4] -> n:weight:layers.{4 + i}.x")
        for i in range(4)
    ]
    assert fold_records(msgs) == [
        ("send #10..13 -> 3: direct, 1.00KiB", "  m:weight:layers.4..7.x [0:4] -> n:weight:layers.4..7.x")
    ]
    never = [
        ("keep m:w:layers.0.a [0:4]", "keep m:w:layers.1.a [0:5]"),  # another box
        ("keep m:w:layers.0.a [0:4]", "keep m:w:layers.2.a [0:4]"),  # a gap
        ("send #1 -> 3: direct, 1B", "send #3 -> 3: direct, 1B"),  # no layer
        ("copy m:w:layers.0.a -> n:w:layers.1.a", "copy m:w:layers.1.a -> n:w:layers.2.a"),  # two layers in a record
        ("keep m:w:layers.0..1.a [0:4]", "keep m:w:layers.1..2.a [0:4]"),  # already ranges
    ]
    for a, b in never:
        assert fold_records([(a,), (b,)]) == [(a,), (b,)], (a, b)
    # a bucket: its pieces fold among themselves; buckets whose pieces folded do not fold further
    buckets = [
        (f"send #{i} -> 1: bucket of 4, 1KiB", *(f"  m:w:layers.{j}.{f} [0:4]" for f in "ab" for j in range(2)))
        for i in range(2)
    ]
    assert fold_records(buckets) == [
        (f"send #{i} -> 1: bucket of 4, 1KiB", "  m:w:layers.0..1.a [0:4]", "  m:w:layers.0..1.b [0:4]")
        for i in range(2)
    ]
    # buckets of one layer each fold like single messages
    layered = [
        (f"send #{i} -> 1: bucket of 2, 1KiB", f"  m:w:layers.{i}.a [0:4]", f"  m:w:layers.{i}.b [0:4]")
        for i in range(3)
    ]
    assert fold_records(layered) == [
        ("send #0..2 -> 1: bucket of 2, 1KiB", "  m:w:layers.0..2.a [0:4]", "  m:w:layers.0..2.b [0:4]")
    ]
    for recs in (recs, msgs, buckets, layered, *([(a,), (b,)] for a, b in never[:-1])):
        assert unfold_records(fold_records(recs)) == list(recs)


@pytest.mark.parametrize("case", CASES)
def test_the_folded_listing_is_short_and_unfolds_to_the_program(case):
    prog = lower(planned(case, layers=16), "t", direct_bytes=4096, chunk_bytes=64 * 1024)
    full = print_program(prog).splitlines()
    folded = print_program(prog, fold=True).splitlines()
    steps = sum(len(s.keys) or 1 for st in prog.steps.values() for s in st)
    pieces = sum(len(m.pieces) for st in prog.steps.values() for s in st for m in s.sends + s.recvs)
    assert len(folded) * 3 < len(full)  # 16 layers (4 per stage of PP 4): at least 3 times shorter
    assert len(folded) * 2 < steps + pieces  # far fewer lines than the program has steps and pieces
    assert any(re.search(r"layers\.0\.\.(15|3)\.", line) for line in folded)  # all 16 layers, or a stage of PP 4
    assert unfold_listing(folded) == full  # the same steps, messages and pieces, in the same order
    assert Counter(unfold_listing(folded)) == Counter(full)


def test_unfolding_a_golden_gives_the_per_layer_program():
    prog = lower(staged(), "a_to_b", direct_bytes=4096)
    assert unfold_listing(print_program(prog, fold=True).splitlines()) == print_program(prog).splitlines()


# -- the summary ------------------------------------------------------------------------------


def recount(prog: Program, per_node: int) -> tuple[Counter, Counter, dict[int, list[int]]]:
    """Messages and bytes per link kind, and per rank [sent msgs, sent bytes, received msgs,
    received bytes, local copies, local bytes, host copies, host bytes], from the pieces alone."""
    msgs, nbytes, ranks = Counter(), Counter(), {r: [0] * 8 for r in range(prog.world)}

    def kind(a: int, b: int) -> str:
        return "nvlink" if prog.gpus[a] // per_node == prog.gpus[b] // per_node else "network"

    for r, steps in prog.steps.items():
        for s in steps:
            for m in s.sends:
                b = sum(p.nbytes for p in m.pieces)
                msgs[kind(r, m.receiver)] += 1
                nbytes[kind(r, m.receiver)] += b
                ranks[r][0] += 1
                ranks[r][1] += b
                ranks[m.receiver][2] += 1
                ranks[m.receiver][3] += b
            if s.kind == "broadcast" and s.group[0] == r:
                b = sum(p.nbytes for p in s.message.pieces)
                for member in s.group[1:]:
                    msgs[kind(r, member)] += 1
                    nbytes[kind(r, member)] += b
                    ranks[r][0] += 1
                    ranks[r][1] += b
                    ranks[member][2] += 1
                    ranks[member][3] += b
            if s.kind in ("copy", "unstage"):
                host = s.kind == "unstage" or s.piece.staged
                msgs["host" if host else "local"] += 1
                nbytes["host" if host else "local"] += s.piece.nbytes
                ranks[r][6 if host else 4] += 1
                ranks[r][7 if host else 5] += s.piece.nbytes
    return msgs, nbytes, ranks


@pytest.mark.parametrize(
    "case,mode", [(c, "auto") for c in CASES] + [("train-gen", "collective"), ("tp4-tp2x2", "chain")]
)
def test_the_summary_counts_what_the_program_moves(case, mode):
    m = planned(case, n=8)
    prog = lower(m, "t", broadcast=mode, direct_bytes=4096, chunk_bytes=64 * 1024)
    s = summarize(prog, cluster_of(m, per_node=4), makespan=1e-3)  # two nodes of 4 GPUs
    msgs, nbytes, ranks = recount(prog, 4)
    for k in LINK_KINDS:
        assert s.totals.msgs[k] == msgs[k], k
        assert s.totals.bytes[k] == nbytes[k], k
        assert sum(x.traffic.bytes[k] * max(1, len(x.rounds)) for x in s.rounds) == nbytes[k]  # a row of rounds: each
    assert s.totals.bytes["nvlink"] + s.totals.bytes["network"] == sum(prog.sent_bytes(r) for r in range(prog.world))
    assert s.totals.bytes["nvlink"] + s.totals.bytes["network"] == m.transitions["t"].bytes_moved
    assert s.totals.bytes["nvlink"] > 0
    # per rank: folded rows unfold to every rank's own figures, in order
    rows = [(r, row.figures) for row in s.ranks for r in row.ranks]
    assert [r for r, _ in rows] == list(range(prog.world))
    for r, f in rows:
        assert list(dataclasses.astuple(f)) == ranks[r], r
    # every round of the program is in exactly one row, in order
    rounds = sorted({st.round for steps in prog.steps.values() for st in steps if st.kind == "round"})
    assert [n for x in s.rounds if x.phase == "round" for n in x.rounds] == rounds
    text = format_summary(s)
    total = s.totals.bytes["nvlink"] + s.totals.bytes["network"]
    assert f"moves {total:,} bytes in {s.totals.msgs['nvlink'] + s.totals.msgs['network']:,} messages" in text
    assert "estimated makespan 1ms" in text
    assert len(text.splitlines()) < 20 + len(s.rounds) + len(s.ranks)


def test_summary_folds_ranks_and_rounds_and_counts_host_copies():
    m = planned("tp4-tp2x2", n=8)
    s = summarize(lower(m, "t"), cluster_of(m))
    assert len(s.ranks) < 8 and any(len(row.ranks) > 1 for row in s.ranks)  # replicas move alike
    assert re.search(r"│ \d+, \d+ ", format_summary(s))  # 5, 6
    s = summarize(lower(m, "t"), cluster_of(m, per_node=2))
    assert s.totals.bytes["network"] > 0 and s.totals.bytes["nvlink"] > 0
    rows = [
        x
        for x in summarize(
            lower(planned("tp4-tp2x2", n=8, layers=8), "t", broadcast="chain", chunk_bytes=4096), cluster_of(m)
        ).rounds
        if x.phase == "round"
    ]
    assert any(len(x.rounds) > 1 for x in rows)  # chained sub-rounds that move the same
    assert any(re.fullmatch(r"rounds \d+\.\.\d+, each", x.label) for x in rows)
    prog = lower(staged(), "a_to_b", direct_bytes=4096)
    s = summarize(prog)  # no cluster: one node
    _, nbytes, _ = recount(prog, 1 << 30)
    assert s.totals.bytes["host"] == nbytes["host"] > 0
    assert s.totals.bytes["network"] == 0
    assert all(x.level != COMMIT for x in s.rounds)  # no offloads


# -- the script ---------------------------------------------------------------------------------


def reference_steps(rank: int, steps) -> list[tuple]:
    """The steps in the form the script's interpreter runs (the script used to list these)."""
    out = []
    for s in steps:
        if s.kind in ("keep", "alloc"):
            out += [(s.kind, str(k)) for k in s.keys]
        elif s.kind == "copy":
            p = s.piece
            out.append(("copy", str(p.src), str(p.dst), p.box, p.arrived, p.staged))
        elif s.kind == "unstage":
            p = s.piece
            out.append(("unstage", str(p.src), str(p.dst), p.box))
        elif s.kind == "round":
            msgs = sorted(
                [(m.id, "send", m.receiver, [(str(p.src), p.box, p.arrived) for p in m.pieces]) for m in s.sends]
                + [(m.id, "recv", m.sender, [(str(p.dst), p.box, p.staged) for p in m.pieces]) for m in s.recvs]
            )
            out.append(("round", [(verb, peer, pieces) for _, verb, peer, pieces in msgs]))
        elif s.kind == "broadcast":
            root = s.group[0]
            out.append(
                ("broadcast", root, s.group, [(str(p.src if rank == root else p.dst), p.box) for p in s.message.pieces])
            )
    return out


def load_script(path: Path):
    spec = importlib.util.spec_from_file_location(f"transition_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # defines the tables and functions; main() runs only as __main__
    return mod


@pytest.mark.parametrize(
    "case,mode",
    [(c, "auto") for c in CASES] + [("train-gen", "collective"), ("tp4-tp2x2", "chain"), ("staging", "auto")],
)
def test_the_script_tables_expand_to_the_program(tmp_path, case, mode):
    if case == "staging":
        prog = lower(staged(shared=True), "a_to_b", direct_bytes=4096)
    else:
        prog = lower(planned(case, n=8, layers=6), "t", broadcast=mode, direct_bytes=4096, chunk_bytes=64 * 1024)
    path = tmp_path / "t.py"
    path.write_text(render_script(prog))
    mod = load_script(path)
    for r in range(prog.world):
        assert list(mod.expand(mod.STEPS.get(r, []))) == reference_steps(r, prog.steps.get(r, [])), r
        for table, specs in ((mod.SOURCE, prog.src), (mod.TARGET, prog.dst)):
            assert mod.shards(table, r) == {str(x.key): (x.shape, x.box, x.dtype) for x in specs.get(r, [])}


SCRIPT_BYTES_PER_PIECE = 4
"""A 48-layer transition's script: under 4 bytes per per-layer piece (a copy or a message's
slice, counted once on the sending side), template included; unrolled, the steps took ~470 bytes
per piece (30.5 MB for the 65,264 pieces of a 32-GPU, 48-layer GRPO transition; 485 KB now)."""


def test_a_48_layer_script_is_compact_and_passes_its_selftest(tmp_path):
    progs = {n: lower(planned("tp4-tp2x2", layers=n), "t", direct_bytes=4096) for n in (4, 48)}
    texts = {n: render_script(p) for n, p in progs.items()}
    prog, text = progs[48], texts[48]
    pieces = sum(
        1
        for st in prog.steps.values()
        for s in st
        for _ in ([s.piece] if s.piece else []) + [p for m in s.sends for p in m.pieces]
    )
    assert pieces > 10_000
    assert len(text) < SCRIPT_BYTES_PER_PIECE * pieces, (len(text), pieces)
    assert len(text) < 1.1 * len(texts[4])  # 12 times the layers, under 10% more script
    script = tmp_path / "transition.py"
    script.write_text(text)
    torchrun = Path(sys.executable).with_name("torchrun")
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    r = subprocess.run(
        [
            str(torchrun),
            "--nproc-per-node",
            str(prog.world),
            "--master-port",
            str(free_port()),
            str(script),
            "--selftest",
            "--timeout",
            "60",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    reports = sorted(re.findall(r"rank (\d): (\d+) shards, (\d+) wrong", r.stdout))
    assert reports == [(str(i), str(len(prog.dst[i])), "0") for i in range(prog.world)], r.stdout
