"""lower-collectives and the rendered script: byte accounting, slices checked at lowering, a
script that cannot be injected through a name, and that runs under torchrun. The printed programs
have goldens: tests/golden/lower/NAME.nir runs ``nereus lower`` (its RUN lines) and checks the
per-round and per-rank totals with CHECK lines (tests/cli/test_goldens.py)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import nereus
from nereus.backend.lower import contiguous, load_wave, lower
from nereus.backend.program import Message, Piece, Program, Step
from nereus.backend.script import pyrepr, render_script
from nereus.passes.transition.derive_emus import derive_missing_emus
from nereus.passes.transition.plan_transition import plan_transition
from nereus.runtime.launch import free_port
from nereus.runtime.state import ShardSpec, StateKey
from nereus.testing.cases import CASES, case_module

from ..support import GOLDEN


def planned(case: str, n: int = 4, hidden: int = 64, layers: int = 4):
    m = case_module(case, n, hidden=hidden, layers=layers)
    m.transitions["t"] = plan_transition(m, "a", "b", "t")
    return m


@pytest.mark.parametrize("case", CASES)
def test_program_sends_exactly_the_planned_bytes(case):
    m = planned(case, n=8)
    t = m.transitions["t"]
    for mode in ("p2p", "collective"):
        prog = lower(m, "t", broadcast=mode)
        sent = sum(prog.sent_bytes(r) for r in range(prog.world))
        received = sum(prog.received_bytes(r) for r in range(prog.world))
        assert sent == received == t.bytes_moved == t.lower_bound


def _pieces(prog) -> list[tuple]:
    """Every piece a program receives, copies or unstages, as (rank, source, destination, box)."""
    out = []
    for r, steps in prog.steps.items():
        for s in steps:
            msgs = s.recvs if s.kind == "round" else ((s.message,) if s.kind == "broadcast" else ())
            out += [(r, p.src, p.dst, p.box, p.arrived) for m in msgs for p in m.pieces]
            if s.piece is not None:
                out.append((r, s.piece.src, s.piece.dst, s.piece.box, s.piece.arrived))
    return sorted(out, key=repr)


@pytest.mark.parametrize("case", CASES)
def test_a_program_in_waves_moves_the_same_pieces_in_the_order_an_engine_loads_them(case):
    m = planned(case, n=8, layers=6)
    model = m.models["actor"]
    for mode in ("p2p", "chain"):
        whole = lower(m, "t", broadcast=mode, chunk_bytes=4096)
        waves = lower(m, "t", broadcast=mode, chunk_bytes=4096, waves=4)
        assert _pieces(waves) == _pieces(whole)
        assert len(waves.round_levels) >= len(whole.round_levels)
        for r, steps in waves.steps.items():  # a rank receives wave 0's tensors, then wave 1's, ...
            seen = [
                load_wave(model, p.dst.tensor, 4)
                for s in steps
                if s.kind == "round"
                for msg in s.recvs
                for p in msg.pieces
            ]
            assert seen == sorted(seen), (case, mode, r)


def test_a_program_travels_without_the_executors_caches_keyed_by_object_ids():
    """``execute`` keeps per-rank look-ups on the program keyed by ``id(step)`` and ``id(piece)``,
    which mean nothing in another process: a pickled program leaves them behind, digest intact."""
    import pickle

    prog = lower(planned(CASES[0]), "t")
    digest = prog.digest()
    first = prog.steps[0][0]
    prog.__dict__["_regions"] = {0: {id(first): (None, None)}}
    prog.__dict__["_writes"] = {0: {id(first): []}}
    back = pickle.loads(pickle.dumps(prog))
    assert "_regions" not in back.__dict__ and "_writes" not in back.__dict__
    assert back.digest() == digest and "_regions" in prog.__dict__


def test_load_waves_cut_the_engines_load_order_into_equal_runs():
    m = planned("tp4-tp2x2", layers=6)
    model = m.models["actor"]
    first = [n for n, t in model.tensors.items() if t.placement in ("first", "first_and_last")]
    last = [n for n, t in model.tensors.items() if t.placement == "last"]
    assert {load_wave(model, n, 4) for n in first} == {0}
    assert {load_wave(model, n, 4) for n in last} == {3}
    # 8 places (first stage, 6 layers, last stage) in 4 runs of 2
    assert [load_wave(model, f"layers.{i}.mlp.up_proj.weight", 4) for i in range(6)] == [0, 1, 1, 2, 2, 3]
    assert {load_wave(model, n, 1) for n in first + last} == {0}


def test_large_contiguous_slices_travel_direct_and_small_ones_in_buckets():
    m = planned("tp4-tp2x2", hidden=128)
    prog = lower(m, "t", direct_bytes=8192, bucket_bytes=32 * 1024)
    msgs = [msg for steps in prog.steps.values() for s in steps for msg in s.sends]
    direct = [msg for msg in msgs if msg.direct]
    packed = [msg for msg in msgs if not msg.direct]
    assert direct and packed
    assert all(len(msg.pieces) == 1 and msg.nbytes >= 8192 for msg in direct)
    # a bucket is never larger than its limit unless it holds a single piece
    assert all(msg.nbytes <= 32 * 1024 or len(msg.pieces) == 1 for msg in packed)


def test_contiguity_rule():
    outer = ((0, 8), (0, 4), (0, 6))
    assert contiguous(outer, ((2, 5), (0, 4), (0, 6)))  # rows of whole planes
    assert contiguous(outer, ((3, 4), (1, 3), (0, 6)))  # one plane, whole rows
    assert contiguous(outer, ((3, 4), (2, 3), (1, 5)))  # part of one row
    assert not contiguous(outer, ((0, 8), (0, 2), (0, 6)))
    assert not contiguous(outer, ((3, 4), (1, 3), (0, 5)))


def test_a_transition_that_misses_a_slice_does_not_lower():
    m = planned("tp4-tp2x2")
    t = m.transitions["t"]
    gone = {op.id for op in t.ops if op.kind == "send" and op.family == "embed_tokens.weight" and "master" in op.states}
    t.ops = [op for op in t.ops if op.id not in gone]
    for op in t.ops:
        op.deps = [d for d in op.deps if d not in gone]
    with pytest.raises(
        nereus.DiagnosticError,
        match=r"rank \d receives [\d,]+ of the [\d,]+ bytes of "
        r"actor.train:(master|exp_avg|exp_avg_sq):embed_tokens.weight .* exactly once",
    ):
        lower(m, "t")


EVIL = "x'''\"\"\"); import os; os.system('touch /tmp/nereus_pwned') #\n"


def evil_program() -> Program:
    key = StateKey("actor.train", "weight", EVIL)
    spec = ShardSpec(key, (4,), ((0, 4),), "fp32")
    piece = Piece(key, key, ((0, 4),), 16)
    msg = Message(0, 0, 1, (piece,), True)
    return Program(
        transition="t",
        source="a",
        target="b",
        gpus=[0, 1],
        src={0: [spec], 1: []},
        dst={0: [], 1: [spec]},
        steps={0: [Step("round", sends=(msg,))], 1: [Step("alloc", keys=(key,)), Step("round", recvs=(msg,))]},
    )


def test_a_name_cannot_inject_code_into_the_script():
    text = render_script(evil_program())
    tree = ast.parse(text)  # still valid Python
    constants = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    assert any(EVIL in c for c in constants)  # the name is data ...
    calls = {ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    assert "os.system" not in calls  # ... and never code
    prog = evil_program()
    prog.transition = 'x"""\nimport os'
    with pytest.raises(ValueError, match="not an identifier"):
        render_script(prog)
    with pytest.raises(TypeError):
        pyrepr(object())


