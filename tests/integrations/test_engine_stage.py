"""The generation engines as a model-stage, without starting one: the layouts vLLM refuses are
diagnostics naming ``actor.generate`` (before any state moves), and the trainer's part of a
whole-job transition neither reads from nor writes to the engines' shards."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from nereus.integrations.engine_stage import check_engine_layout
from nereus.integrations.hf_llama import ir_model
from nereus.integrations.job import layout, restrict, rl_job
from nereus.integrations.move import plan_move
from nereus.ir import DiagnosticError

CFG = LlamaConfig(
    vocab_size=16,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    tie_word_embeddings=False,
)


def job(gen, world: int = 4):
    actor = ir_model(CFG, "actor")
    train = layout(actor, tp=2, dp=world // 2) if world % 2 == 0 else layout(actor, dp=world)
    b = [layout(actor, dp=world), layout(actor, tp=1, dp=world, stage="generate")]
    return rl_job([actor], {"a": [train, gen(actor)], "b": b}, world)


def refusal(gen, world: int = 4) -> str:
    m = job(gen, world)
    with pytest.raises(DiagnosticError) as e:
        check_engine_layout(m, "a", "actor.generate", world)
    (d,) = e.value.diagnostics
    assert d.message.startswith("plan @a actor.generate: "), d.message
    return d.message


def test_layouts_vllm_engines_take_pass():
    for tp, dp in ((1, 4), (2, 2), (2, 1), (4, 1)):
        check_engine_layout(
            job(lambda a, tp=tp, dp=dp: layout(a, tp=tp, dp=dp, stage="generate")), "a", "actor.generate", 4
        )


def test_pipeline_stages_are_refused():
    assert "pp = 2" in refusal(lambda a: layout(a, pp=2, dp=2, stage="generate"))


def test_a_tp_that_does_not_divide_the_job_is_refused():
    assert "does not divide the job's 3 ranks" in refusal(lambda a: layout(a, tp=2, dp=1, stage="generate"), world=3)


def test_a_tp_group_off_vllms_rank_blocks_is_refused():
    msg = refusal(lambda a: layout(a, tp=2, dp=1, mesh=[1, 2], stage="generate"))
    assert "TP group [1, 2] is not an engine" in msg


def test_a_training_stage_is_no_engine():
    m = job(lambda a: layout(a, tp=2, dp=2, stage="generate"))
    with pytest.raises(DiagnosticError, match="vLLM engines serve generate model-stages"):
        check_engine_layout(m, "a", "actor.train", 4)


def test_the_trainers_part_of_a_move_leaves_the_engines_out():
    m = job(lambda a: layout(a, tp=2, dp=2, stage="generate"))
    full = plan_move(m, "a", "b", world=4)
    part_module = restrict(m, {"actor.train"})
    part = plan_move(part_module, "a", "b", world=4)
    ends = {
        e.model_stage
        for op in part_module.transitions["a_to_b"].ops
        for e in op.src + op.dst
        if hasattr(e, "model_stage")
    }
    assert ends == {"actor.train"}
    assert {s.key.model_stage for specs in part.dst.values() for s in specs} == {"actor.train"}
    # the whole job's program also fills the engines' shards, which the engines refill themselves
    assert {s.key.model_stage for specs in full.dst.values() for s in specs} == {"actor.train", "actor.generate"}
    assert set(m.plans["a"].layouts) == {"actor.train", "actor.generate"}  # the job itself is untouched


def test_an_engines_gpus_in_another_order_are_the_same_engine():
    """vLLM cuts each TP rank's shard from the whole weights the push delivers, so the IR's order
    inside an engine's TP group is not the engine's: ``[1, 0]`` is the engine on ranks 0 and 1,
    accepted, and a move to it restarts nothing, while a move to TP 2 on ranks 2 and 3 does."""
    from nereus.passes.transition.admit import fixed_costs

    check_engine_layout(job(lambda a: layout(a, tp=2, dp=1, mesh=[1, 0], stage="generate")), "a", "actor.generate", 4)
    actor = ir_model(CFG, "actor")
    train = layout(actor, tp=2, dp=2)
    gens = {"a": [0, 1, 2, 3], "same": [1, 0, 3, 2], "fewer": [3, 2], "other": [0, 2, 1, 3]}
    m = rl_job(
        [actor], {p: [train, layout(actor, tp=2, dp=len(g) // 2, mesh=g, stage="generate")] for p, g in gens.items()}, 4
    )
    restart = {p: fixed_costs(m, m.plans["a"], m.plans[p], 0.0, 30.0)[1] for p in gens}
    assert restart == {"a": 0.0, "same": 0.0, "fewer": 0.0, "other": 30.0}
