"""What every rank runs in the vLLM engine tests (importable by spawned processes)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from nereus.integrations.hf_llama import batch, build, forward, ir_model, train_step
from nereus.integrations.job import layout
from nereus.integrations.vllm_engine import VllmEngine
from nereus.integrations.weight_push import WeightPush
from nereus.runtime.execute import Fault, TransitionError
from nereus.runtime.launch import init_from_env

SEED = 3


def config() -> dict:
    """A tiny Llama vLLM's CPU build serves: head_dim 64, float32; 2 layers, 4 heads, 2 K/V heads."""
    return dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=False,
        max_position_embeddings=64,
        eos_token_id=127,
        bos_token_id=126,
    )


def trainer_logp(live, seqs: torch.Tensor) -> torch.Tensor:
    """The trainer's log-probability of every token after the first ([rows, seq - 1])."""
    logits = forward(live, seqs)
    return torch.gather(F.log_softmax(logits[:, :-1].float(), dim=-1), 2, seqs[:, 1:, None]).squeeze(2)


def lower_bound(live) -> int:
    """The bytes this rank lacks for a whole model, from the live parameters alone (not the
    planner): every tensor's full size less the slice this rank's parameter holds."""
    total = 0
    for name, p in live.params().items():
        full, box = live.boxes[name]
        held = 1
        for lo, hi in box:
            held *= hi - lo
        total += (torch.Size(full).numel() - held) * p.element_size()
    return total


