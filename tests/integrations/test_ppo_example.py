"""examples/ppo_tiny.py on 4 gloo processes: PPO (actor, critic with a value head, reference, GAE)
on a tiny HF Llama whose actor starts as 2 pipeline stages (PipelineStage, Schedule1F1B) x DDP 2,
moved by the Controller twice (admitted: PP 2 -> PP 1, then forced by a rank leaving), the
actor's state right after each move bit-identical to the full state gathered and re-sliced, and
the loop going on with finite losses."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("transformers")

from nereus.runtime.launch import run_local

from . import grpo_workers as w
from .test_grpo_example import decisions


@pytest.mark.slow
def test_ppo_example_moves_twice_exactly_and_trains_on(tmp_path):
    log = tmp_path / "decisions.jsonl"
    argv = [
        "--steps",
        "4",
        "--leave-step",
        "1",
        "--decision-log",
        str(log),
        "--quiet",
        "--timeout",
        "30",
        "--tp",
        "1",
        "--pp",
        "2",
        "--dp",
        "2",
    ]
    results = run_local(w.run, 4, argv, "ppo_tiny", timeout=240)

    made, applied = decisions(log)
    moves = [(d["step"], d["forced"]) for d in made if d["action"] == "transition"]
    assert moves == [(0, False), (1, True)] and [d["applied"] for d in applied] == ["transition"] * 2, made
    for res in results:
        assert [(c["source"], c["target"]) for c in res["checks"]] == [("a", "p0"), ("p0", "p1")], res["checks"]
        assert all(c["exact"] and c["same_keys"] and c["step_b"] == c["step_a"] > 0 for c in res["checks"] if c["in_b"])
        assert all(math.isfinite(h["loss"]) and math.isfinite(h["value_loss"]) for h in res["history"])
        assert res["history"][0]["plan"] == "@a tp1xpp2xdp2"
        assert all(h["plan"].endswith("pp1xdp4") for h in res["history"][1:2]), res["history"]
        steps = [h["step"] for h in res["history"]]
        assert steps == ([0, 1] if res["rank"] == 3 else [0, 1, 2, 3]) and res["active"] == (res["rank"] != 3)
