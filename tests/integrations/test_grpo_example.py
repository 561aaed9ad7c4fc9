"""examples/grpo_tiny.py on 4 gloo processes: GRPO on a tiny HF Llama, the actor (``actor.train``)
and the frozen reference (``ref.infer``) each under its own layout of one IR plan (TP 2 x DP 2
both to start), moved by the Controller twice mid-run, both models in one transition each time
(an admitted move on response-length drift, then a forced one when a rank leaves); every
model's state on every rank right after each move bit-identical to its full state gathered and
re-sliced, and the loop going on after each move with finite losses.

That the reward rises over a longer run is shown by the example itself (docs/embedding.md has the command)."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("transformers")

from nereus.runtime.launch import run_local

from . import grpo_workers as w


def decisions(path) -> tuple[list[dict], list[dict]]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [d for d in lines if "action" in d], [d for d in lines if "applied" in d]


@pytest.mark.slow
def test_grpo_example_moves_twice_exactly_and_trains_on(tmp_path):
    log = tmp_path / "decisions.jsonl"
    argv = ["--steps", "5", "--leave-step", "2", "--decision-log", str(log), "--quiet", "--timeout", "30"]
    results = run_local(w.run, 4, argv, timeout=240)

    made, applied = decisions(log)
    moves = [d for d in made if d["action"] == "transition"]
    assert [(d["step"], d["forced"]) for d in moves] == [(0, False), (2, True)], moves
    assert moves[0]["numbers"]["admission"] == "accept" and moves[0]["triggers"][0]["kind"] == "response_length"
    assert any(t["kind"] == "gpus_leaving" for t in moves[1]["triggers"])
    assert [d["applied"] for d in applied] == ["transition", "transition"], applied
    # after each move, the step time predicted for plan B beside the first step measured under it
    outcomes = [json.loads(line) for line in log.read_text().splitlines() if "after_move" in json.loads(line)]
    assert [(o["step"], o["plan"]) for o in outcomes] == [(1, "p0"), (3, "p2")], outcomes
    for o in outcomes:
        after = o["after_move"]
        assert after["predicted_s"] > 0 and after["measured_s"] > 0, o
        assert sorted(after["stages"]) == ["actor.train", "ref.infer"], o
        assert all(v["predicted_s"] > 0 and v["measured_s"] > 0 for v in after["stages"].values()), o
    # each applied move names the model-stages it changes, both models, with their layouts before and after
    # (the search moves the actor into FSDP2, ZeRO-3, then onto the two ranks whose rows DP divides)
    assert applied[0]["changes"] == {
        "actor.train": {"before": "TP 2 x PP 1 x DP 2 on 0..3", "after": "TP 1 x PP 1 x DP 4 on 0, 2, 1, 3, ZeRO-3"},
        "ref.infer": {"before": "TP 2 x PP 1 x DP 2 on 0..3", "after": "TP 1 x PP 1 x DP 4 on 0, 2, 1, 3"},
    }
    assert applied[1]["changes"] == {
        "actor.train": {
            "before": "TP 1 x PP 1 x DP 4 on 0, 2, 1, 3, ZeRO-3",
            "after": "TP 1 x PP 1 x DP 2 on 0, 1, ZeRO-3",
        },
        "ref.infer": {"before": "TP 1 x PP 1 x DP 4 on 0, 2, 1, 3", "after": "TP 1 x PP 1 x DP 3 on 2, 0, 1"},
    }

    for res in results:
        # every rank checked both moves, per model: its plan B state is the gathered full state, re-sliced
        assert [(c["source"], c["target"]) for c in res["checks"]] == [("a", "p0"), ("p0", "p2")], res["checks"]
        for c in res["checks"]:
            assert sorted(c["models"]) == ["actor.train", "ref.infer"], c
            if c["models"]["actor.train"]["in_b"]:
                assert c["steps_b"]["actor.train"] == c["steps_a"]["actor.train"] > 0, c
            assert c["steps_b"]["ref.infer"] == c["steps_a"]["ref.infer"] == 0, c  # frozen: no optimizer
            for ms, model in c["models"].items():
                if model["in_b"]:
                    assert model["keys"] and model["same_keys"] and model["exact"], (ms, c)
            if c["models"]["actor.train"]["in_b"]:  # the actor moves its AdamW moments, the reference weights only
                assert c["models"]["actor.train"]["states"] == ["exp_avg", "exp_avg_sq", "master", "weight"], c
                assert c["models"]["ref.infer"]["states"] == ["weight"], c
        steps = [h["step"] for h in res["history"]]
        assert all(
            (h["loss"] is None or math.isfinite(h["loss"])) and math.isfinite(h["reward"]) for h in res["history"]
        )
        if res["rank"] == 3:  # it announced at step 2, handed its state over and left
            assert not res["active"] and steps == [0, 1, 2]
            assert not any(m["in_b"] for m in res["checks"][1]["models"].values())
        else:  # the loop went on after each move
            assert res["active"] and steps == [0, 1, 2, 3, 4] and res["plan"] == "p2"
            assert [h["plan"] for h in res["history"]] == [
                "@a tp2xpp1xdp2",
                "@p0 tp1xpp1xdp4 zero3",
                "@p0 tp1xpp1xdp4 zero3",
                "@p2 tp1xpp1xdp2 zero3",
                "@p2 tp1xpp1xdp2 zero3",
            ]
            assert res["history"][1]["layouts"] == "actor.train tp1xpp1xdp4 zero3, ref.infer tp1xpp1xdp4"
    # the DP replicas agree on the loss and the reward (one mean over DP) on every step
    for step in range(5):
        seen = {
            (h["loss"], h["reward"])
            for r in results
            for h in r["history"]
            if h["step"] == step and h["loss"] is not None
        }
        assert len(seen) == 1, (step, seen)


@pytest.mark.slow
def test_a_move_that_fails_rolls_back_and_grpo_goes_on_under_plan_a(tmp_path):
    log = tmp_path / "decisions.jsonl"
    argv = ["--steps", "3", "--leave-step", "-1", "--decision-log", str(log), "--quiet", "--timeout", "6"]
    results = run_local(w.run, 4, argv, "grpo_tiny", 1, timeout=240)
    made, applied = decisions(log)
    assert [d["applied"] for d in applied] == ["rolled_back"] and applied[0]["step"] == 0, applied
    for res in results:
        assert [h["decision"] for h in res["history"]] == ["rolled_back", "stay", "stay"], res["history"]
        assert [h["plan"] for h in res["history"]] == ["@a tp2xpp1xdp2"] * 3 and res["plan"] == "a" and res["active"]
        (check,) = res["checks"]
        assert check["failed"] and check["intact"], check  # plan A's model and AdamW untouched
        assert all(math.isfinite(h["loss"]) for h in res["history"])


@pytest.mark.slow
def test_grpo_with_the_actor_under_fsdp2_moves_out_of_it_exactly(tmp_path):
    """The actor starts under FSDP2 composed with TP (``--zero 3``: TP 2 x DP 2, 2-D); the
    Controller's admitted and forced moves take it (and the reference) elsewhere, every model
    bit-identical to its gathered, re-sliced state after each move; the search only proposes
    ZeRO stages the live model runs (0 or 3)."""
    log = tmp_path / "decisions.jsonl"
    argv = ["--steps", "4", "--leave-step", "1", "--zero", "3", "--decision-log", str(log), "--quiet"]
    results = run_local(w.run, 4, argv + ["--timeout", "30"], timeout=240)
    made, applied = decisions(log)
    assert [d["applied"] for d in applied] == ["transition", "transition"], applied
    assert applied[0]["changes"]["actor.train"]["before"] == "TP 2 x PP 1 x DP 2 on 0..3, ZeRO-3"
    for d in made:
        for lay in d.get("numbers", {}).get("layouts", {}).values():
            assert "ZeRO-1" not in lay and "ZeRO-2" not in lay, lay
    for res in results:
        assert res["history"][0]["layouts"].startswith("actor.train tp2xpp1xdp2 zero3"), res["history"][0]
        assert len(res["checks"]) == 2
        for check in res["checks"]:
            assert all(m["exact"] and m["same_keys"] for m in check["models"].values() if m["in_b"]), check
        assert all(math.isfinite(h["loss"]) for h in res["history"] if h["loss"] is not None)


@pytest.mark.slow
def test_grpo_shrinks_twice_and_goes_on_moving_on_the_world_and_in_a_callers_group(tmp_path):
    """Ranks 3, then 2, announce they leave: 4 -> 3 -> 2 ranks in one run. After each shrink the
    group is re-formed over the ranks that remain (``runtime.regroup.reform``: the job's store,
    the same processes) and every model is rebuilt there with its state in place, so the next
    move runs like the first; every model bit-exact after every move and every re-formation.

    Then the same job in a caller's world of 5 (``main(group=)``): ranks 1-4 run it in a process
    group of their own, which the Controller, the models and every move stay inside (its shrinks
    make groups of that group's ranks), while rank 0 all-reduces with rank 1 before and after on a
    group of the world. The same decisions, bit-exact moves, and the same loss at every step."""
    argv = ["--steps", "5", "--leave-step", "1,3", "--quiet", "--timeout", "30"]
    losses = []
    for where in ("world", "group"):
        log = tmp_path / f"decisions-{where}.jsonl"
        args = argv + ["--decision-log", str(log)]
        if where == "world":
            results = run_local(w.run, 4, args, timeout=240)
        else:
            everyone = run_local(w.run_in_group, 5, args, timeout=240)
            assert everyone[0]["hello"] == everyone[1]["hello"] == 3.0  # the world's own group, beside the job
            assert everyone[0]["bye"] == everyone[1]["bye"] == everyone[1]["history"][-1]["loss"]
            results = everyone[1:]
        _shrank_twice(log, results)
        losses.append(_one_loss_per_step(results))
    assert losses[0] == losses[1]  # the job in a caller's group trains exactly as on the whole world


def _shrank_twice(log, results: list) -> None:
    made, applied = decisions(log)
    assert [(d["step"], d["applied"]) for d in applied] == [(0, "transition"), (1, "transition"), (3, "transition")]
    assert [d["numbers"].get("regroup_gpus") for d in applied] == [None, [0, 1, 2], [0, 1]], applied
    assert [d["forced"] for d in made if d["action"] == "transition"] == [False, True, True]
    by_rank = {r["rank"]: r for r in results}
    assert [by_rank[r]["active"] for r in range(4)] == [True, True, False, False]
    assert [[h["step"] for h in by_rank[r]["history"]] for r in range(4)] == [
        [0, 1, 2, 3, 4],
        [0, 1, 2, 3, 4],
        [0, 1, 2, 3],
        [0, 1],
    ]
    assert [len(by_rank[r]["regroup_checks"]) for r in range(4)] == [2, 2, 1, 0]
    for res in results:
        for c in res["regroup_checks"]:
            assert c["keys"] and c["same_keys"] and c["exact"] and c["steps"], c
        assert len(res["checks"]) == {0: 3, 1: 3, 2: 3, 3: 2}[res["rank"]]  # a leaver hands its state over
        for c in res["checks"]:
            assert all(m["exact"] and m["same_keys"] for m in c["models"].values() if m["in_b"]), c
        assert all(h["loss"] is None or math.isfinite(h["loss"]) for h in res["history"])


def _one_loss_per_step(results: list) -> list[float]:
    """The actor's loss at each step, one value over its DP ranks (every rank that trained agrees)."""
    losses = []
    for step in range(max(len(r["history"]) for r in results if r)):
        seen = {h["loss"] for r in results if r for h in r["history"] if h["step"] == step and h["loss"] is not None}
        assert len(seen) == 1, (step, seen)
        losses.append(seen.pop())
    return losses


@pytest.mark.slow
def test_a_rank_killed_mid_step_the_survivors_move_its_state_and_run_the_step_again(tmp_path):
    """Rank 3 dies by SIGKILL in the middle of step 0 (after its rollout, before the update),
    unannounced. The others' next collective breaks; they agree through the job's store who is
    alive (``runtime.liveness``), re-form the default group over GPUs 0-2 and move every model to a
    plan on them, rank 3's shards coming from its DP replicas: each survivor's state bit-exact
    against the survivors' full state gathered and re-sliced. Step 0 runs again, and the losses
    are those of a run where nothing died (the failed step changed no weight)."""
    log = tmp_path / "decisions.jsonl"
    base = ["--steps", "3", "--leave-step", "-1", "--quiet", "--timeout", "30", "--pg-timeout", "10"]
    results = run_local(w.run, 4, base + ["--kill-step", "0", "--decision-log", str(log)], timeout=240, dies=(3,))
    made, applied = decisions(log)
    assert [(d["step"], d["applied"]) for d in applied] == [(0, "transition")], applied
    (recovery,) = applied
    assert recovery["numbers"]["failed_gpus"] == [3] and recovery["numbers"]["regroup_gpus"] == [0, 1, 2]
    assert made[0]["triggers"][0]["kind"] == "gpus_lost" and made[0]["forced"]
    survivors = [r for r in results if r is not None]
    assert [r["rank"] for r in survivors] == [0, 1, 2] and results[3] is None
    for res in survivors:
        assert [h["step"] for h in res["history"]] == [0, 1, 2] and res["active"]
        assert [f["gpus"] for f in res["failures"]] == [[3]]
        (check,) = res["checks"]  # the move to the survivors, checked against their gathered state
        assert all(m["exact"] and m["same_keys"] for m in check["models"].values() if m["in_b"]), check
        assert "engines" not in res["history"][0]
    reference = run_local(w.run, 4, base + ["--stay"], timeout=240)
    ours, theirs = _one_loss_per_step(survivors), _one_loss_per_step(reference)
    assert ours == pytest.approx(theirs, rel=1e-4, abs=1e-7), (ours, theirs)


@pytest.mark.slow
def test_a_rank_killed_mid_transition_rolls_back_then_the_survivors_move(tmp_path):
    """Rank 3 dies by SIGKILL in the first round of the step-0 move (admitted on drift): the move
    rolls back on the survivors (plan A's state intact, checked), then they move from plan A to a
    plan on GPUs 0-2, bit-exact, and step 0 runs again."""
    log = tmp_path / "decisions.jsonl"
    argv = ["--steps", "2", "--leave-step", "-1", "--quiet", "--timeout", "30", "--pg-timeout", "10"]
    results = run_local(w.run, 4, argv + ["--decision-log", str(log)], "grpo_tiny", 3, "kill", timeout=240, dies=(3,))
    made, applied = decisions(log)
    assert [(d["step"], d["applied"]) for d in applied] == [(0, "rolled_back"), (0, "transition")], applied
    assert applied[1]["numbers"]["failed_gpus"] == [3] and applied[1]["numbers"]["regroup_gpus"] == [0, 1, 2]
    for res in results[:3]:
        rollback, moved = res["checks"]
        assert rollback["failed"] and rollback["intact"], rollback
        assert rollback["source"] == moved["source"] == "a"
        assert all(m["exact"] and m["same_keys"] for m in moved["models"].values() if m["in_b"]), moved
        assert [h["step"] for h in res["history"]] == [0, 1] and res["active"]
        assert all(h["loss"] is None or math.isfinite(h["loss"]) for h in res["history"])
    assert results[3] is None


@pytest.mark.slow
def test_a_process_joins_the_running_job_and_receives_its_state_by_a_transition(tmp_path):
    """The job starts on 3 ranks of a 4-GPU cluster (``--gpus 4``); a fourth process asks to join
    (``Controller.join``: a ticket in the job's store). At step 0's end the job admits it as GPU 3,
    the default group is re-formed with it, and the decision (``gpus_joined``) moves both models
    to a plan on the 4 GPUs: the newcomer's shards come from the others' memory by the transition,
    bit-exact against the full state gathered and re-sliced; nothing is read from disk. The
    newcomer then trains with the others (one loss per step over every rank)."""
    log = tmp_path / "decisions.jsonl"
    argv = ["--steps", "3", "--leave-step", "-1", "--stay", "--tp", "1", "--dp", "3", "--gpus", "4"]
    argv += ["--quiet", "--timeout", "30", "--pg-timeout", "20", "--decision-log", str(log)]
    results = run_local(w.run_join, 3, argv, timeout=240, joiners=1)
    made, applied = decisions(log)
    assert [(d["step"], d["applied"]) for d in applied] == [(0, "transition")], applied
    assert made[0]["triggers"][0]["kind"] == "gpus_joined" and made[0]["numbers"]["gpus_used"] == [0, 1, 2, 3]
    assert [r["gpu"] for r in results] == [0, 1, 2, 3]
    for res in results:
        assert res["joins"] == [{"step": 0, "gpus": [3], "admit_s": res["joins"][0]["admit_s"]}]
        (check,) = res["checks"]
        assert all(m["exact"] and m["same_keys"] and m["keys"] for m in check["models"].values() if m["in_b"]), check
        assert check["models"]["actor.train"]["in_b"]  # every GPU trains the actor under plan B
    joiner = results[3]
    assert [h["step"] for h in joiner["history"]] == [1, 2] and joiner["active"]
    assert [h["step"] for h in results[0]["history"]] == [0, 1, 2]
    _one_loss_per_step(results)


@pytest.mark.slow
def test_a_zero_shard_lost_with_its_rank_comes_back_from_the_checkpoint_and_only_it(tmp_path):
    """The actor runs under FSDP2 over 4 ranks (ZeRO-3: each rank alone holds its quarter of the
    weights and Adam moments) and the job saves a DCP checkpoint after every step. Rank 3 dies by
    SIGKILL in step 2: its quarter is nowhere in live memory. The transition to the survivors is
    planned with ``restore``: every byte a survivor holds moves from memory, and only what the dead
    rank alone held is read from the checkpoint (``restored`` = the lower bound less the bytes
    moved, listed tensor by tensor in the decision log). Each survivor's plan-B state equals the
    survivors' gathered state with the lost quarter from the checkpoint, which agrees with the
    survivors wherever they held the state; the losses are those of a run where nothing died."""
    log, ckpt = tmp_path / "decisions.jsonl", tmp_path / "ckpt"
    base = ["--steps", "4", "--leave-step", "-1", "--stay", "--tp", "1", "--dp", "4", "--zero", "3"]
    base += ["--quiet", "--timeout", "30", "--pg-timeout", "10"]
    argv = base + ["--kill-step", "2", "--checkpoint-every", "1", "--checkpoint-dir", str(ckpt)]
    results = run_local(w.run, 4, argv + ["--decision-log", str(log)], timeout=240, dies=(3,))
    made, applied = decisions(log)
    (moved,) = applied
    n = moved["numbers"]
    assert moved["step"] == 2 and n["failed_gpus"] == [3] and n["restored_from"] == str(ckpt / "step_2")
    assert n["restored"] > 0 and n["bytes_moved"] + n["restored"] == n["lower_bound"], n
    assert sum(n["restored_tensors"].values()) == n["restored"]
    assert {name.split(":")[0] for name in n["restored_tensors"]} == {"actor.train"}  # the reference is replicated
    assert {name.split(":")[1] for name in n["restored_tensors"]} == {"weight", "master", "exp_avg", "exp_avg_sq"}
    for res in results[:3]:
        (check,) = res["checks"]
        assert check["checkpoint_agrees"], check
        assert all(m["exact"] and m["same_keys"] for m in check["models"].values() if m["in_b"]), check
        assert [h["step"] for h in res["history"]] == [0, 1, 2, 3]
    assert results[3] is None
    reference = run_local(w.run, 4, base, timeout=240)
    assert _one_loss_per_step(results[:3]) == pytest.approx(_one_loss_per_step(reference), rel=1e-4, abs=1e-7)
