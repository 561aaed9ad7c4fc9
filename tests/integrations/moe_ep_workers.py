"""Worker of ``test_moe_expert_parallel.py``: a tiny Hugging Face Qwen3-MoE (transformers' own
model from a config, seeded) trained on 4 gloo processes with expert parallelism (``LiveMoe``:
token dispatch by ``all_to_all_single``), its state moved by one Nereus transition from EP 4 to
EP 2 x expert-DP 2, then trained on. Every rank also trains the unsplit model on the whole global
batch by itself: the reference the EP losses must follow, before and after the move."""

from __future__ import annotations

import torch
import torch.distributed as dist

CONFIG = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    max_position_embeddings=64,
    norm_topk_prob=True,
)
STEPS_A, STEPS_B, LR = 3, 3, 1e-2


def batch(step: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s batch: the same at every step, so that the loss falls as it learns it."""
    g = torch.Generator().manual_seed(rank)
    return torch.randint(0, CONFIG["vocab_size"], (2, 12), generator=g)


def module(ir, world: int):
    """The job as IR: plan @a trains with EP 4, plan @b with EP 2 (expert-DP 2)."""
    from nereus.ir import Cluster, Layout, Link, Module, Plan, Stage, Workload

    GIB = 2**30

    c = Cluster(
        name="c",
        nodes=1,
        gpus_per_node=world,
        gpu_memory=80 * GIB,
        peak_flops=1e15,
        hbm_bandwidth=3e12,
        intra_node=Link(450e9, 2e-6),
        inter_node=Link(50e9, 5e-6),
    )
    w = Workload(
        name="w",
        algorithm="sft",
        roles=["actor"],
        global_batch=2 * world,
        prompt_len_mean=6,
        prompt_len_max=6,
        response_len_mean=6,
        response_len_max=6,
        micro_batch=2,
        stages=[Stage(name="train", kind="train", models=["actor"])],
    )
    m = Module(clusters={"c": c}, models={"actor": ir}, workloads={"w": w})
    for name, ep in (("a", 4), ("b", 2)):
        lay = Layout(
            model_stage="actor.train", tp=1, pp=1, dp=world, layers=[(0, ir.layers - 1)], mesh=list(range(world)), ep=ep
        )
        lay.etp = 1
        m.plans[name] = Plan(name=name, workload="w", cluster="c", layouts={"actor.train": lay})
    return m


def gathered(live) -> dict[str, torch.Tensor]:
    """Every layer's full fused experts (weights and Adam's moments), gathered from the EP group."""
    out = {}
    ep = len(live.experts[0].bounds)
    for i, block in enumerate(live.experts):
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(block, name)
            for what, t in (("weight", p.data), *((s, live.optimizer.state[p][s]) for s in ("exp_avg", "exp_avg_sq"))):
                parts = [torch.empty_like(t) for _ in range(ep)]  # 4 experts: even blocks
                dist.all_gather(parts, t.contiguous(), group=live.ep_group)
                out[f"{i}.{name}.{what}"] = torch.cat(parts)
    return out


def dense(live) -> dict[str, torch.Tensor]:
    experts = live.expert_params()
    out = {n: p.data.clone() for n, p in live.model.named_parameters() if id(p) not in experts}
    for n, p in live.model.named_parameters():
        if id(p) not in experts:
            for s in ("exp_avg", "exp_avg_sq"):
                out[f"{n}.{s}"] = live.optimizer.state[p][s].clone()
    return out


def train_and_move(rank: int, world: int) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    import nereus
    from nereus.backend.lower import lower
    from nereus.backend.shards import plan_layout
    from nereus.integrations.moe_ep import LiveMoe
    from nereus.ir.hf_config import model_from_hf_config
    from nereus.runtime.execute import Stats, execute
    from nereus.runtime.launch import init_from_env

    init_from_env(timeout=60)
    cfg = AutoConfig.for_model("qwen3_moe", **CONFIG)
    ir = model_from_hf_config(cfg.to_dict(), "actor")
    ir.dtype, ir.trained = "fp32", True

    def build(layout):
        torch.manual_seed(0)
        return LiveMoe(AutoModelForCausalLM.from_config(cfg), ir, layout, lr=LR)

    m = nereus.verify(module(ir, world))
    nereus.run_pipeline(m, "plan-transition{to=@b},schedule-transfers")
    losses = []
    live = build(m.plans["a"].layouts["actor.train"])
    for step in range(STEPS_A):
        losses.append(live.step(batch(step, rank)))

    before_experts, before_dense, step = gathered(live), dense(live), live.adam_step()
    prog = lower(m, "a_to_b", gpus=list(range(world)))
    stats = Stats()
    new = execute(prog, live.export_state(plan_layout(m, "a")[rank]), timeout=60, stats=stats)
    moved = {"sent": stats.sent, "planned": prog.sent_bytes(rank), "bytes_moved": m.transitions["a_to_b"].bytes_moved}
    live = build(m.plans["b"].layouts["actor.train"])
    live.load_state(new, step)

    problems = []
    for i, block in enumerate(live.experts):  # gather-and-reslice: this rank's EP-2 block of the full experts
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(block, name)
            for what, t in (("weight", p.data), *((s, live.optimizer.state[p][s]) for s in ("exp_avg", "exp_avg_sq"))):
                if not torch.equal(t, before_experts[f"{i}.{name}.{what}"][block.first : block.last]):
                    problems.append(f"layer {i} {name} {what}")
    problems += [f"dense {k}" for k, v in dense(live).items() if not torch.equal(v, before_dense[k])]
    if live.adam_step() != step:
        problems.append(f"Adam step {live.adam_step()} != {step}")

    for s in range(STEPS_A, STEPS_A + STEPS_B):
        losses.append(live.step(batch(s, rank)))

    pushed = push_to_generation(live, ir, cfg, world)

    # the reference: the unsplit HF model on the whole global batch, one process
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(cfg)
    opt = torch.optim.Adam(ref.parameters(), lr=LR)
    ref_losses = []
    for s in range(STEPS_A + STEPS_B):
        opt.zero_grad()
        loss = sum(ref(batch(s, r), labels=batch(s, r)).loss for r in range(world)) / world
        loss.backward()
        opt.step()
        ref_losses.append(float(loss))
    return {
        "losses": losses,
        "ref": ref_losses,
        "problems": problems,
        "moved": moved,
        "ep_rank": live.ep_rank,
        "pushed": pushed,
    }


SEQS = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12, 13]]


def logprobs(model, seqs) -> list[list[float]]:
    with torch.no_grad():
        out = []
        for q in seqs:
            lp = model(torch.tensor([q])).logits[0, :-1].float().log_softmax(-1)
            out.append(lp[torch.arange(len(q) - 1), torch.tensor(q[1:])].tolist())
        return out


def push_to_generation(live, ir, cfg, world: int) -> dict:
    """The EP-trained weights pushed (``WeightPush`` from the EP layout) into a trainer-side
    generation model on every rank (a plain HF model, every expert whole): the tensors bit-exact
    against the gathered experts, and its log-probabilities those of the EP model."""
    from transformers import AutoModelForCausalLM

    from nereus.integrations.hf_checkpoint import checkpoint_params
    from nereus.integrations.weight_push import WeightPush, hf_name

    rank = dist.get_rank()
    push = WeightPush(ir, live.layout, list(range(world)), world, timeout=60)
    mine = {name: p.data[index] for name, (p, index) in live.named_views().items()}
    pushed = push.push_state(push.state_of_params(mine))
    full = gathered(live)
    f = ir.expert_ffn
    wrong = []
    for i in range(ir.layers):
        for e in range(ir.experts):
            gate, up, down = (hf_name(f"layers.{i}.{n}") for n in ir.expert_families(e))
            fused_gu, fused_d = full[f"{i}.gate_up_proj.weight"][e], full[f"{i}.down_proj.weight"][e]
            for name, want in ((gate, fused_gu[:f]), (up, fused_gu[f:]), (down, fused_d)):
                if not torch.equal(pushed[name], want):
                    wrong.append(name)
    torch.manual_seed(1 + rank)
    generator = AutoModelForCausalLM.from_config(cfg)  # other weights until the push lands
    with torch.no_grad():
        for name, view in checkpoint_params(generator, ir).items():
            view.copy_(pushed[hf_name(name)])
    served, trained = logprobs(generator, SEQS), logprobs(live.model, SEQS)  # the EP forward: every rank at once
    gap = max(abs(a - b) for u, v in zip(served, trained) for a, b in zip(u, v))
    return {"tensors": len(pushed), "wrong": wrong, "gap": gap, "received": push.stats.bytes_received}
