"""vLLM as the generation engine: the actor's weights pushed from the trainer's layout into a live
vLLM engine on every rank by a Nereus transition (no checkpoint files), vLLM's log-probabilities
against the trainer's forward pass, an optimizer step followed only after the next push, a
failed push leaving the engine on the old weights, the push with the engine's load behind it
(``push_into``: the same tensors, a failure that leaves the engine torn and refusing to serve, the
retry), and GRPO with ``--engine vllm``."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("vllm")

from transformers import LlamaConfig  # noqa: E402

from nereus.integrations.vllm_engine import check_engine  # noqa: E402
from nereus.ir import DiagnosticError  # noqa: E402
from nereus.runtime.launch import free_port, run_local  # noqa: E402

from . import grpo_workers as gw  # noqa: E402
from . import vllm_workers as w  # noqa: E402

# vLLM's CPU kernels and PyTorch's sum in other orders (fused QKV and gate/up projections,
# their attention): the same float32 weights give log-probabilities a few ulps of the logits
# apart. Observed: up to 5e-7; allowed: 2e-5.
LOGP_ATOL = 2e-5


@pytest.fixture(scope="module")
def pushed(tmp_path_factory):
    """2 processes: the trainer under TP 2, an engine on each rank."""
    return run_local(w.push_and_score, 2, 2, str(tmp_path_factory.mktemp("engines")), timeout=600)


@pytest.mark.slow
def test_each_engine_receives_exactly_the_bytes_it_lacks(pushed):
    for r in pushed:
        assert r["received"] == r["lower_bound"] > 0, r
    assert pushed[0]["planned_bytes"] == sum(r["lower_bound"] for r in pushed)


@pytest.mark.slow
def test_vllm_logprobs_equal_the_trainers_after_a_push(pushed):
    for r in pushed:
        assert r["sampled_diff"] <= LOGP_ATOL, r
        assert r["score_diff_before"] <= LOGP_ATOL, r


@pytest.mark.slow
def test_an_optimizer_step_reaches_the_engine_with_the_next_push_and_not_before(pushed):
    for r in pushed:
        assert r["stale_equal_before"], "the engine changed before the push"
        assert r["moved"] > 1e-4, r  # the update changed what the engine serves
        assert r["score_diff_after"] <= LOGP_ATOL, r


@pytest.mark.slow
def test_a_failed_push_leaves_the_engine_on_the_old_weights(pushed):
    for r in pushed:
        assert r["failed_push"] and "injected fault on rank 1" in pushed[1]["failed_push"]
        assert r["kept"]


@pytest.fixture(scope="module")
def streamed(tmp_path_factory):
    """2 processes: the trainer under TP 2, an engine on each rank, pushes with ``push_into``."""
    return run_local(w.stream_and_score, 2, 2, str(tmp_path_factory.mktemp("streams")), free_port(), timeout=600)


@pytest.mark.slow
def test_the_push_with_the_load_behind_it_delivers_the_plain_pushs_tensors(streamed):
    for r in streamed:
        assert r["rounds"] == r["waves"] == 4  # the embedding, two layers, the head: one round each
        assert r["same_tensors"] and r["received"] == r["lower_bound"] > 0, r
        assert r["moved"] > 1e-4 and r["score_diff"] <= LOGP_ATOL, r
        assert r["same_served"], "the streamed load serves other log-probabilities than a whole load"


@pytest.mark.slow
def test_a_streamed_push_that_fails_leaves_the_engine_torn_until_a_push_completes(streamed):
    for r in streamed:
        assert r["failed_push"] and "injected fault on rank 1 in round 2" in streamed[1]["failed_push"]
        assert r["torn"] and "torn" in r["refused"]  # it took waves 0 and 1: it will not serve the mix
        assert 0 < r["taken"] < r["tensors"], r
        assert not r["torn_after_retry"] and r["retry_diff"] <= LOGP_ATOL, r


@pytest.mark.slow
def test_a_streamed_push_that_fails_before_the_first_wave_leaves_the_engine_serving(streamed):
    for r in streamed:
        assert r["bad_state"], r
    assert "the state has no" in streamed[1]["bad_state"]
    assert streamed[1]["bad_state_taken"] == 0 and streamed[1]["bad_state_serves_on"]
    assert streamed[0]["bad_state_taken"] > 0 and streamed[0]["bad_state_torn"]


def test_models_vllm_cpu_cannot_serve_are_diagnostics():
    with pytest.raises(DiagnosticError, match="head_dim >= 32"):
        check_engine(LlamaConfig(**{**w.config(), "head_dim": 16}))
    check_engine(LlamaConfig(**w.config()))


@pytest.mark.slow
def test_grpo_engines_are_a_model_stage_the_controller_moves(tmp_path):
    """GRPO on 4 processes, generation by vLLM engines of TP 4 (``actor.generate``). Step 0: an
    admitted move of the trainer and the reference that keeps the engines (restarting them costs
    the seconds measured at their start, which the saving cannot pay). Step 1: rank 3 leaves, the
    forced move restarts the engines under TP 1 on the 3 ranks that remain. Every step the
    engines sampled with exactly the actor's weights (vLLM's log-probabilities equal the
    trainer's), across the restart and the push on the shrunk group too."""
    log = tmp_path / "decisions.jsonl"
    argv = ["--steps", "3", "--leave-step", "1", "--quiet", "--timeout", "60", "--engine", "vllm", "--gen-tp", "4"]
    argv += ["--workdir", str(tmp_path), "--decision-log", str(log)]
    results = run_local(gw.run, 4, argv, timeout=600)
    stays = [r for r in results if r["active"]]
    assert [r["rank"] for r in stays] == [0, 1, 2]
    for res in stays:
        hist = res["history"]
        assert [h["step"] for h in hist] == [0, 1, 2]
        assert [h["decision"] for h in hist[:2]] == ["transition", "transition"] and hist[1]["forced"]
        assert [h["engines"] for h in hist] == ["tp4xpp1xdp1", "tp1xpp1xdp3", "tp1xpp1xdp3"]
        assert len(hist[0]["engine_starts"]) == 1 and len(hist[-1]["engine_starts"]) == 2  # one restart
        for h in hist:  # the loss: None on a rank that holds no actor replica (FSDP2 on 2 of 3 ranks)
            assert (h["loss"] is None or math.isfinite(h["loss"])) and h["push_s"] > 0 and h["load_s"] > 0
            assert h["streamed"] > 0  # the engine loaded the waves as they landed, behind the push
            assert h["engine_gap"] <= LOGP_ATOL, h  # the engines served the actor's weights
    for step in range(3):
        assert any(h["loss"] is not None for r in stays for h in r["history"] if h["step"] == step), step
        assert all(m["exact"] for c in res["checks"] for m in c["models"].values() if m["in_b"])
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    admitted, forced = (x for x in lines if x.get("action") == "transition")
    assert admitted["numbers"]["engines"] == "kept" and "engines kept" in admitted["message"]
    # the engine on ranks 0..3, in remap's order (the trainer under FSDP2 on 0, 2, 1, 3): the same engine
    assert admitted["numbers"]["layouts"]["actor.generate"] == "TP 4 x PP 1 x DP 1 on 0, 2, 1, 3"
    assert admitted["numbers"]["layouts"]["actor.train"] == "TP 1 x PP 1 x DP 4 on 0, 2, 1, 3, ZeRO-3"
    # the forced move's cost counts the restart as measured at the engines' first start
    first_start = stays[0]["history"][0]["engine_starts"][0]
    n = forced["numbers"]
    assert n["admission"] == "forced" and abs(n["cost"] - n["makespan"] - first_start) <= 0.02, (n, first_start)
    applied = [x for x in lines if x.get("applied") == "transition"]
    assert applied[0]["changes"]["actor.generate"] == {  # the same engine, its ranks listed anew
        "before": "TP 4 x PP 1 x DP 1 on 0..3",
        "after": "TP 4 x PP 1 x DP 1 on 0, 2, 1, 3",
    }
    assert applied[1]["changes"]["actor.generate"] == {
        "before": "TP 4 x PP 1 x DP 1 on 0, 2, 1, 3",
        "after": "TP 1 x PP 1 x DP 3 on 2, 0, 1",
    }


