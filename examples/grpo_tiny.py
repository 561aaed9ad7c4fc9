"""GRPO on a tiny Hugging Face Llama, driven by the Nereus Controller, moved twice mid-run.

    torchrun --nproc-per-node 4 examples/grpo_tiny.py --steps 12 --leave-step 4 --decision-log grpo.jsonl

The task is verifiable: the prompt is ``BOS d1 .. dL SEP`` (``L`` digits from ``0..D-1``), the
answer is the digits again followed by ``EOS``; the reward is the fraction of the ``L + 1``
answer positions the response gets right.

The job is an IR job of two models (``job.rl_job``): the actor (``actor.train``, a tiny
``LlamaForCausalLM`` built locally from a config, seeded, nothing downloaded, with AdamW) and the
frozen reference (``ref.infer``: the initial actor, no optimizer), each live under its own
layout of the plan (``hf_llama.build``): TP 2 x DP 2 on 4 ranks to start for both
(``--tp/--dp``, ``--ref-tp/--ref-dp``). The Controller moves both with one transition
(``JobAdapter``: ``reshard_job``).

Each step: every actor DP replica takes its share of the step's prompts (the same global prompts
under every layout) and samples ``group`` responses per prompt (each prompt's sampling
generator is seeded from the step and the prompt's global index, so the TP ranks of a replica
draw the same tokens and a layout change does not change the draws); the sequences are put
together on every rank (``stage_data.assemble``), every reference replica scores its share
under its own layout and the log-probabilities are put together the same way; rewards are
scored, advantages normalised within each group, and one AdamW step per actor replica
minimises the GRPO loss: the policy-gradient term (ratio to the sampling policy, clipped) plus
``beta`` times the k3 estimate of KL(actor || reference), averaged over each response's
tokens, then over responses; gradients are averaged over DP.

The Controller (``nereus.integrations.controller``) times ``ref.infer`` and ``actor.train``,
takes the response lengths, and decides at the end of each step; ``JobAdapter.move`` runs its
transitions on both live models at once. Two moves happen mid-run:

- admitted: the IR workload is planned for responses of 1 token (``--planned-response``), the
  responses are ``L + 1`` long, so the response-length trigger fires at once and, with
  ``pg_init = engine_restart = margin = 0``, a plan that is faster for the measured workload pays;
- forced: at ``--leave-step`` rank ``--leave-rank`` calls ``ctl.leave()``; the next decision
  moves the job to the ranks that remain; the leaving rank hands its state over and ends its loop.

``--leave-step 1,3`` makes two ranks leave, one after the other: after each shrink the
Controller re-forms the default group over the ranks that remain (docs/embedding.md), so the job
goes on moving. ``--kill-step 2 --kill-rank 3`` kills rank 3 with SIGKILL in the middle of step
2 (after its rollout, before the update): the others' next collective breaks, they agree who is
alive through the job's store, re-form the default group over themselves, move the state to a
plan on the survivors (the dead rank's shards from their DP replicas) and run step 2 again
(``ctl.redo``). ``--gpus 4`` on 3 ranks plans on a cluster of 4 GPUs of which GPU 3 is not in the
job yet; a process started with ``--join`` (``nereus launch --join``) asks the running job to
take it: at the next step's end it gets GPU 3, the group is re-formed with it, and the decision
moves the job to a plan that uses it, the newcomer's state coming from the others' memory.
``main`` is what the tests run on 4 gloo processes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import LlamaConfig

from nereus.control import ControlOptions
from nereus.integrations.controller import Controller
from nereus.integrations.engine_stage import EngineStage, check_engine_layout
from nereus.integrations.hf_llama import absent, build, forward, ir_model, optimize
from nereus.integrations.job import layout, rl_job
from nereus.integrations.llama_adapter import JobAdapter
from nereus.integrations.llama_state import check_layout, live_keep
from nereus.integrations.stage_data import assemble, rows
from nereus.runtime.launch import init_from_env

MS = "actor.train"
REF = "ref.infer"
SEP, EOS, BOS = 10, 11, 12  # digits are tokens 0..9


def config(engine: str = "hf") -> LlamaConfig:
    """The tiny actor: 2 layers, hidden 64, 4 heads (4 K/V heads: TP 1, 2 or 4), vocabulary 16;
    with ``engine = "vllm"`` heads of 64 dimensions (vLLM's CPU attention needs head_dim >= 32)."""
    return LlamaConfig(
        vocab_size=16,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=False,
        max_position_embeddings=32,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        use_cache=False,
        eos_token_id=EOS,
        bos_token_id=BOS,
        **({"head_dim": 64} if engine == "vllm" else {}),
    )


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--prompts", type=int, default=12, help="prompts per step, over all DP replicas")
    p.add_argument("--group", type=int, default=4, help="responses per prompt")
    p.add_argument("--digits", type=int, default=3, help="L: digits to copy")
    p.add_argument("--alphabet", type=int, default=4, help="D: digits drawn from 0..D-1")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--beta", type=float, default=0.02, help="KL coefficient")
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--ref-tp", type=int, default=None, help="the reference's TP (default: --tp)")
    p.add_argument("--ref-dp", type=int, default=None, help="the reference's DP (default: --dp)")
    p.add_argument(
        "--pp", type=int, default=1, help="pipeline stages (layers split evenly; 1F1B over pp micro-batches)"
    )
    p.add_argument("--zero", type=int, choices=(0, 3), default=0, help="the actor's ZeRO: 0 DDP, 3 FSDP2 (pp 1)")
    p.add_argument(
        "--leave-step", type=ints, default=[3], help="steps at which a rank announces it leaves, e.g. 2,5 (-1: never)"
    )
    p.add_argument(
        "--leave-rank", type=ints, default=[-1], help="the rank that leaves at each of them (-1: the highest still in)"
    )
    p.add_argument(
        "--kill-step",
        type=int,
        default=-1,
        help="the step in which --kill-rank dies by SIGKILL, unannounced (-1: never)",
    )
    p.add_argument("--kill-rank", type=int, default=-1, help="the rank --kill-step kills (-1: the highest still in)")
    p.add_argument("--checkpoint-dir", default=None, help="where the job saves DCP checkpoints (--checkpoint-every)")
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        help="a DCP checkpoint every N steps: what only a dead rank held (a ZeRO shard) is read back from the last",
    )
    p.add_argument("--gpus", type=int, default=None, help="the cluster's GPUs (default: the ranks; more: room to join)")
    p.add_argument(
        "--join",
        action="store_true",
        help="this process joins the running job (its MASTER_ADDR/MASTER_PORT) instead of starting with it",
    )
    p.add_argument("--planned-response", type=int, default=1, help="response length the IR workload is planned for")
    p.add_argument("--decision-log", default=None, help="decision log (JSON lines)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds for every collective of a transition")
    p.add_argument(
        "--pg-timeout",
        type=float,
        default=60.0,
        help="the default group's timeout: the longest a rank waits in a step's collective (on a rank that died too)",
    )
    p.add_argument(
        "--engine",
        choices=("hf", "vllm"),
        default="hf",
        help="generation by the live actor (hf) or by vLLM engines, the model-stage actor.generate of the "
        "plan (TP --gen-tp under external_launcher), their weights pushed by Nereus after every optimizer "
        "step and their layout moved with the job (vllm: needs nereus[vllm])",
    )
    p.add_argument("--workdir", default=None, help="where the vLLM engines' configs go (default: a temporary dir)")
    p.add_argument("--gen-tp", type=int, default=2, help="--engine vllm: the engines' TP (actor.generate's layout)")
    p.add_argument("--gen-dp", type=int, default=None, help="--engine vllm: replicas that generate (default: all)")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--stay", action="store_true", help="never re-plan on drift (measure plan @a: calibration runs)")
    return p.parse_args(argv)


