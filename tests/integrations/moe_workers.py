"""Worker of ``test_moe_push.py``: a tiny Hugging Face Qwen3-MoE (transformers' own model, built
from a config and seeded) on rank 0, a vLLM engine and a trainer-side generation model on every
rank, the weights pushed by a Nereus transition of the IR's MoE inventory (every expert a
family, under its checkpoint name)."""

from __future__ import annotations

import torch

from nereus.runtime.launch import init_from_env

CONFIG = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # vLLM's CPU attention needs >= 32
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    max_position_embeddings=128,
)
SEQS = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12, 13]]


def logprobs_hf(model, seqs):
    with torch.no_grad():
        out = []
        for q in seqs:
            lp = model(torch.tensor([q])).logits[0, :-1].float().log_softmax(-1)
            out.append(lp[torch.arange(len(q) - 1), torch.tensor(q[1:])].tolist())
        return out


def gap(a, b) -> float:
    return max(abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v))


def push_moe(rank: int, world: int, workdir: str) -> dict:
    """Rank 0 holds the trained model (seed 0); every rank has a vLLM engine (dummy weights) and a
    trainer-side generation model of its own (seed 1 + rank). The push brings every rank the
    model's tensors under their checkpoint names; they are loaded into both."""
    init_from_env(timeout=300)
    from transformers import AutoConfig, AutoModelForCausalLM

    from nereus.integrations.hf_checkpoint import checkpoint_params
    from nereus.integrations.vllm_engine import VllmEngine
    from nereus.integrations.weight_push import WeightPush, hf_name
    from nereus.ir import Layout
    from nereus.ir.hf_config import model_from_hf_config

    cfg = AutoConfig.for_model("qwen3_moe", **CONFIG)
    ir = model_from_hf_config(cfg.to_dict(), "actor")
    ir.dtype = "fp32"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)  # every rank builds it: the reference
    torch.manual_seed(1 + rank)
    generator = AutoModelForCausalLM.from_config(cfg)  # the trainer-side generation model, other weights
    engine = VllmEngine(cfg, f"{workdir}/engine-{rank}", max_model_len=64)
    held = Layout(model_stage="actor.train", tp=1, pp=1, dp=1, layers=[(0, ir.layers - 1)], mesh=[0])
    push = WeightPush(ir, held, list(range(world)), world, timeout=120)
    want = checkpoint_params(model, ir)
    pushed = push.push_state(push.state_of_params(want) if rank == 0 else {})
    names = [k.removeprefix("model.") for k in pushed]  # IR names
    exact = sorted(names) == sorted(want) and all(torch.equal(pushed[hf_name(n)], want[n]) for n in names)
    reference = logprobs_hf(model, SEQS)
    before = logprobs_hf(generator, SEQS)
    with torch.no_grad():  # into the generation model's own (fused) parameters, through their checkpoint views
        views = checkpoint_params(generator, ir)
        for n in names:
            views[n].copy_(pushed[hf_name(n)])
    after = logprobs_hf(generator, SEQS)
    engine.load(pushed)
    served = engine.score(SEQS)
    engine.close()
    return {
        "rank": rank,
        "exact": exact,
        "tensors": len(pushed),
        "inventory": sum(ir.layers if s.per_layer else 1 for s in ir.tensors.values()),
        "received": push.stats.bytes_received,
        "model_bytes": sum(t.numel() * t.element_size() for t in want.values()),
        "generator_before": gap(before, reference),
        "generator_after": gap(after, reference),
        "engine_gap": gap(served, reference),
    }
