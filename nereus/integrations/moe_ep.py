"""Expert parallelism for a live Hugging Face mixture of experts, with torch's own collectives.

transformers 5 keeps a mixture of experts' experts fused (``mlp.experts.gate_up_proj``,
``[experts, 2 x expert_ffn, hidden]``; ``mlp.experts.down_proj``, ``[experts, hidden,
expert_ffn]``: Qwen3-MoE, Qwen2-MoE, Mixtral). ``ExpertParallel`` replaces that module on every
layer with this rank's block of experts (``Layout.expert_rank``'s EP rank ``i`` holds experts
``[i E / ep, (i + 1) E / ep)``, the IR's rule) and runs them as Megatron's all-to-all dispatcher
does: every token's top-k copies go to the ranks that hold their experts
(``all_to_all_single`` over the EP group), each rank runs its experts on what it received, and
the outputs come back the same way to be weighted and summed. Autograd runs the same exchange in
reverse (``_AllToAll``), so an expert's gradient sums every token routed to it from any rank.

``LiveMoe`` is one rank of a data-parallel job: the dense layers and the router replicated on
every rank, the experts carved by ``ep`` (expert-DP = world / ep ranks hold each block), Adam
(fp32) over all of it. ``step`` averages gradients as one global batch would: dense gradients over
every rank, expert gradients over their expert-DP group (a2a already summed the EP group's
tokens), both divided by the number of ranks.

``export_state`` / ``load_state`` map the live parameters and Adam's moments to Nereus shards
(``StateKey``s of the IR's names: ``layers.0.mlp.experts.3.up_proj.weight``), each a view of the
live tensor, so a transition planned between two EP layouts moves the job's state.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..backend.shards import ShardSpec
from ..ir import Layout, Model
from ..ir.model import even_split
from ..runtime.state import LocalState
from .hf_checkpoint import ir_name

ADAM = ("exp_avg", "exp_avg_sq")


class _AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` with its adjoint as backward: the gradient travels back with
    the splits swapped."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    return _AllToAll.apply(x, send, recv, group)


class ExpertParallel(nn.Module):
    """This rank's experts ``[first, last)`` of a fused HF experts module, run across the EP group."""

    def __init__(self, experts: nn.Module, ep: int, ep_rank: int, group):
        super().__init__()
        n = experts.gate_up_proj.shape[0]
        self.bounds = [even_split(n, ep, r) for r in range(ep)]
        self.first, self.last = self.bounds[ep_rank]
        self.gate_up_proj = nn.Parameter(experts.gate_up_proj.detach()[self.first : self.last].clone())
        self.down_proj = nn.Parameter(experts.down_proj.detach()[self.first : self.last].clone())
        self.act_fn = experts.act_fn
        self.group = group
        self.starts = torch.tensor([lo for lo, _ in self.bounds[1:]], dtype=torch.long)

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, k = top_k_index.shape
        expert = top_k_index.reshape(-1)
        owner = torch.bucketize(expert, self.starts, right=True)  # the EP rank holding each copy's expert
        order = torch.argsort(owner, stable=True)
        send = torch.bincount(owner, minlength=len(self.bounds))
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        send_l, recv_l = send.tolist(), recv.tolist()
        token = torch.arange(tokens).repeat_interleave(k)[order]
        x = all_to_all(hidden[token], send_l, recv_l, self.group)
        ids = torch.empty(sum(recv_l), dtype=expert.dtype)
        dist.all_to_all_single(ids, expert[order].contiguous(), recv_l, send_l, group=self.group)
        y = torch.zeros_like(x)
        for e in range(self.first, self.last):
            rows = torch.nonzero(ids == e).squeeze(-1)
            if len(rows):
                gate, up = nn.functional.linear(x[rows], self.gate_up_proj[e - self.first]).chunk(2, dim=-1)
                h = nn.functional.linear(self.act_fn(gate) * up, self.down_proj[e - self.first])
                y = y.index_copy(0, rows, h)
        back = all_to_all(y, recv_l, send_l, self.group)
        weight = top_k_weights.reshape(-1)[order].unsqueeze(-1).to(back.dtype)
        return torch.zeros_like(hidden).index_add(0, token, back * weight)


