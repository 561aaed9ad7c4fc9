"""What every rank runs in ``test_job_reshard``: three live models of one IR job (the actor and
the critic trained with AdamW, the frozen reference) moved together by ``reshard_job``."""

from __future__ import annotations

import torch
from transformers import LlamaConfig

from nereus.backend.shards import plan_layout
from nereus.integrations.hf_llama import batch, build, forward, ir_model, optimize, train_step
from nereus.integrations.job import layout, rl_job
from nereus.integrations.llama_reshard import reshard_job
from nereus.integrations.llama_state import export_states, load_state
from nereus.integrations.stage_data import rows
from nereus.ir import DiagnosticError
from nereus.runtime.launch import init_from_env
from nereus.runtime.state import cut

from .workers import gather_full, tiny

SEED = 11
ACTOR, CRITIC, REF = "actor.train", "critic.train", "ref.infer"


def job(world: int, plans: dict[str, dict]):
    """The config and the module: per plan, {model-stage: (tp, dp, pp, mesh[, zero])}."""
    config = LlamaConfig(**tiny(kv_heads=2))
    models = {
        "actor": ir_model(config, "actor"),
        "critic": ir_model(config, "critic", head="value"),
        "ref": ir_model(config, "ref", trained=False),
    }

    def lay(ms, tp, dp, pp, mesh, zero=0):
        name, stage = ms.split(".")
        return layout(models[name], tp=tp, dp=dp, pp=pp, mesh=mesh, stage=stage, zero=zero)

    return config, rl_job(
        list(models.values()),
        {plan: [lay(ms, *spec) for ms, spec in layouts.items()] for plan, layouts in plans.items()},
        world,
    )


PLANS = {
    # actor TP 2 x DP 2; critic 2 pipeline stages x DP 2; reference TP 2 on GPUs 2, 3
    "a": {ACTOR: (2, 2, 1, [0, 1, 2, 3]), CRITIC: (1, 2, 2, [0, 1, 2, 3]), REF: (2, 1, 1, [2, 3])},
    # actor DP 4; critic TP 2 on GPUs 2, 3; reference DP 2 on GPUs 0, 1
    "b": {ACTOR: (1, 4, 1, [0, 1, 2, 3]), CRITIC: (2, 1, 1, [2, 3]), REF: (1, 2, 1, [0, 1])},
    # the reference's TP 4 over 2 K/V heads: the IR replicates each K/V head on 2 ranks, which no
    # DTensor placement expresses
    "bad": {ACTOR: (1, 4, 1, [0, 1, 2, 3]), CRITIC: (2, 1, 1, [2, 3]), REF: (4, 1, 1, [0, 1, 2, 3])},
}


# FSDP2 (ZeRO-3) in and out. "in": the actor from DDP under TP 2 x DP 2 to FSDP2 composed with TP
# (2-D: _StridedShard); "out": from FSDP2 over DP 4 to DDP under TP 2 x DP 2. A critic cannot be
# ZeRO-3 over DP 2: its score.weight has one row (a diagnostic, "bad").
FSDP_PLANS = {
    "in": {
        "a": {ACTOR: (2, 2, 1, [0, 1, 2, 3]), CRITIC: (2, 2, 1, [0, 1, 2, 3]), REF: (2, 1, 1, [2, 3])},
        "b": {ACTOR: (2, 2, 1, [0, 1, 2, 3], 3), CRITIC: (1, 2, 1, [0, 1]), REF: (1, 2, 1, [0, 1])},
        "bad": {ACTOR: (1, 4, 1, [0, 1, 2, 3], 2), CRITIC: (1, 2, 1, [0, 1], 3), REF: (1, 2, 1, [0, 1])},
    },
    "out": {
        "a": {ACTOR: (1, 4, 1, [0, 1, 2, 3], 3), CRITIC: (1, 2, 1, [0, 1]), REF: (1, 2, 1, [0, 1])},
        "b": {ACTOR: (2, 2, 1, [0, 1, 2, 3]), CRITIC: (2, 2, 1, [0, 1, 2, 3]), REF: (2, 1, 1, [2, 3])},
        "bad": {ACTOR: (1, 4, 1, [0, 1, 2, 3], 2), CRITIC: (1, 2, 1, [0, 1], 3), REF: (1, 2, 1, [0, 1])},
    },
}


