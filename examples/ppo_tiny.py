"""PPO on a tiny Hugging Face Llama: actor, critic (a value head), reference and reward model as
one IR job, driven by the Nereus Controller and moved twice mid-run, every model in one
transition each time.

    torchrun --nproc-per-node 4 examples/ppo_tiny.py --steps 12 --leave-step 4 --decision-log ppo.jsonl

The task, the sampling and the two moves (an admitted one on response-length drift, a forced
one when ``--leave-rank`` calls ``ctl.leave()``) are ``grpo_tiny``'s. The IR job has four
model-stages, each live under its own layout of the plan (TP 2 x DP 2 on 4 ranks to start;
``--critic-tp/--critic-dp``, ``--ref-tp/--ref-dp``, ``--reward-tp/--reward-dp``):

- ``actor.train``: the actor and AdamW; it also scores its own samples (the sampling policy's
  log-probabilities) on its layout;
- ``critic.train``: a ``LlamaForSequenceClassification`` with one label (the IR's value head,
  ``score.weight``) whose ``score`` gives a value per position, seeded apart, with AdamW; it
  computes the values on its layout, then trains;
- ``ref.infer``: the frozen initial actor;
- ``reward.infer``: the frozen reward model (``reward_model.py``: a value-head Llama fitted to the
  task's score on labelled samples before the run, ``--reward-model FILE``, fitted by rank 0
  and saved there if the file is missing); a sequence's score is its value at the last position.

Each stage's outputs reach the others through ``stage_data.assemble`` (every replica's rows, put
together on every rank), so the rewards (the reward model's score on the last response token
(``--reward task``: the task's own score), minus ``beta`` times the per-token KL estimate
``logp - logp_ref``), GAE (``gamma``, ``lam``) and the
advantages (whitened over the step's tokens) are the same on every rank whatever the layouts.
The step's ``reward`` is the task's score, whatever PPO maximises; ``rm_score`` is the reward
model's. Then ``--epochs`` clipped PPO updates of each actor replica on its rows and value updates
(0.5 (V - R)^2) of each critic replica on its rows; gradients averaged over each model's DP.

``--engine vllm`` samples with vLLM engines instead: the model-stage ``actor.generate`` of the
plan (``grpo_tiny.start_engines``: TP ``--gen-tp`` engines under external_launcher), moved with
the job and fed the actor's weights by Nereus after every update (docs/embedding.md).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import grpo_tiny as g  # noqa: E402  (the task, the sampling, the IR job)
import reward_model as rm  # noqa: E402

from nereus.integrations.llama_adapter import JobAdapter  # noqa: E402
from nereus.integrations.stage_data import rows  # noqa: E402
from nereus.runtime.launch import init_from_env  # noqa: E402

MS = g.MS
CRITIC = "critic.train"
REWARD = "reward.infer"


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
        "--planned-response",
        "--ref-tp",
        "--ref-dp",
        "--critic-tp",
        "--critic-dp",
        "--reward-tp",
        "--reward-dp",
        "--gen-tp",
        "--gen-dp",
        "--zero",
    ):
        p.add_argument(a, type=int, default=None)
    p.add_argument("--leave-step", type=g.ints, default=None, help="as grpo_tiny's: steps at which a rank leaves")
    p.add_argument("--leave-rank", type=g.ints, default=None, help="as grpo_tiny's: the rank that leaves at each")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--critic-lr", type=float, default=3e-3)
    p.add_argument("--beta", type=float, default=0.02)
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--gamma", type=float, default=1.0)
    p.add_argument("--lam", type=float, default=0.95)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--decision-log", default=None)
    p.add_argument(
        "--reward",
        choices=("model", "task"),
        default="model",
        help="what PPO maximises: the reward model's score (reward.infer) or the task's own (no reward model)",
    )
    p.add_argument(
        "--reward-model",
        default="reward_model.pt",
        help="the reward model's weights (fitted and saved by rank 0 if missing: reward_model.py)",
    )
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--pg-timeout", type=float, default=60.0, help="as grpo_tiny's: the default group's timeout")
    p.add_argument(
        "--engine",
        choices=("hf", "vllm"),
        default="hf",
        help="generation by the live actor (hf) or by vLLM engines, actor.generate of the plan (TP --gen-tp), "
        "their weights pushed by Nereus after every update, their layout moved with the job (needs nereus[vllm])",
    )
    p.add_argument("--workdir", default=None, help="where the vLLM engines' configs go (default: a temporary dir)")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--stay", action="store_true", help="never re-plan on drift (measure plan @a: calibration runs)")
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


def value_loss(plen: int):
    """The critic's loss of a micro-batch, target = ``g.pack(returns, mask)``: 0.5 (V - R)^2, the mean
    over the micro-batch's response tokens (V at the position before each response token)."""

    def loss(values: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        resp = target.shape[1] // 2
        v = values.squeeze(-1)[:, plen - 1 : -1]
        returns, mask = target[:, :resp], target[:, resp:]
        return 0.5 * (((v - returns) ** 2) * mask).sum() / mask.sum()

    return loss


def ppo_step(
    lives, seqs, plen, score, mask, args, ctl
) -> tuple[float | None, float | None, torch.Tensor, torch.Tensor]:
    """``args.epochs`` PPO updates; the actor's and the critic's losses (DP means; None on a rank
    that holds no replica of that model), the sampling policy's log-probabilities (the actor's
    before its update) and the sequences' scores PPO maximised (the reward model's, or ``score``
    without one). The updates are ``hf_llama.optimize`` (DDP or FSDP2, and a 1F1B schedule under
    PP); under PP a micro-batch's loss is the mean over its own tokens."""
    actor, critic, ref = lives[MS], lives[CRITIC], lives[g.REF]
    with torch.no_grad():
        if REWARD in lives:
            with ctl.stage(REWARD):  # the value at the last position, on the reward model's layout
                score = g.scored(lives[REWARD], seqs, plen, ctl.group, lambda out, s: out.squeeze(-1)[:, plen:])[:, -1]
        with ctl.stage(MS):  # the sampling policy's log-probabilities, on the actor's layout
            old = g.scored(actor, seqs, plen, ctl.group, lambda out, s: g.logp_of(out, s, plen))
        with ctl.stage(g.REF):
            ref_logp = g.scored(ref, seqs, plen, ctl.group, lambda out, s: g.logp_of(out, s, plen))
        with ctl.stage(CRITIC):
            values = g.scored(critic, seqs, plen, ctl.group, lambda out, s: out.squeeze(-1)[:, plen - 1 : -1])
        rewards = -args.beta * (old - ref_logp) * mask
        last = (mask.sum(dim=1) - 1).long()
        rewards[torch.arange(len(seqs)), last] += score
        adv, returns = gae(rewards, values, mask, args.gamma, args.lam)
        n = mask.sum()
        mean = (adv * mask).sum() / n
        std = (((adv - mean) ** 2 * mask).sum() / n).sqrt()
        adv = (adv - mean) / (std + 1e-6) * mask
    loss = vloss = None
    mine = rows(actor, len(seqs))
    if mine is not None:
        target = g.pack(seqs, old, adv, mask)[mine]
        with ctl.stage(MS):
            for _ in range(args.epochs):
                loss = g.optimize(actor, seqs[mine], target, actor_loss(plen, args.clip))
    mine = rows(critic, len(seqs))
    if mine is not None:
        target = g.pack(returns, mask)[mine]
        with ctl.stage(CRITIC):
            for _ in range(args.epochs):
                vloss = g.optimize(critic, seqs[mine], target, value_loss(plen))
    return loss, vloss, old, score


def job(args, world: int, cluster=None):
    """``grpo_tiny.job`` with the critic (a value-head model of the actor's config, trained) and,
    with ``--reward model``, the reward model (``reward_model.py``'s value head, frozen)."""
    cfg = g.config(args.engine)
    critic = g.ir_model(cfg, "critic", trained=True, head="value")
    tp = args.tp if args.critic_tp is None else args.critic_tp
    dp = args.dp if args.critic_dp is None else args.critic_dp
    extra = [(critic, g.layout(critic, tp=tp, dp=dp, pp=args.pp))]
    if args.reward == "model":
        reward = g.ir_model(g.config(), "reward", trained=False, head="value")
        tp = args.tp if args.reward_tp is None else args.reward_tp
        dp = args.dp if args.reward_dp is None else args.reward_dp
        extra.append((reward, g.layout(reward, tp=tp, dp=dp, stage="infer")))
    cfg, m = g.job(args, world, extra=tuple(extra), cluster=cluster)
    m.workloads["job"].ppo_epochs = args.epochs  # the updates each batch gets, as the cost model counts them
    return cfg, m


def main(argv=None, adapter_cls=JobAdapter, faults: tuple = ()) -> dict:
    args = parse(argv)
    init_from_env(timeout=args.pg_timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg, module = job(args, world)
    lives = g.live_models(cfg, module, args)
    critic_adamw = {"lr": args.critic_lr, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.0}
    lives[CRITIC] = g.build(
        cfg,
        module.plans["a"].layouts[CRITIC],
        seed=args.seed + 1,
        adamw=critic_adamw,
        timeout=args.timeout,
        head="value",
    )
    if args.reward == "model":
        lives[REWARD] = g.build(
            g.config(),
            module.plans["a"].layouts[REWARD],
            weights=rm.load_or_train(args.reward_model, g.config(), digits=args.digits, alphabet=args.alphabet),
            timeout=args.timeout,
            trained=False,
            head="value",
        )
    engines = g.start_engines(cfg, module, args)
    adapter = adapter_cls(lives, module, "a", seed=args.seed, engines=engines)
    ctl, timed = g.controller(module, adapter, args, faults)
    if engines is not None:
        engines.push(lives[MS])
    plen = args.digits + 2
    history = []
    for step in range(args.steps):
        lives = adapter.lives
        t0 = time.perf_counter()
        with ctl.step():
            seqs, reward, mask, engine_logp = g.rollout(lives[MS], step, args, ctl, timed, engines)
            loss, vloss, old, maximised = ppo_step(lives, seqs, plen, reward, mask, args, ctl)
            if rank == g.leaver(step, args, ctl.members):
                ctl.leave()
        dec = ctl.last
        row = {
            "step": step,
            "plan": f"@{dec.source} {g.shape(lives[MS].layout)}",
            "layouts": g.shapes(lives),
            "reward": float(reward.mean()),
            "rm_score": float(maximised.mean()) if args.reward == "model" else None,
            "loss": loss,
            "value_loss": vloss,
            "decision": dec.action,
            "forced": dec.forced,
            "target": dec.target,
            "seconds": round(time.perf_counter() - t0, 3),
            **g.measured(ctl),
        }
        if engines is not None and ctl.active:  # the updated actor (in its new layout after a move) to the engines
            engines.push(adapter.lives[MS], ctl.group, ctl.members)
            row.update(g.engine_row(engines, float(((old - engine_logp).abs() * mask).max())))
        history.append(row)
        if rank == ctl.members[0] and not args.quiet:
            fmt = lambda x: "-" if x is None else f"{x:+.4f}"  # noqa: E731
            print(
                f"step {step:3d}  plan @{dec.source} ({row['layouts']})  reward {row['reward']:.3f}  "
                + (f"rm {row['rm_score']:.3f}  " if row["rm_score"] is not None else "")
                + f"loss {fmt(loss)}  value loss {fmt(vloss)}  decision {dec.action}"
                f"{' (forced)' if dec.forced else ''}{' -> @' + dec.target if dec.action == 'transition' else ''}"
                f"  {row['seconds']:.2f} s" + (g.engine_text(row, history) if "engines" in row else ""),
                flush=True,
            )
        if not ctl.active:
            break
    if engines is not None:  # last: the engine's teardown destroys the default group (VllmEngine.close)
        engines.close()
    return {
        "rank": rank,
        "history": history,
        "active": ctl.active,
        "plan": ctl.plan,
        "moves": getattr(adapter, "moves", None),
        "checks": getattr(adapter, "checks", None),
        "regroup_checks": getattr(adapter, "regroup_checks", None),
    }


if __name__ == "__main__":
    main(sys.argv[1:])
    if dist.is_initialized():
        dist.destroy_process_group()
