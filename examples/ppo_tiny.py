"""PPO on a tiny Hugging Face Llama (actor + critic with a value head + reference, GAE), driven by
the Nereus Controller and moved twice mid-run, as ``examples/grpo_tiny.py`` is.

    torchrun --nproc-per-node 4 examples/ppo_tiny.py --steps 12 --leave-step 4 --decision-log ppo.jsonl

The task, the actor (under the IR plan's layout: TP 2 x DP 2 to start), the frozen reference,
the sampling and the two moves (an admitted one on response-length drift, a forced one when
``--leave-rank`` calls ``ctl.leave()``) are ``grpo_tiny``'s. PPO adds:

- a critic: a ``LlamaModel`` of the actor's config with a linear value head, seeded apart. It
  is plain data parallel over the actor's current DP group (a whole replica on every rank: the
  TP ranks of a replica see the same rows, so every copy stays identical), outside the IR
  module: the Controller moves the actor only (the IR module is ``job.training_job``'s
  one-model job); the critic needs no move because every rank, leaving or not, holds it whole;
- per-token rewards: the task's score on the last response token, minus ``beta`` times the
  per-token KL estimate ``logp - logp_ref`` (the usual PPO-RLHF shaping);
- GAE (``gamma``, ``lam``) from the critic's values, advantages whitened over the replica's
  tokens; ``--epochs`` clipped PPO updates of the actor and the critic (value loss 0.5 (V - R)^2)
  per batch, gradients averaged over DP.

``--engine vllm`` samples with a vLLM engine on every rank instead, the actor's weights pushed by
Nereus after every update (``grpo_tiny.Engines``; docs/embedding.md).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
import grpo_tiny as g  # noqa: E402  (the task, the sampling, the IR job)

from nereus.integrations.llama_adapter import LlamaAdapter  # noqa: E402
from nereus.runtime.launch import init_from_env  # noqa: E402

MS = g.MS


class Critic(torch.nn.Module):
    """A Llama trunk and a linear value head: one value per position."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.trunk = LlamaModel(cfg)
        self.head = torch.nn.Linear(cfg.hidden_size, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(input_ids=ids).last_hidden_state).squeeze(-1)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for a in (
        "--steps",
        "--prompts",
        "--group",
        "--digits",
        "--alphabet",
        "--seed",
        "--tp",
        "--dp",
        "--pp",
        "--leave-step",
        "--leave-rank",
        "--planned-response",
    ):
        p.add_argument(a, type=int, default=None)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--critic-lr", type=float, default=3e-3)
    p.add_argument("--beta", type=float, default=0.02)
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--gamma", type=float, default=1.0)
    p.add_argument("--lam", type=float, default=0.95)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--decision-log", default=None)
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument(
        "--engine",
        choices=("hf", "vllm"),
        default="hf",
        help="generation by the live actor (hf) or by a vLLM engine per rank, its weights pushed by "
        "Nereus after every update (vllm: needs nereus[vllm])",
    )
    p.add_argument("--workdir", default=None, help="where the vLLM engines' configs go (default: a temporary dir)")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    if args.group is None:
        args.group = 2  # PPO needs no groups: 2 samples per prompt
    base = g.parse([])  # grpo_tiny's defaults for the other shared flags
    for k, v in vars(base).items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    return args


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float):
    """Advantages and returns per response token ([rows, T]); positions past a response's end are masked."""
    T = rewards.shape[1]
    adv = torch.zeros_like(rewards)
    last = torch.zeros(rewards.shape[0])
    for t in reversed(range(T)):
        nxt = values[:, t + 1] * mask[:, t + 1] if t + 1 < T else torch.zeros(rewards.shape[0])
        delta = rewards[:, t] + gamma * nxt - values[:, t]
        last = (delta + gamma * lam * last * (mask[:, t + 1] if t + 1 < T else 0)) * mask[:, t]
        adv[:, t] = last
    return adv, adv + values


def average_grads(params, group, dp: int) -> None:
    """DDP's gradient average, for the critic (a plain module that follows the actor's DP group)."""
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
            p.grad.div_(dp)


def actor_loss(plen: int, clip: float):
    """The clipped PPO policy loss of a micro-batch, target = ``g.pack(seqs, old, adv, mask)``: the
    mean over the micro-batch's response tokens."""

    def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        n = logits.shape[1]
        resp = n - plen
        seqs, old = target[:, :n].long(), target[:, n : n + resp]
        adv, mask = target[:, n + resp : n + 2 * resp], target[:, n + 2 * resp :]
        ratio = torch.exp(g.logp_of(logits, seqs, plen) - old)
        pg = -torch.min(ratio * adv, torch.clamp(ratio, 1 - clip, 1 + clip) * adv)
        return (pg * mask).sum() / mask.sum()

    return loss