def lives_of(config, module, plan: str, seed: int) -> dict:
    lay = module.plans[plan].layouts
    return {
        ACTOR: build(config, lay[ACTOR], seed=seed, timeout=30),
        CRITIC: build(config, lay[CRITIC], seed=seed + 1, timeout=30, head="value"),
        REF: build(config, lay[REF], seed=seed, timeout=30, trained=False),
    }


def values_loss(values: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return 0.5 * ((values.squeeze(-1) - target) ** 2).mean()


def step(lives: dict, config, s: int) -> dict:
    """One step of every model on the global batch of step ``s``: an AdamW step of the actor (LM
    loss) and of the critic (values regressed on a fixed target), and the reference's logits.
    Each model's replica takes its DP share. None for a model this rank does not hold."""
    tokens = batch(config, s, seed=SEED, rows=4, seq=16)
    out: dict = {ACTOR: None, CRITIC: None, REF: None}
    actor, critic, ref = lives[ACTOR], lives[CRITIC], lives[REF]
    if actor.model is not None:
        out[ACTOR] = train_step(actor, tokens)
    if critic.model is not None:
        mine = tokens[rows(critic, len(tokens))]
        out[CRITIC] = optimize(critic, mine, (mine % 3).float(), values_loss)
    if ref.model is not None:
        out[REF] = forward(ref, tokens[rows(ref, len(tokens))]).sum().item()
    return out


def continuity(rank: int, world: int, k: int = 2, n: int = 2, fsdp: str = "") -> dict:
    """k steps of every model under plan A; a move to @bad (a diagnostic naming ref.infer, nothing
    planned, nothing moved); the move to plan B, checked against the full state gathered and
    re-sliced; then n more steps three ways: the moved models, models restarted under plan B from
    that sliced state, and plan A's models that never moved."""
    init_from_env(timeout=60)
    config, module = job(world, FSDP_PLANS[fsdp] if fsdp else PLANS)
    lives = lives_of(config, module, "a", SEED)
    for s in range(k):
        step(lives, config, s)
    state_a, steps_a = export_states(lives, module, "a")
    full = gather_full(state_a, plan_layout(module, "a").get(rank, []))
    out: dict = {"diagnostic": None}
    planned = sorted(module.transitions)
    try:
        reshard_job(lives, module, "a", "bad", timeout=30)
    except DiagnosticError as e:
        out["diagnostic"] = str(e)
    out["b_specs"] = [
        (s.key.model_stage, s.key.state, s.key.tensor, s.shape, tuple(s.box))
        for s in plan_layout(module, "b").get(rank, [])
    ]
    out["nothing_planned"] = sorted(module.transitions) == planned
    after, _ = export_states(lives, module, "a")
    out["intact"] = set(after) == set(state_a) and all(torch.equal(after[key], v) for key, v in state_a.items())

    moved = reshard_job(lives, module, "a", "b", timeout=30, seed=SEED + 5)  # another init: values come from A
    state_b, steps_b = export_states(moved, module, "b")
    specs = plan_layout(module, "b").get(rank, [])
    out["keys"] = sorted({(s.key.model_stage, s.key.state) for s in specs})
    out["same_keys"] = set(state_b) == {s.key for s in specs}
    out["exact"] = [str(s.key) for s in specs if not torch.equal(state_b[s.key], cut(full[s.key], s.box))]
    steps_all = torch.tensor([max(v, 0) for v in steps_a.values()], dtype=torch.int64)
    torch.distributed.all_reduce(steps_all, op=torch.distributed.ReduceOp.MAX)
    out["steps"] = (dict(zip(steps_a, steps_all.tolist())), steps_b)

    restart = lives_of(config, module, "b", SEED + 9)
    sliced = {s.key: cut(full[s.key], s.box).clone() for s in specs}
    for ms, live in restart.items():
        load_state(live, module, "b", sliced, int(steps_all[list(steps_a).index(ms)]))
    out["moved"] = [step(moved, config, s) for s in range(k, k + n)]
    out["restart"] = [step(restart, config, s) for s in range(k, k + n)]
    out["stay"] = [step(lives, config, s) for s in range(k, k + n)]
    return out