@pytest.mark.slow
def test_ppo_engines_kept_then_restarted_with_actor_critic_and_reference(tmp_path, reward_model):
    """PPO on 4 processes with engines of TP 2 x DP 2: the admitted move places actor and critic
    apart and keeps the engines, the leave's forced move restarts them under TP 1 on 3 ranks;
    every model bit-exact after each move, the engines serving the actor's weights throughout."""
    argv = ["--steps", "3", "--leave-step", "1", "--quiet", "--timeout", "60", "--engine", "vllm", "--gen-tp", "2"]
    argv += ["--workdir", str(tmp_path), "--reward-model", str(reward_model[0])]
    results = run_local(gw.run, 4, argv, "ppo_tiny", timeout=600)
    stays = [r for r in results if r["active"]]
    assert [r["rank"] for r in stays] == [0, 1, 2]
    for res in stays:
        hist = res["history"]
        assert [h["decision"] for h in hist] == ["transition", "transition", "stay"] and hist[1]["forced"]
        assert [h["engines"] for h in hist] == ["tp2xpp1xdp2", "tp1xpp1xdp3", "tp1xpp1xdp3"]
        assert [len(h["engine_starts"]) for h in hist] == [1, 2, 2]
        assert all(h["engine_gap"] <= LOGP_ATOL for h in hist), [h["engine_gap"] for h in hist]
        checks = res["checks"]
        assert len(checks) == 2 and all(m["exact"] for c in checks for m in c["models"].values() if m["in_b"])
        assert set(checks[0]["models"]) == {"actor.train", "critic.train", "ref.infer", "reward.infer"}


def test_stale_shared_memory_of_a_killed_engine_is_cleared_and_a_live_one_kept(tmp_path):
    """vLLM's CPU TP segments are named alike on every run: a leftover of a killed rank is
    removed before an engine starts; a segment some process still maps is not."""
    import mmap

    from nereus.integrations.vllm_engine import clear_stale_shm

    stale = tmp_path / "-tp:0-[0-1]-cpushm_0"
    live = tmp_path / "-tp:0-[0-1]-cpushm_1"
    other = tmp_path / "unrelated"
    for p in (stale, live, other):
        p.write_bytes(b"\0" * 4096)
    with live.open("r+b") as f, mmap.mmap(f.fileno(), 4096):
        assert clear_stale_shm(tmp_path) == [stale.name]
    assert not stale.exists() and live.exists() and other.exists()
