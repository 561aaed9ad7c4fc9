"""``benchmarks/simulator_moves.py``, the tool that takes a move out of a simulated run to time
its passes alone: on the small job's trace it dumps the inputs the decision core gave remap,
plan-transition and schedule-transfers at a step where Nereus moved, and `time` rebuilds from
them the run's placement of plan B and a transition of the same operations as the run's (it
broke once, silently, when the core began to pass plan-transition a bound)."""

import hashlib
import importlib.util
import json
from pathlib import Path

import pytest

from nereus.sim.simulate import simulate
from nereus.sim.trace import write_trace

from .test_simulate import _job, _trace

TOOL = Path(__file__).resolve().parents[2] / "benchmarks" / "simulator_moves.py"


def _tool():
    spec = importlib.util.spec_from_file_location("simulator_moves", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_dumped_move_is_rebuilt_with_the_runs_operations(tmp_path, capsys):
    run = simulate(_job(), _trace(), ["nereus"], progress=False)
    core = run["policies"]["nereus"].core
    moved = [d for d in core.decisions if d.action == "transition"]
    assert moved, "the small trace makes Nereus move"
    d = moved[-1]  # the last move: its plan B is the plan the core runs at the end, meshes and all
    assert core.plan == d.target
    step = d.step
    trace = tmp_path / "small.jsonl"
    write_trace(_trace(), trace)
    tool = _tool()
    with pytest.raises(SystemExit) as stop:
        tool.dump(str(trace), {step}, tmp_path / "moves")
    assert stop.value.code == 0
    capsys.readouterr()
    tool.time_passes(tmp_path / "moves", [step])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["pass"] for x in lines] == ["remap", "plan-transition", "schedule-transfers"]
    remapped, planned, scheduled = lines
    assert (remapped["bytes_before"], remapped["bytes_after"]) == (
        d.numbers["remap_bytes_before"],
        d.numbers["remap_bytes_after"],
    )
    meshes = sorted((ms, lay.mesh) for ms, lay in core.m.plans[d.target].layouts.items())
    assert remapped["hash"] == hashlib.sha256(repr(meshes).encode()).hexdigest()[:16]  # the run's placement
    assert planned["ops"] == scheduled["ops"] > 0
    assert planned["bytes_moved"] == d.numbers["bytes_moved"] > 0  # the run's move, not another
    assert scheduled["makespan_s"] > 0