def ints(text: str) -> list[int]:
    """A comma-separated list of integers (``--leave-step 2,5``)."""
    return [int(x) for x in str(text).split(",") if x.strip()]


def leaver(step: int, args, members: list[int]) -> int | None:
    """The rank that announces it leaves at ``step`` (None: none does): ``--leave-rank``'s entry
    for that step of ``--leave-step``, or the highest rank still in the job (``members``)."""
    if step not in args.leave_step:
        return None
    i = args.leave_step.index(step)
    rank = args.leave_rank[i] if i < len(args.leave_rank) else -1
    return max(members) if rank < 0 else rank


def killed(step: int, args, members: list[int]) -> int | None:
    """The rank that ``--kill-step`` kills in ``step`` (None: none)."""
    if step != args.kill_step:
        return None
    return max(members) if args.kill_rank < 0 else args.kill_rank


def die() -> None:
    """This process ends as a lost node's would: SIGKILL, no cleanup, no message to anyone."""
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def prompts(step: int, n: int, digits: int, alphabet: int, seed: int) -> torch.Tensor:
    """The step's ``n`` global prompts ``BOS d1 .. dL SEP``: the same under every layout."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    body = torch.randint(0, alphabet, (n, digits), generator=g)
    return torch.cat([torch.full((n, 1), BOS), body, torch.full((n, 1), SEP)], dim=1)


@torch.no_grad()
def generate(live, prompt: torch.Tensor, first: int, group: int, new: int, step: int, seed: int) -> torch.Tensor:
    """``group`` samples per prompt row, ``new`` tokens each, by the live actor in its layout
    (``hf_llama.forward``: under PP a forward-only pipeline, logits broadcast from the last stage).
    The sequences have their final length from the start (``EOS`` after the prompt), so every
    forward has one shape, as a pipeline schedule needs; causal attention keeps the positions
    not yet sampled out of the logits read. No KV cache: the sequences are tiny.
    Row ``i`` is global prompt ``first + i``; its generator is seeded from (seed, step, first + i)."""
    plen = prompt.shape[1]
    seqs = torch.cat([prompt, torch.full((len(prompt), new), EOS)], dim=1).repeat_interleave(group, dim=0)
    gens = [torch.Generator().manual_seed((seed * 7919 + step) * 100_003 + first + i) for i in range(len(prompt))]
    for t in range(new):
        probs = torch.softmax(forward(live, seqs)[:, plen + t - 1], dim=-1)
        seqs[:, plen + t] = torch.cat(
            [torch.multinomial(probs[i * group : (i + 1) * group], 1, generator=g) for i, g in enumerate(gens)]
        ).squeeze(1)
    return seqs


def generate_vllm(
    engines, prompt: torch.Tensor, first: int, group: int, new: int, step: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``generate``'s samples drawn by this rank's vLLM engine replica instead (every rank of it
    calls this with the same prompts and per-prompt seeds), a response ending at ``EOS`` padded
    with ``EOS`` to ``new`` tokens; and vLLM's log-probability of each sampled token (0 past the
    response)."""
    seeds = [(seed * 7919 + step) * 100_003 + first + i for i in range(len(prompt))]
    rows, logps = [], []
    for p, sampled in zip(prompt.tolist(), engines.generate(prompt.tolist(), n=group, max_tokens=new, seeds=seeds)):
        rows += [p + toks + [EOS] * (new - len(toks)) for toks in sampled.tokens]
        logps += [lps + [0.0] * (new - len(lps)) for lps in sampled.logprobs]
    return torch.tensor(rows), torch.tensor(logps)