def push_and_score(rank: int, world: int, tp: int, workdir: str) -> dict:
    """The trainer under TP ``tp`` x DP ``world / tp``, an engine on every rank; push, sample,
    compare; an AdamW step, push again, compare; a push that fails."""
    init_from_env(timeout=120)
    cfg = LlamaConfig(**config())
    model = ir_model(cfg)
    lay = layout(model, tp=tp, dp=world // tp)
    live = build(cfg, lay, seed=SEED, timeout=60)
    engine = VllmEngine(cfg, f"{workdir}/engine-{rank}", max_model_len=64, seed=SEED)
    pusher = WeightPush(model, lay, list(range(world)), world, timeout=30)
    out = {"lower_bound": lower_bound(live), "planned_bytes": pusher.planned_bytes}
    engine.load(pusher.push(live))
    out["received"] = pusher.stats.bytes_received
    prompts = [[126, 5, 6, 7], [126, 9, 9]]
    sampled = engine.generate(prompts, n=2, max_tokens=6, seeds=[11, 12])
    rows = [p + t for p, s in zip(prompts, sampled) for t in s.tokens]
    width = max(map(len, rows))
    seqs = torch.tensor([r + [127] * (width - len(r)) for r in rows])
    ours = trainer_logp(live, seqs)
    # vLLM's log-probability of each token it sampled, against the trainer's of the same token
    diffs = []
    for i, (p, s) in enumerate((p, s) for p, smp in zip(prompts, sampled) for s in zip(smp.tokens, smp.logprobs)):
        toks, lps = s
        for j, lp in enumerate(lps):
            diffs.append(abs(lp - float(ours[i, len(p) - 1 + j])))
    out["sampled_diff"] = max(diffs)
    before = torch.tensor(engine.score(seqs.tolist()))
    out["score_diff_before"] = float((before - ours).abs().max())
    # an optimizer step: the engine must follow it after the next push, not before
    train_step(live, batch(cfg, 0, seed=SEED, rows=4, seq=16))
    stale = torch.tensor(engine.score(seqs.tolist()))
    new_ours = trainer_logp(live, seqs)
    out["stale_equal_before"] = torch.equal(stale, before)
    engine.load(pusher.push(live))
    after = torch.tensor(engine.score(seqs.tolist()))
    out["moved"] = float((after - before).abs().max())
    out["score_diff_after"] = float((after - new_ours).abs().max())
    # a push that fails: TransitionError on every rank, and the engine keeps serving what it had
    train_step(live, batch(cfg, 1, seed=SEED, rows=4, seq=16))
    try:
        engine.load(pusher.push(live, faults=(Fault("raise", rank=1),), timeout=3))
        out["failed_push"] = None
    except TransitionError as e:
        out["failed_push"] = str(e)
    out["kept"] = torch.equal(torch.tensor(engine.score(seqs.tolist())), after)
    # no collective after the failure: on gloo the timed-out receive closed the default group's pair
    engine.close()  # last: it destroys the default group
    return out


def stream_and_score(rank: int, world: int, tp: int, workdir: str, port: int) -> dict:
    """The push with the engine's load behind it (``push_into``): the same weights as the plain
    push, bit for bit, and what the engine serves from them; then a streamed push that fails after
    the first waves (the engine torn, refusing to score), and the retry on a fresh group."""
    from nereus.runtime.private_group import PrivateGroup

    init_from_env(timeout=120)
    cfg = LlamaConfig(**config())
    model = ir_model(cfg)
    lay = layout(model, tp=tp, dp=world // tp)
    live = build(cfg, lay, seed=SEED, timeout=60)
    engine = VllmEngine(cfg, f"{workdir}/engine-{rank}", max_model_len=64, seed=SEED)
    pusher = WeightPush(model, lay, list(range(world)), world, timeout=30)
    seqs = [[126, 5, 6, 7, 8, 9], [126, 9, 9, 3, 4, 127]]
    out = {"waves": pusher.waves, "rounds": len(pusher.streamed.round_levels)}
    plain = pusher.push(live)
    engine.load(plain)
    served = engine.score(seqs)
    train_step(live, batch(cfg, 0, seed=SEED, rows=4, seq=16))
    new_plain = pusher.push(live)  # what the streamed push must deliver, for the comparison only
    streamed = pusher.push_into(engine, live)
    out["received"], out["lower_bound"] = pusher.stats.bytes_received, lower_bound(live)
    out["same_tensors"] = set(streamed) == set(new_plain) and all(
        torch.equal(streamed[k], new_plain[k]) for k in new_plain
    )
    after = torch.tensor(engine.score(seqs))
    out["moved"] = float((after - torch.tensor(served)).abs().max())
    out["score_diff"] = float((after - trainer_logp(live, torch.tensor(seqs))).abs().max())
    engine.load(new_plain)  # the plain push's tensors, loaded whole, serve bit for bit the same
    out["same_served"] = torch.equal(torch.tensor(engine.score(seqs)), after)
    # a streamed push that fails in round 2 (after the first waves reached the engine on rank 0)
    train_step(live, batch(cfg, 1, seed=SEED, rows=4, seq=16))
    try:
        pusher.push_into(engine, live, faults=(Fault("raise", rank=1, round=2),), timeout=3)
        out["failed_push"] = None
    except TransitionError as e:
        out["failed_push"] = str(e)
    out["torn"], out["taken"], out["tensors"] = engine.torn, pusher.stats.streamed, len(new_plain)
    try:
        engine.score(seqs)
        out["refused"] = None
    except RuntimeError as e:
        out["refused"] = str(e)
    # the retry, on a group of its own (the default group saw the failure)
    group = PrivateGroup("127.0.0.1", port, rank, world, timeout=30)
    retry = WeightPush(model, lay, list(range(world)), world, timeout=30, group=group, members=list(range(world)))
    retry.push_into(engine, live)
    out["torn_after_retry"] = engine.torn
    served = engine.score(seqs)
    out["retry_diff"] = float((torch.tensor(served) - trainer_logp(live, torch.tensor(seqs))).abs().max())
    # a push that fails before rank 1's engine takes anything (its state does not match the
    # program): that engine is untouched and serves on; rank 0's took its kept norms first
    train_step(live, batch(cfg, 2, seed=SEED, rows=4, seq=16))
    try:
        retry.push_into(engine, live, state={} if rank == 1 else None, timeout=3)
        out["bad_state"] = None
    except TransitionError as e:
        out["bad_state"] = str(e)
    out["bad_state_torn"], out["bad_state_taken"] = engine.torn, retry.stats.streamed
    out["bad_state_serves_on"] = not engine.torn and engine.score(seqs) == served
    group.close()
    engine.close()
    return out
