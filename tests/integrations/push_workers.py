"""What every rank runs in the weight-push tests without vLLM (importable by spawned processes)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig

from nereus.integrations.hf_llama import batch, build, ir_model, train_step
from nereus.integrations.job import layout
from nereus.integrations.weight_push import WeightPush, hf_name
from nereus.runtime.launch import init_from_env

from . import workers as w


def push_from_fsdp(rank: int, world: int, tp: int, engines: list[int]) -> dict:
    """The actor under FSDP2 (``zero = 3``) x TP ``tp`` on every rank, two AdamW steps, each
    followed by a push to the ranks ``engines``: what an engine rank receives against torch's own
    ``full_tensor`` of every parameter (a collective: every rank gathers)."""
    init_from_env(timeout=60)
    cfg = LlamaConfig(**w.tiny())
    model = ir_model(cfg)
    lay = layout(model, tp=tp, dp=world // tp, zero=3)
    live = build(cfg, lay, seed=5, timeout=30)
    pusher = WeightPush(model, lay, engines, world, timeout=30)
    out = {"rank": rank, "gather_dp": pusher.gather_dp, "pushes": []}
    for step in range(2):
        train_step(live, batch(cfg, step, seed=5, rows=4, seq=8))
        pushed = pusher.push(live)
        with torch.no_grad():
            full = {hf_name(n): p.full_tensor() for n, p in live.params().items()}
        out["pushes"].append(
            {
                "names": sorted(pushed) == sorted(full) if pushed else None,
                "exact": all(torch.equal(t, full[n]) for n, t in pushed.items()) if pushed else None,
                "received": pusher.stats.bytes_received,
            }
        )
    out["full_bytes"] = sum(t.numel() * t.element_size() for t in full.values())
    return out


def recompute_twins(rank: int, world: int, tp: int, zero: int) -> dict:
    """Two live actors of one seed under TP ``tp`` x DP ``world / tp`` (``zero``), one with
    ``recompute``: three AdamW steps each; the losses and the parameters after, and how many
    times decoder layer 0 ran forward in the last step."""
    init_from_env(timeout=60)
    cfg = LlamaConfig(**w.tiny())
    model = ir_model(cfg)
    out: dict = {"rank": rank}
    for recompute in (False, True):
        lay = layout(model, tp=tp, dp=world // tp, zero=zero)
        lay.recompute = recompute
        live = build(cfg, lay, seed=7, timeout=30)
        calls = []
        live.model.model.layers["0"].register_forward_pre_hook(lambda *_: calls.append(1))
        losses = []
        for step in range(3):
            calls.clear()
            losses.append(train_step(live, batch(cfg, step, seed=7, rows=4, seq=8)))
        with torch.no_grad():
            params = {
                n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
                for n, p in live.params().items()
            }
        out[recompute] = {"losses": losses, "params": params, "layer0_forwards": len(calls)}
    out["same_losses"] = out[False]["losses"] == out[True]["losses"]
    out["same_params"] = all(torch.equal(out[False]["params"][n], t) for n, t in out[True]["params"].items())
    return {k: out[k] for k in ("rank", "same_losses", "same_params")} | {
        "forwards": (out[False]["layer0_forwards"], out[True]["layer0_forwards"])
    }


def push_from_plain_fsdp(rank: int, world: int) -> dict:
    """A plain Hugging Face Llama under FSDP2 on a one-dimensional mesh (accelerate's: no ``dp``
    name), pushed by ``state_of_params`` (the TRL sync's path) to an engine on every rank: what
    each rank gets against torch's own ``full_tensor`` of every parameter."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    from nereus.integrations.hf_checkpoint import ir_name

    init_from_env(timeout=60)
    cfg = LlamaConfig(**w.tiny())
    torch.manual_seed(3)
    model = LlamaForCausalLM(cfg)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    lay = layout(ir_model(cfg), dp=world, zero=3)
    pusher = WeightPush(ir_model(cfg), lay, list(range(world)), world, timeout=30)
    params = {ir_name(n): p for n, p in model.named_parameters()}
    pushed = pusher.push_state(pusher.state_of_params(params))
    with torch.no_grad():
        full = {n: p.full_tensor() for n, p in model.named_parameters()}
    return {
        "sharded": all(type(p).__name__ == "DTensor" for p in model.parameters()),
        "names": sorted(pushed) == sorted(full),
        "exact": all(torch.equal(t, full[n]) for n, t in pushed.items()),
        "received": pusher.stats.bytes_received,
    }