def score(seqs: torch.Tensor, plen: int, digits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rewards (fraction of the L + 1 answer positions right), the response mask (tokens up to and
    including the first EOS) and the response lengths."""
    resp = seqs[:, plen:]
    want = torch.cat([seqs[:, 1 : 1 + digits], torch.full((len(seqs), 1), EOS)], dim=1)
    reward = (resp == want).float().mean(dim=1)
    eos = resp == EOS
    first = torch.where(eos.any(dim=1), eos.float().argmax(dim=1), torch.full((len(resp),), resp.shape[1] - 1))
    lengths = first + 1
    mask = (torch.arange(resp.shape[1])[None, :] < lengths[:, None]).float()
    return reward, mask, lengths


def logp_of(logits: torch.Tensor, seqs: torch.Tensor, plen: int) -> torch.Tensor:
    """log p(response token | prefix) for every response position: [rows, response length]."""
    return torch.gather(F.log_softmax(logits[:, plen - 1 : -1].float(), dim=-1), 2, seqs[:, plen:, None]).squeeze(2)


def pack(*columns: torch.Tensor) -> torch.Tensor:
    """Per-row data as one float tensor (the target a pipeline schedule splits into micro-batches
    with the inputs); token ids are small integers, exact in float32."""
    return torch.cat([c.float().reshape(len(c), -1) for c in columns], dim=1)


def grpo_loss(plen: int, beta: float, clip: float):
    """The GRPO loss of a micro-batch, ``loss(logits, target)``, target = ``pack(seqs, adv, ref, mask)``:
    the clipped policy-gradient term plus ``beta`` times the k3 estimate of KL(actor || reference),
    averaged over each response's tokens, then over responses."""

    def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        n = logits.shape[1]  # sequence length; target: n + 1 + 2 (n - plen) columns
        resp = n - plen
        seqs, adv = target[:, :n].long(), target[:, n : n + 1]
        ref, mask = target[:, n + 1 : n + 1 + resp], target[:, n + 1 + resp :]
        logp = logp_of(logits, seqs, plen)
        ratio = torch.exp(logp - logp.detach())  # one update per batch: the sampling policy is the current one
        pg = -torch.min(ratio * adv, torch.clamp(ratio, 1 - clip, 1 + clip) * adv)
        kl = torch.exp(ref - logp) - (ref - logp) - 1  # k3
        return (((pg + beta * kl) * mask).sum(dim=1) / mask.sum(dim=1)).mean()

    return loss


def grpo_step(live, ref, seqs, plen, reward, mask, group, beta, clip) -> float:
    """One AdamW step on this replica's responses (``ref``: their reference log-probabilities;
    ``hf_llama.optimize``: DDP averages the gradients over DP, a 1F1B schedule runs the
    micro-batches under PP); the loss averaged over DP."""
    r = reward.view(-1, group)
    adv = ((r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + 1e-4)).view(-1, 1)
    return optimize(live, seqs, pack(seqs, adv, ref, mask), grpo_loss(plen, beta, clip))


def job(args, world: int, extra: tuple = (), cluster=None):
    """The IR module: plan @a with the actor's train stage (DP x PP x TP on the first dp * pp * tp
    ranks), the reference's infer stage (``--ref-dp`` x ``--ref-tp`` on the first ranks) and, with
    ``--engine vllm``, the actor's generate stage (the engines: ``--gen-dp`` x ``--gen-tp``);
    ``extra``: more (model, layout) pairs (PPO's critic); ``cluster``: the machine's figures
    (default: ``rl_job``'s nominal ones)."""
    cfg = config(args.engine)
    actor, ref = ir_model(cfg, "actor"), ir_model(cfg, "ref", trained=False)
    planned = 2 * args.planned_response  # rl_job plans responses of seq // 2 tokens
    ref_tp = args.tp if args.ref_tp is None else args.ref_tp
    ref_dp = args.dp if args.ref_dp is None else args.ref_dp
    layouts = [
        layout(actor, tp=args.tp, dp=args.dp, pp=args.pp, zero=args.zero),
        layout(ref, tp=ref_tp, dp=ref_dp, stage="infer"),
    ]
    if args.engine == "vllm":  # the engines are actor.generate's layout
        gen_dp = world // args.gen_tp if args.gen_dp is None else args.gen_dp
        layouts.append(layout(actor, tp=args.gen_tp, dp=gen_dp, stage="generate"))
    models = [actor, ref, *(m for m, _ in extra)]
    gpus = max(world, getattr(args, "gpus", None) or world)
    m = rl_job(
        models,
        {"a": layouts + [lay for _, lay in extra]},
        gpus,
        rows=args.prompts * args.group,
        seq=planned,
        group=args.group,
        cluster=cluster,
    )
    m.clusters[m.plans["a"].cluster].unavailable = list(range(world, gpus))  # GPUs a process may join on
    for ms in m.plans["a"].layouts:
        if ms.endswith(".generate"):
            check_engine_layout(m, "a", ms, world)
        else:
            check_layout(m, "a", ms)
    return cfg, m


def rollout(actor, step: int, args, ctl, timed, engines=None):
    """The step's sequences on every rank of the job: each actor replica samples its share of the
    prompts (with ``engines``, each engine replica of ``actor.generate`` does), and the shares are
    put together (``assemble``); the rewards, the response mask and the response lengths (to the
    Controller, once) of them all. (sequences, reward, mask, the engines' log-probabilities of
    the sampled tokens or None)."""
    n = args.prompts
    plen = args.digits + 2
    width = (n * args.group, plen + args.digits + 1)
    seqs = engine_logp = None
    sampler = actor if engines is None else engines
    mine = rows(sampler, n)
    if mine is not None:
        share = prompts(step, n, args.digits, args.alphabet, args.seed)[mine]
        with timed("actor.generate"):
            if engines is None:
                seqs = generate(actor, share, mine.start, args.group, args.digits + 1, step, args.seed)
            else:
                seqs, engine_logp = generate_vllm(
                    engines, share, mine.start, args.group, args.digits + 1, step, args.seed
                )
    every = assemble(sampler, seqs, width, torch.int64, ctl.group)
    if engines is not None:
        engine_logp = assemble(sampler, engine_logp, (width[0], args.digits + 1), torch.float32, ctl.group)
    reward, mask, lengths = score(every, plen, args.digits)
    if ctl.rank == ctl.members[0]:
        ctl.responses(lengths.tolist())
    return every, reward, mask, engine_logp


def scored(live, seqs: torch.Tensor, plen: int, group, what) -> torch.Tensor:
    """``what(outputs, rows)`` ([rows, response length]) of every row of ``seqs`` on every rank:
    each replica of ``live`` computes its share under its own layout (``hf_llama.forward``), and
    the shares are put together (``assemble``)."""
    mine = rows(live, len(seqs))
    part = what(forward(live, seqs[mine]), seqs[mine]) if mine is not None else None
    return assemble(live, part, (len(seqs), seqs.shape[1] - plen), torch.float32, group)


def live_models(cfg: LlamaConfig, module, args, group=None) -> dict:
    """This rank's live models under plan @a, by model-stage: the actor (AdamW) and the frozen
    reference, built from the same seed (the reference is the initial actor), in ``group``."""
    adamw = {"lr": args.lr, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.0}
    plan = module.plans["a"]
    return {
        MS: build(cfg, plan.layouts[MS], seed=args.seed, adamw=adamw, timeout=args.timeout, group=group),
        REF: build(cfg, plan.layouts[REF], seed=args.seed, timeout=args.timeout, trained=False, group=group),
    }


def shape(lay) -> str:
    """A layout as ``tp2xpp1xdp2`` (``tp2xpp1xdp2 zero3`` under FSDP2, `` recompute`` with
    activation recompute)."""
    text = f"tp{lay.tp}xpp{lay.pp}xdp{lay.dp}" + (f" zero{lay.zero}" if lay.zero else "")
    return text + (" recompute" if lay.recompute else "")


def shapes(lives: dict) -> str:
    """Every live model's layout: ``actor.train tp2xpp1xdp2, ref.infer tp1xpp1xdp4``."""
    return ", ".join(f"{ms} {shape(live.layout)}" for ms, live in sorted(lives.items()))


def controller(module, adapter, args, faults: tuple = (), group=None):
    """The Controller around the loop (search limited to what the live models take: ``live_keep``; transitions
    cost only their makespan, so that a move pays on this tiny job), and ``timed(ms)``: a stage
    context for the model-stages of the IR job (a no-op for the others). ``group``: the caller's
    process group the job runs in (None: the default group)."""
    ctl = Controller(
        module,
        "a",
        adapter,
        options=control_options(module, args),
        total_steps=max(args.steps, 100),
        keep=live_keep(module),
        group=group,
        **controller_args(args, faults),
    )
    return ctl, stage_timer(ctl)


def controller_args(args, faults: tuple = ()) -> dict:
    """The Controller's keyword arguments that a process joining the job passes as well."""
    return {
        "log": args.decision_log,
        "timeout": args.timeout,
        "show": not args.quiet,
        "faults": faults,
        "detect_timeout": args.pg_timeout,
        "checkpoint_dir": getattr(args, "checkpoint_dir", None),
        "checkpoint_every": getattr(args, "checkpoint_every", 0),
    }


def stage_timer(ctl):
    """``timed(ms)``: ``ctl.stage(ms)`` for the IR job's model-stages, a no-op for the others."""
    module = ctl.module
    stages = {f"{model}.{st.name}" for w in module.workloads.values() for st in w.stages for model in st.models}
    return lambda ms: ctl.stage(ms) if ms in stages else contextlib.nullcontext()


def joined(cfg: LlamaConfig, args, faults: tuple = (), adapter_cls=JobAdapter):
    """``--join``: this process joins the running job (``Controller.join``, blocking until the job
    admits it at a step's end); its adapter holds nothing until the move that admission plans."""
    adamw = {"lr": args.lr, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.0}

    def adapter_for(module, plan: str, gpu: int):
        lays = module.plans[plan].layouts
        lives = {ms: absent(cfg, lays[ms], gpu, adamw=adamw, timeout=args.timeout) for ms in (MS, REF)}
        return adapter_cls(lives, module, plan, seed=args.seed)

    ctl = Controller.join(adapter_for, keep_for=live_keep, wait=args.timeout * 10, **controller_args(args, faults))
    return ctl, stage_timer(ctl)


def control_options(module, args) -> ControlOptions:
    """The decision core's options for this tiny job."""
    return ControlOptions(
        recalibrate_every=0,
        slowdown=1e9,
        cooldown=1000,
        response_drift=1e9 if args.stay else 0.25,
        pg_init=0.0,
        engine_restart=0.0,
        margin=0.0,
        search_time_limit=2.0,
        schedule_time_limit=1.0,
        max_pp=1 if args.engine == "vllm" else module.models["actor"].layers,  # vLLM runs no PP here
        max_zero=3,  # DDP (0) or FSDP2 (3): live_keep drops the ZeRO-1/2 options
        offload=False,
    )


def measured(ctl) -> dict:
    """What the Controller measured of the step that just ended: each model-stage's seconds (its
    slowest rank) and the mean response length; empty on a step that moved (its record went with
    plan A)."""
    if not ctl.core.history:
        return {"stages": {}, "response_mean": None}
    record = ctl.core.history[-1]
    count, total, _ = record.responses
    return {"stages": dict(record.seconds), "response_mean": total / count if count else None}


def start_engines(cfg: LlamaConfig, module, args) -> EngineStage | None:
    """``--engine vllm``: ``actor.generate``'s engines under plan @a, started at once on every
    rank (their first start measured: what admission takes as an engine restart's cost); None
    for ``--engine hf``. Their weights come with the first ``push``."""
    if args.engine != "vllm":
        return None
    return EngineStage(cfg, module, "a", workdir=args.workdir, seed=args.seed, timeout=args.timeout)


def engine_row(engines: EngineStage, gap: float) -> dict:
    """What a step's row says of the engines: the last push (the engines' load behind it) and that
    load's own seconds, the rollout-vs-trainer
    log-probability gap of the step's samples, their layout, every start's seconds."""
    return {
        "push_s": round(engines.push_s[-1], 4),
        "load_s": round(engines.load_s[-1], 4),
        "streamed": engines.pusher.stats.streamed,  # tensors this rank's engine took as they landed
        "engine_gap": gap,
        "engines": shape(engines.layout),
        "engine_starts": [round(x, 2) for x in engines.starts],
    }


def engine_text(row: dict, history: list[dict]) -> str:
    """The engines' part of a step line: their layout, a restart this step, the push and load."""
    starts = row["engine_starts"]
    restarted = len(history) > 1 and len(starts) > len(history[-2]["engine_starts"])
    return (
        f"  engines {row['engines']}"
        + (f" (restarted in {starts[-1]:.1f} s)" if restarted else "")
        + (f" (started in {starts[0]:.1f} s)" if len(history) == 1 else "")
        + f"  push {row['push_s'] * 1e3:.1f} ms (the load behind it: {row['load_s'] * 1e3:.1f} ms)"
        + f"  gap {row['engine_gap']:.1e}"
    )


def main(argv=None, adapter_cls=JobAdapter, faults: tuple = (), group=None) -> dict:
    """The loop on this rank (after ``init_from_env``); returns what it saw (the test reads it).
    ``faults`` (``nereus.runtime.execute.Fault``) are injected into the controller's transitions
    (tests). ``group``: a process group of the caller's world (initialised already) that the job
    runs in, while the world's other ranks do something else; None: the whole world, which
    ``init_from_env`` joins."""
    args = parse(argv)
    torch.manual_seed(args.seed)
    if args.join:
        if args.engine != "hf":
            raise SystemExit("--join: the engines' vLLM groups cannot take a process that joins (--engine hf)")
        ctl, timed = joined(config(args.engine), args, faults, adapter_cls)
        adapter, engines, rank = ctl.adapter, None, ctl.rank
    else:
        if group is None:
            init_from_env(timeout=args.pg_timeout)
        elif args.engine != "hf":
            raise SystemExit("a caller's group: the engines' vLLM groups span the world (--engine hf)")
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        cfg, module = job(args, world)
        engines = start_engines(cfg, module, args)
        lives = live_models(cfg, module, args, group)
        adapter = adapter_cls(lives, module, "a", seed=args.seed, engines=engines, group=group)
        ctl, timed = controller(module, adapter, args, faults, group)
        if engines is not None:
            engines.push(adapter.lives[MS])
    plen = args.digits + 2
    history = []
    step = ctl.step_no
    while step < args.steps:
        lives = adapter.lives
        actor, ref = lives[MS], lives[REF]
        t0 = time.perf_counter()
        loss = None
        with ctl.step():
            seqs, reward, mask, engine_logp = rollout(actor, step, args, ctl, timed, engines)
            if rank == killed(step, args, ctl.members) and not ctl.failures:
                die()
            gap = None
            if engines is not None:
                # what the engines sampled with against what the trainer computes of the same tokens
                # before its update (verl's rollout-vs-trainer probability gap): were the weights
                # they served the actor's?
                logp = scored(actor, seqs, plen, ctl.group, lambda out, s: logp_of(out, s, plen))
                gap = float(((logp - engine_logp).abs() * mask).max())
            with ctl.stage(REF):
                ref_logp = scored(ref, seqs, plen, ctl.group, lambda out, s: logp_of(out, s, plen))
            mine = rows(actor, len(seqs))
            if mine is not None:
                with ctl.stage(MS):
                    loss = grpo_step(
                        actor,
                        ref_logp[mine],
                        seqs[mine],
                        plen,
                        reward[mine],
                        mask[mine],
                        args.group,
                        args.beta,
                        args.clip,
                    )
            if rank == leaver(step, args, ctl.members):
                ctl.leave()
        dec = ctl.last
        if ctl.redo:  # ranks died in this step: the survivors moved to a plan of their own; run it again
            if rank == ctl.members[0] and not args.quiet:
                lost = ctl.failures[-1]
                print(
                    f"step {step:3d}  GPUs {lost['gpus']} died: moved to @{dec.target} on GPUs {ctl.members} "
                    f"in {lost['recover_s']:.2f} s; the step runs again",
                    flush=True,
                )
            continue
        if engines is not None and ctl.active:  # the new weights (in the new layout after a move) to the engines
            engines.push(adapter.lives[MS], ctl.group, ctl.members)
        row = {
            "step": step,
            "plan": f"@{dec.source} {shape(actor.layout)}",
            "layouts": shapes(lives),
            "reward": float(reward.mean()),
            "loss": loss,
            "decision": dec.action,
            "forced": dec.forced,
            "target": dec.target,
            "seconds": round(time.perf_counter() - t0, 3),
            **measured(ctl),
        }
        if engines is not None:
            row.update(engine_row(engines, gap))
        history.append(row)
        if rank == ctl.members[0] and not args.quiet:
            print(
                f"step {step:3d}  plan @{dec.source} ({row['layouts']})  reward {row['reward']:.3f}  "
                f"loss {'-' if loss is None else f'{loss:+.4f}'}  "
                f"decision {dec.action}{' (forced)' if dec.forced else ''}"
                f"{' -> @' + dec.target if dec.action == 'transition' else ''}  {row['seconds']:.2f} s"
                + (engine_text(row, history) if engines is not None else ""),
                flush=True,
            )
        if not ctl.active:  # this rank handed its state over and leaves the job
            break
        step += 1
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
        "failures": ctl.failures,
        "joins": ctl.joins,
        "checkpoints": ctl.checkpoints,
        "gpu": ctl.rank,
    }


if __name__ == "__main__":
    out = main(sys.argv[1:])
    if out["active"] and out["rank"] == 0 and "--quiet" not in sys.argv:
        print(json.dumps({"final_plan": out["plan"], "final_reward": out["history"][-1]["reward"]}))
    if dist.is_initialized():
        dist.destroy_process_group()
