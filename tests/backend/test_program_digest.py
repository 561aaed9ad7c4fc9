"""Program.digest: equal for equal programs however they were made, different otherwise."""

import pickle

import nereus
from nereus.backend.lower import lower
from nereus.testing.cases import case_module


def test_the_digest_depends_on_the_program_alone():
    m = nereus.run_pipeline(case_module("tp4-tp2x2", 4, hidden=64, layers=4), "plan-transition{to=@b,into=@t}")
    here = lower(m, "t")
    elsewhere = lower(pickle.loads(pickle.dumps(m)), "t")  # as a rank that received the module
    travelled = pickle.loads(pickle.dumps(here))  # a program sent to another process
    assert here.digest() == elsewhere.digest() == travelled.digest()
    assert lower(m, "t", bucket_bytes=4096).digest() != here.digest()


def test_a_program_travels_to_a_fresh_interpreter_and_to_spawned_ranks(tmp_path):
    """Lowered once, pickled: a bare interpreter (nothing of nereus imported first) loads it with
    the same digest, and spawned ranks that get it as an argument run it bit-exact."""
    import subprocess
    import sys

    from nereus.runtime.launch import run_local

    from ..support import ROOT
    from ..support import runtime_workers as w

    m = nereus.run_pipeline(case_module("tp4-tp2x2", 4, hidden=32, layers=2), "plan-transition{to=@b,into=@t}")
    prog = lower(m, "t")
    path = tmp_path / "program.pkl"
    path.write_bytes(pickle.dumps(prog))
    loaded = subprocess.run(
        [sys.executable, "-c", f"import pickle; print(pickle.load(open({str(path)!r}, 'rb')).digest())"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert loaded.returncode == 0, loaded.stderr
    assert int(loaded.stdout) == prog.digest()
    assert run_local(w.run_travelled, 4, prog, timeout=120) == [[], [], [], []]
