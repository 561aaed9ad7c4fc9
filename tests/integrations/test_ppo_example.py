"""examples/ppo_tiny.py on 4 gloo processes: PPO on a tiny HF Llama as one IR job of four
live models (``actor.train`` and ``critic.train``, a value head, both as 2 pipeline stages
(PipelineStage, Schedule1F1B) x DDP 2 to start, the frozen ``ref.infer`` and the frozen
``reward.infer``, a value head fitted to the task's score), moved by the Controller twice, every
model in one transition each time (admitted: the actor PP 2 -> FSDP2 on two GPUs, the critic on
the other two, then forced by a rank leaving); every model's state right after each move
bit-identical to its full state gathered and re-sliced, and the loop going on with finite
losses."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("transformers")

from nereus.runtime.launch import run_local

from . import grpo_workers as w
from .test_grpo_example import decisions


def test_the_reward_model_learns_the_task_score(reward_model):
    """The fitted reward model scores samples it never saw as the task does: R^2 near 1, far
    from the constant predictor's 0."""
    _, fit = reward_model
    assert fit["r2"] > 0.99 and fit["mae"] < 0.03, fit


@pytest.mark.slow
def test_ppo_example_moves_twice_exactly_and_trains_on(tmp_path, reward_model):
    log = tmp_path / "decisions.jsonl"
    argv = [
        "--reward-model",
        str(reward_model[0]),
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
    models = ["actor.train", "critic.train", "ref.infer", "reward.infer"]
    # one transition changes every model that moves, and the log names each with its layouts
    # before and after; the search's choices here are restated like a golden file's
    assert [sorted(d["changes"]) for d in applied] == [models, models], applied
    assert applied[0]["changes"]["actor.train"]["before"] == "TP 1 x PP 2 x DP 2 on 0..3"
    # the search puts the actor under FSDP2 (ZeRO-3) apart from the critic, the two inference
    # models over all four ranks; then on the 3 ranks left, the actor keeps one of its GPUs and
    # recomputes its activations
    assert {ms: c["after"] for ms, c in applied[0]["changes"].items()} == {
        "actor.train": "TP 1 x PP 1 x DP 2 on 2, 3, ZeRO-3",
        "critic.train": "TP 1 x PP 2 x DP 1 on 0, 1",
        "ref.infer": "TP 1 x PP 1 x DP 4 on 0..3",
        "reward.infer": "TP 1 x PP 1 x DP 4 on 0..3",
    }
    assert applied[1]["changes"] == {
        "actor.train": {
            "before": "TP 1 x PP 1 x DP 2 on 2, 3, ZeRO-3",
            "after": "TP 1 x PP 1 x DP 2 on 2, 1, ZeRO-3, recompute",
        },
        "critic.train": {"before": "TP 1 x PP 2 x DP 1 on 0, 1", "after": "TP 1 x PP 1 x DP 1 on 0"},
        "ref.infer": {"before": "TP 1 x PP 1 x DP 4 on 0..3", "after": "TP 1 x PP 1 x DP 3 on 2, 1, 0"},
        "reward.infer": {"before": "TP 1 x PP 1 x DP 4 on 0..3", "after": "TP 1 x PP 1 x DP 3 on 2, 1, 0"},
    }
    for res in results:
        assert [(c["source"], c["target"]) for c in res["checks"]] == [("a", "p0"), ("p0", "p1")], res["checks"]
    # AdamW's step of each model before each move, from the ranks that held it (the others hold none)
    held = [{ms: max(r["checks"][i]["steps_a"][ms] for r in results) for ms in models} for i in range(2)]
    for res in results:
        for c, steps_a in zip(res["checks"], held):
            assert sorted(c["models"]) == models, c
            for ms, model in c["models"].items():
                if model["in_b"]:
                    assert model["exact"] and model["same_keys"] and model["keys"], (ms, c)
                    trained = ms in ("actor.train", "critic.train")
                    assert c["steps_b"][ms] == steps_a[ms] and (steps_a[ms] > 0) == trained, (ms, c)
                    assert ("exp_avg" in model["states"]) == trained, (ms, c)
        assert all(h[k] is None or math.isfinite(h[k]) for h in res["history"] for k in ("loss", "value_loss"))
        assert (
            res["history"][0]["layouts"]
            == "actor.train tp1xpp2xdp2, critic.train tp1xpp2xdp2, ref.infer tp1xpp1xdp2, reward.infer tp1xpp1xdp2"
        )
        assert res["history"][1]["layouts"] == (
            "actor.train tp1xpp1xdp2 zero3, critic.train tp1xpp2xdp1, ref.infer tp1xpp1xdp4, reward.infer tp1xpp1xdp4"
        ), res["history"]
        if res["rank"] != 3:
            assert res["history"][2]["layouts"] == (
                "actor.train tp1xpp1xdp2 zero3 recompute, critic.train tp1xpp1xdp1, ref.infer tp1xpp1xdp3, "
                "reward.infer tp1xpp1xdp3"
            ), res["history"]
        steps = [h["step"] for h in res["history"]]
        assert steps == ([0, 1] if res["rank"] == 3 else [0, 1, 2, 3]) and res["active"] == (res["rank"] != 3)
    # every step trained the actor and the critic somewhere
    for step in range(4):
        for k in ("loss", "value_loss"):
            assert any(h[k] is not None for r in results for h in r["history"] if h["step"] == step), (step, k)
