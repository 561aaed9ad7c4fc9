"""The reward model of ``ppo_tiny``: a tiny Hugging Face ``LlamaForSequenceClassification`` (one
label, the IR's value head) that learns the copy task's score from labelled samples, the way an
RLHF reward model is fitted before PPO; then it is frozen and PPO maximises its score.

    python examples/reward_model.py --out reward_model.pt

The samples are the task's prompts with responses that are right at each position with a
probability drawn per sample from U(0, 1) (a random token of the vocabulary elsewhere), so they
span what the actor samples from its first step, near random, to its last, near right. The label
is ``grpo_tiny.score``: the fraction of the ``L + 1`` answer positions right. The model's score of
a sequence is its value at the last position. The fit is AdamW on the squared error, on fresh
samples every step; the held-out R^2 and mean absolute error are printed (and returned). The
forward is the live model's (``llama_stages.LlamaStage`` over the whole model) on one process.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForSequenceClassification

sys.path.insert(0, str(Path(__file__).resolve().parent))
import grpo_tiny as g  # noqa: E402

from nereus.integrations.llama_stages import LlamaStage, prune  # noqa: E402


def samples(n: int, digits: int, alphabet: int, vocab: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` labelled sequences ``BOS d1 .. dL SEP r1 .. rL+1`` and their scores."""
    body = torch.randint(0, alphabet, (n, digits), generator=gen)
    prompt = torch.cat([torch.full((n, 1), g.BOS), body, torch.full((n, 1), g.SEP)], dim=1)
    want = torch.cat([body, torch.full((n, 1), g.EOS)], dim=1)
    right = torch.rand(n, 1, generator=gen)
    noise = torch.randint(0, vocab, want.shape, generator=gen)
    seqs = torch.cat([prompt, torch.where(torch.rand(want.shape, generator=gen) < right, want, noise)], dim=1)
    return seqs, g.score(seqs, digits + 2, digits)[0]


def train(
    cfg: LlamaConfig, *, digits: int, alphabet: int, steps: int = 300, rows: int = 128, lr: float = 1e-3, seed: int = 0
) -> tuple[dict[str, torch.Tensor], dict]:
    """The fitted model's state dict (Hugging Face names) and its held-out fit:
    ``{"r2", "mae", "seconds", "steps"}`` on 1,024 samples it never trained on."""
    cfg = LlamaConfig.from_dict(cfg.to_dict())
    cfg.num_labels = 1
    cfg._attn_implementation = "eager"
    cfg.use_cache = False
    torch.manual_seed(seed)
    model = LlamaForSequenceClassification(cfg).to(torch.float32)
    prune(model, 0, cfg.num_hidden_layers - 1, True, True)
    value = LlamaStage(model, True, True)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed * 31 + 7)
    test_x, test_y = samples(1024, digits, alphabet, cfg.vocab_size, torch.Generator().manual_seed(seed * 31 + 8))
    t0 = time.perf_counter()
    for _ in range(steps):
        x, y = samples(rows, digits, alphabet, cfg.vocab_size, gen)
        loss = ((value(x)[:, -1, 0] - y) ** 2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    seconds = time.perf_counter() - t0
    with torch.no_grad():
        pred = value(test_x)[:, -1, 0]
    fit = {
        "r2": float(1 - ((pred - test_y) ** 2).mean() / test_y.var()),
        "mae": float((pred - test_y).abs().mean()),
        "seconds": round(seconds, 2),
        "steps": steps,
    }
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, fit


def load_or_train(path: str | Path, cfg: LlamaConfig, *, digits: int, alphabet: int, seed: int = 0) -> dict:
    """The reward model's state dict from ``path``; if there is none, the first rank of the
    default group fits it (``train``) and saves it there while the others wait."""
    path = Path(path)
    if not path.exists() and (not dist.is_initialized() or dist.get_rank() == 0):
        state, fit = train(cfg, digits=digits, alphabet=alphabet, seed=seed)
        print(f"reward model: fitted in {fit['seconds']} s, held-out R^2 {fit['r2']:.4f}, MAE {fit['mae']:.4f}")
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").replace(path)
    if dist.is_initialized():
        dist.barrier()
    return torch.load(path, weights_only=True)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="reward_model.pt")
    p.add_argument("--digits", type=int, default=3)
    p.add_argument("--alphabet", type=int, default=4)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    state, fit = train(g.config(), digits=args.digits, alphabet=args.alphabet, steps=args.steps, seed=args.seed)
    torch.save(state, args.out)
    print(f"{args.out}: {fit['steps']} steps in {fit['seconds']} s, held-out R^2 {fit['r2']:.4f}, MAE {fit['mae']:.4f}")
    return fit


if __name__ == "__main__":
    main(sys.argv[1:])