STAGING = GOLDEN / "plan-transition" / "staging.nir"


def staged(shared: bool = False):
    """Two GPUs swap TP shards without room for both: part of each new shard is staged in host
    memory. ``shared``: a second model-stage of the model on the same GPUs, so that one unstage
    fills two shards on a GPU."""
    text = STAGING.read_text()
    if shared:
        text = text.replace(
            "  stage infer { kind = infer, models = [@ref] }\n",
            "  stage infer { kind = infer, models = [@ref] }\n  stage score { kind = infer, models = [@ref] }\n",
        )
        for mesh in ("[0, 1]", "[1, 0]"):
            line = f"  layout ref.infer {{ tp = 2, pp = 1, dp = 1, layers = [0..1], mesh = {mesh} }}\n"
            text = text.replace(line, line + line.replace("ref.infer", "ref.score"))
        text = text.replace("gpu_memory = 640KiB", "gpu_memory = 1280KiB")
    m = nereus.parse(text, str(STAGING))
    nereus.run_pipeline(m, "plan-transition{to=@b}")
    if shared:
        assert any(op.kind == "unstage" and len(op.dst) == 2 for op in m.transitions["a_to_b"].ops)
    return m


def test_staged_slices_land_in_host_buffers_and_are_unstaged_after():
    m = staged()
    prog = lower(m, "a_to_b", direct_bytes=4096)
    for steps in prog.steps.values():
        kinds = [s.kind for s in steps]
        staged_recvs = [p for s in steps for msg in s.recvs for p in msg.pieces if p.staged]
        assert staged_recvs and "unstage" in kinds
        assert kinds.index("unstage") > max(i for i, s in enumerate(steps) if s.kind == "round")