def expert_groups(world: int, ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """(EP groups, expert-DP groups) of ``world`` data-parallel ranks (tp 1): EP ranks fastest, as
    ``Layout.expert_rank`` carves them."""
    ep_groups = [list(range(d * ep, (d + 1) * ep)) for d in range(world // ep)]
    edp_groups = [list(range(r, world, ep)) for r in range(ep)]
    return ep_groups, edp_groups


class LiveMoe:
    """One rank of a data-parallel HF mixture of experts with ``ep``-way expert parallelism."""

    def __init__(self, model: nn.Module, ir: Model, layout: Layout, lr: float = 1e-3):
        rank, world = dist.get_rank(), dist.get_world_size()
        if layout.tp != 1 or layout.pp != 1 or layout.replicas != world or layout.expert_tp != 1:
            raise ValueError("LiveMoe runs data parallel over every rank (tp 1, pp 1, etp 1) with ep experts")
        self.model, self.ir, self.layout = model, ir, layout
        ep = layout.ep
        self.ep_rank, _, _ = layout.expert_rank(rank, 0)
        # every rank makes every group, in the same order (new_group is collective)
        ep_groups, edp_groups = expert_groups(world, ep)
        made_ep = [dist.new_group(g) for g in ep_groups]
        made_edp = [dist.new_group(g) for g in edp_groups]
        self.ep_group = made_ep[rank // ep]
        self.edp_group = made_edp[rank % ep]
        self.experts: list[ExpertParallel] = []
        for layer in model.model.layers:
            fused = layer.mlp.experts
            layer.mlp.experts = ExpertParallel(fused, ep, self.ep_rank, self.ep_group)
            self.experts.append(layer.mlp.experts)
        self.optimizer = torch.optim.Adam(model.parameters(), lr=lr)

    def expert_params(self) -> set[int]:
        return {id(p) for e in self.experts for p in (e.gate_up_proj, e.down_proj)}

    def step(self, input_ids: torch.Tensor) -> float:
        """One optimizer step on this rank's batch; returns the global batch's mean loss."""
        world = dist.get_world_size()
        self.optimizer.zero_grad()
        loss = self.model(input_ids, labels=input_ids).loss
        loss.backward()
        experts = self.expert_params()
        for p in self.model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=self.edp_group if id(p) in experts else None)
            p.grad /= world
        self.optimizer.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        return float(total) / world

    # ------------------------------------------------------------ Nereus shards
    def named_views(self) -> dict[str, tuple[nn.Parameter, tuple]]:
        """IR tensor name -> (the live parameter, the index of its view): each expert's gate, up
        and down projections inside this rank's fused block."""
        out: dict[str, tuple[nn.Parameter, tuple]] = {}
        f = self.ir.expert_ffn
        for name, p in self.model.named_parameters():
            key = ir_name(name)
            layer, sep, what = key.partition(".mlp.experts.")
            if not sep:
                out[key] = (p, ())
                continue
            block = self.experts[int(layer.split(".")[1])]
            for e in range(block.first, block.last):
                gate, up, down = self.ir.expert_families(e)
                if what == "gate_up_proj":
                    out[f"{layer}.{gate}"] = (p, (e - block.first, slice(0, f)))
                    out[f"{layer}.{up}"] = (p, (e - block.first, slice(f, 2 * f)))
                else:
                    out[f"{layer}.{down}"] = (p, (e - block.first,))
        return out

    def export_state(self, specs: list[ShardSpec]) -> LocalState:
        """This rank's shards under its layout (``plan_layout``'s list for this GPU), as views."""
        views = self.named_views()
        out: LocalState = {}
        for spec in specs:
            p, index = views[spec.key.tensor]
            if spec.key.state in ("weight", "master"):  # fp32 training: the parameter is the master copy
                t = p.data[index]
            else:
                t = self.optimizer.state[p][spec.key.state][index]
            if tuple(t.shape) != spec.local_shape or any(lo != 0 for lo, _ in spec.box):
                raise ValueError(f"{spec.key.tensor}: the live tensor {tuple(t.shape)} is not the shard {spec.box}")
            out[spec.key] = t
        return out

    def adam_step(self) -> int:
        steps = {int(s["step"]) for s in self.optimizer.state.values()}
        if len(steps) > 1:
            raise ValueError(f"Adam's steps differ between parameters: {sorted(steps)}")
        return steps.pop() if steps else 0

    def load_state(self, state: LocalState, step: int) -> None:
        """Write a plan-B ``LocalState`` (this rank's shards of this layout) into the live model
        and a fresh Adam state at ``step``."""
        views = self.named_views()
        for p in self.model.parameters():
            self.optimizer.state[p] = {
                "step": torch.tensor(float(step)),
                "exp_avg": torch.zeros_like(p),
                "exp_avg_sq": torch.zeros_like(p),
            }
        written: set[tuple[str, str]] = set()
        for key, t in sorted(state.items(), key=lambda kv: kv[0].state == "master"):  # weights first
            p, index = views[key.tensor]
            if key.state == "master":
                if not torch.equal(p.data[index], t):
                    raise ValueError(f"{key.tensor}: master differs from weight")
                continue
            target = p.data if key.state == "weight" else self.optimizer.state[p][key.state]
            target[index].copy_(t)
            written.add((key.state, key.tensor))
        missing = [(s, n) for n in views for s in ("weight", *ADAM) if (s, n) not in written]
        if missing:
            raise ValueError(f"the state lacks {len(missing)} shards, e.g. {missing[0]}")