def ppo_step(live, critic, critic_opt, reference, seqs, plen, score, mask, args) -> tuple[float, float]:
    """``args.epochs`` PPO updates on this replica's rollouts; the actor and critic losses (DP means).
    The actor's update is ``hf_llama.optimize`` (DDP, and a 1F1B schedule under PP); under PP a
    micro-batch's loss is the mean over its own tokens."""
    with torch.no_grad():
        old = g.logp_of(g.forward(live, seqs), seqs, plen)
        ref = g.token_logp(reference, seqs, plen)
        values = critic(seqs)[:, plen - 1 : -1]
        rewards = -args.beta * (old - ref) * mask
        last = (mask.sum(dim=1) - 1).long()
        rewards[torch.arange(len(seqs)), last] += score
        adv, returns = gae(rewards, values, mask, args.gamma, args.lam)
        n = mask.sum()
        mean = (adv * mask).sum() / n
        std = (((adv - mean) ** 2 * mask).sum() / n).sqrt()
        adv = (adv - mean) / (std + 1e-6) * mask
    dp = live.layout.dp
    group = live.mesh["dp"].get_group() if dp > 1 else None
    target = g.pack(seqs, old, adv, mask)
    for _ in range(args.epochs):
        loss = g.optimize(live, seqs, target, actor_loss(plen, args.clip))
        v = critic(seqs)[:, plen - 1 : -1]
        critic_loss = 0.5 * (((v - returns) ** 2) * mask).sum() / mask.sum()
        critic_loss.backward()
        if dp > 1:
            average_grads(critic.parameters(), group, dp)
        critic_opt.step()
        critic_opt.zero_grad(set_to_none=True)
    vloss = critic_loss.detach().clone()
    if dp > 1:
        dist.all_reduce(vloss, group=group)
        vloss /= dp
    return loss, float(vloss)


def main(argv=None, adapter_cls=LlamaAdapter, faults: tuple = ()) -> dict:
    args = parse(argv)
    init_from_env(timeout=60)
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg, module = g.job(args, world)
    live, reference, plain = g.actor_and_reference(cfg, module, args)
    torch.manual_seed(args.seed + 1)
    critic = Critic(plain).to(torch.float32)
    critic_opt = torch.optim.AdamW(
        critic.parameters(), lr=args.critic_lr, betas=(0.9, 0.99), weight_decay=0.0, foreach=False
    )
    adapter = adapter_cls(live, module, "a", seed=args.seed)
    ctl, timed = g.controller(module, adapter, args, faults)
    engines = g.start_engines(cfg, args, rank, world, live)
    leaver = world - 1 if args.leave_rank < 0 else args.leave_rank
    plen = args.digits + 2
    history = []
    for step in range(args.steps):
        live = adapter.live
        t0 = time.perf_counter()
        with ctl.step():
            lay = live.layout
            seqs, reward, mask = g.rollout(live, step, args, ctl, timed, engines.engine if engines else None)
            with ctl.stage(MS):
                loss, vloss = ppo_step(live, critic, critic_opt, reference, seqs, plen, reward, mask, args)
            mean_reward = g.dp_mean(live, reward)
            if step == args.leave_step and rank == leaver:
                ctl.leave()
        dec = ctl.last
        row = {
            "step": step,
            "plan": f"@{dec.source} {g.shape(lay)}",
            "reward": float(mean_reward),
            "loss": loss,
            "value_loss": vloss,
            "decision": dec.action,
            "forced": dec.forced,
            "target": dec.target,
            "seconds": round(time.perf_counter() - t0, 3),
        }
        if engines is not None and ctl.active:  # the updated actor (in its new layout after a move) to the engines
            engines.push(adapter.live)
            row.update(push_s=round(engines.push_s[-1], 4), load_s=round(engines.load_s[-1], 4))
        history.append(row)
        if rank == ctl.members[0] and not args.quiet:
            print(
                f"step {step:3d}  plan @{dec.source} ({g.shape(lay)})  reward {row['reward']:.3f}  "
                f"loss {loss:+.4f}  value loss {vloss:.4f}  decision {dec.action}"
                f"{' (forced)' if dec.forced else ''}{' -> @' + dec.target if dec.action == 'transition' else ''}"
                f"  {row['seconds']:.2f} s",
                flush=True,
            )
        if not ctl.active:
            break
    if engines is not None:  # last: the engine's teardown destroys the default group (VllmEngine.close)
        engines.engine.close()
    return {
        "rank": rank,
        "history": history,
        "active": ctl.active,
        "plan": ctl.plan,
        "moves": getattr(adapter, "moves", None),
        "checks": getattr(adapter, "checks", None),
    }


if __name__ == "__main__":
    main(sys.argv[1:])
    if dist.is_initialized():
        dist.destroy_process_group()