@pytest.mark.parametrize("case", ["tp4-tp2x2", "train-gen", "staging"])
def test_rendered_script_runs_under_torchrun(tmp_path, case):
    """tp4-tp2x2: direct sends; train-gen: chained broadcasts that forward what arrived;
    staging: slices staged in host buffers, then unstaged into two model-stages' shards."""
    if case == "staging":
        prog = lower(staged(shared=True), "a_to_b", direct_bytes=4096)
    else:
        mode = "chain" if case == "train-gen" else "auto"
        prog = lower(planned(case), "t", direct_bytes=4096, chunk_bytes=64 * 1024, broadcast=mode)
    script = tmp_path / "transition.py"
    script.write_text(render_script(prog))
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
        timeout=180,
        env=env,
    )
    assert r.returncode == 0, r.stdout + r.stderr  # a rank with a wrong shard exits 1
    # the processes share one stdout: lines may run together, so find the reports anywhere
    reports = sorted(re.findall(r"rank (\d): (\d+) shards, (\d+) wrong", r.stdout))
    assert reports == [(str(i), str(len(prog.dst[i])), "0") for i in range(prog.world)], r.stdout


def test_cli_lower_prints_the_program_and_reports_a_missing_transition(tmp_path, capsys):
    m = case_module("pp2-pp4", 4, hidden=64, layers=4)
    m.emus.clear()
    f = tmp_path / "job.nir"
    f.write_text(nereus.print_ir(m))
    from nereus.cli import main

    out = tmp_path / "s.py"
    assert main(["lower", str(f), "-p", "plan-transition{to=@b}", "--script", str(out)]) == 0
    ast.parse(out.read_text())
    assert main(["lower", str(f)]) == 1
    unwritable = tmp_path / "no" / "dir" / "s.py"
    assert main(["lower", str(f), "-p", "plan-transition{to=@b}", "--script", str(unwritable)]) == 1
    assert f"{unwritable}: error: cannot write" in capsys.readouterr().err


def test_auto_chains_a_broadcast_only_where_its_root_is_the_busiest_sender():
    """Full replication (every rank a root of its share): direct sends are balanced. One root to
    many (TP 4 -> TP 1 x DP 4 from a single source copy): that root is chained."""
    balanced = lower(planned("train-gen"), "t")
    assert not any(
        s.sends and any(p.arrived for m in s.sends for p in m.pieces) for st in balanced.steps.values() for s in st
    )
    m = case_module("train-gen", 4, hidden=64, layers=4)
    lay = m.plans["a"].layouts["actor.generate"]
    lay.tp, lay.mesh = 1, [0]  # one GPU holds everything under plan A
    for key in [k for k in m.emus if k[0] == "a"]:
        del m.emus[key]
    derive_missing_emus(m, "a")
    m.transitions["t"] = plan_transition(m, "a", "b", "t")
    prog = lower(m, "t")
    forwarded = [p for st in prog.steps.values() for s in st for msg in s.sends for p in msg.pieces if p.arrived]
    assert forwarded  # receivers pass chunks on: a chain
