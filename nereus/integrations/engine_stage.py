"""The live ``actor.generate``: vLLM engines in the plan's generation layout, moved with the job.

``EngineStage(config, module, "a")`` is the model-stage the generation engines are. Its layout
(``plan.layouts["actor.generate"]``, TP ``t`` x DP ``d`` on a mesh) is served by vLLM engines of
TP ``t`` under ``external_launcher`` (``vllm_engine.VllmEngine``): every rank of the default
group starts one engine at once, ranks ``[k t, (k+1) t)`` forming engine ``k``, and replica ``i``
of the layout is the engine on ``mesh[i t:(i+1) t]``. Engines on ranks off the layout stay up,
idle, and serve again if a later layout takes them.

A move (``move(module, plan)``, every rank of the default group):

- to a layout of the same TP: the engines stay; only the replicas that generate change, and the
  weight push (``push``) is re-planned to the new engine ranks;
- to another TP: every engine is shut down (vLLM's groups go, the job's default group stays) and
  started again under the new TP. The seconds this takes, the slowest rank's, are
  ``restart_s``: what the Controller hands admission instead of its ``engine_restart`` prior.
  The first start is measured the same way, so admission sees this machine's cost from step 0.

The engines' weights are not part of the trainer's transition: vLLM's CPU build repacks its
linear weights at load, so they cannot be read back as shards. After every move and every
optimizer step ``push`` fills them from the trained actor (``weight_push.WeightPush``: a Nereus
transition from the trainer's layout to the engine ranks, in waves, each engine loading a wave
while the next is on the wire).

``check_engine_layout(module, plan, model_stage, world)`` is the IR check, before any state moves:
a layout vLLM refuses (pipeline stages: vLLM's V1 runner does not run them under
``external_launcher``; a TP that splits heads unevenly; a TP that does not divide the job; TP
groups that are not the blocks vLLM makes) is a ``DiagnosticError`` naming the model-stage.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import LlamaConfig

from ..ir import Diagnostic, DiagnosticError, Layout, Module, bare_name
from .hf_llama import LiveLlama, ir_model
from .vllm_engine import Sampled, VllmEngine


def check_engine_layout(module: Module, plan: str, model_stage: str, world: int) -> None:
    """Raise ``DiagnosticError`` where vLLM engines in this job of ``world`` ranks cannot take
    ``plan``'s layout of ``model_stage``; pure IR, so every rank raises the same."""
    plan = bare_name(plan)
    lay = module.plans[plan].layouts[model_stage]
    model = module.models[lay.model]
    at = lambda attr: lay.locs.get(attr, lay.loc)  # noqa: E731
    where = f"plan @{plan} {model_stage}"
    problems: list[Diagnostic] = []

    def bad(attr, msg, hint=None):
        problems.append(Diagnostic(at(attr), f"{where}: {msg}", hint))

    kind = module.workloads[module.plans[plan].workload].stage_of(model_stage).kind
    if kind != "generate":
        bad("tp", f"a {kind} model-stage: vLLM engines serve generate model-stages")
    if model.head != "lm":
        problems.append(
            Diagnostic(model.loc, f"{where}: model @{model.name} has a {model.head} head: vLLM samples from an LM")
        )
    if lay.pp > 1:
        bad(
            "pp",
            f"pp = {lay.pp}: vLLM does not run pipeline stages under external_launcher (its V1 runner)",
            "use pp = 1 for generation",
        )
    if lay.cp > 1:
        bad("cp", f"cp = {lay.cp}: vLLM's engines take no context parallelism here")

    def splits(t: int) -> bool:  # vLLM: heads over TP; K/V heads over TP, or replicated to it
        return model.heads % t == 0 and (model.kv_heads % t == 0 or t % model.kv_heads == 0)

    if not splits(lay.tp):
        bad(
            "tp",
            f"tp = {lay.tp}: vLLM splits {model.heads} heads and {model.kv_heads} K/V heads evenly over TP",
            "choose tp from " + ", ".join(str(t) for t in range(1, model.heads + 1) if splits(t)),
        )
    elif world % lay.tp:
        bad("tp", f"tp = {lay.tp} does not divide the job's {world} ranks: external_launcher makes world / tp engines")
    else:
        # an engine's ranks in any order: its TP shards are cut by vLLM from the whole tensors the
        # push delivers (on CPU), so the IR's order inside a TP group does not reach the engine
        groups = [lay.mesh[i : i + lay.tp] for i in range(0, len(lay.mesh), lay.tp)]
        off = [g for g in groups if sorted(g) != list(range(min(g), min(g) + lay.tp)) or min(g) % lay.tp]
        if off:
            bad(
                "mesh",
                f"TP group {off[0]} is not an engine: vLLM's TP groups are the rank blocks "
                f"[{lay.tp}k, {lay.tp}k + {lay.tp})",
                "place each replica on one such block",
            )
    if problems:
        raise DiagnosticError(problems)


class EngineStage:
    def __init__(
        self,
        config: LlamaConfig,
        module: Module,
        plan: str,
        *,
        model_stage: str = "actor.generate",
        workdir: str | Path | None = None,
        seed: int = 0,
        timeout: float = 60.0,
        max_model_len: int = 32,
    ):
        self.config, self.model_stage, self.seed, self.timeout = config, model_stage, seed, timeout
        self.max_model_len = max_model_len
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="nereus-vllm-"))
        check_engine_layout(module, plan, model_stage, self.world)
        self.layout: Layout = module.plans[bare_name(plan)].layouts[model_stage]
        self.model = ir_model(config, self.layout.model)
        self.pusher = None
        self.starts: list[float] = []  # seconds, slowest rank: the first start, then every restart
        self.push_s: list[float] = []
        self.load_s: list[float] = []
        self.engine = self._start(self.layout.tp)

    def _start(self, tp: int) -> VllmEngine:
        t0 = time.perf_counter()
        engine = VllmEngine(
            self.config, self.workdir / f"engine-{self.rank}", tp=tp, max_model_len=self.max_model_len, seed=self.seed
        )
        self.starts.append(self._slowest(time.perf_counter() - t0))
        return engine

    def _slowest(self, seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    @property
    def restart_s(self) -> float:
        """Seconds an engine restart takes on this job (the slowest rank): the last one measured,
        or the first start before any restart (a restart is a shutdown, ~2 s here, plus a start)."""
        return self.starts[-1]

    @property
    def coordinate(self) -> tuple[int, int, int] | None:
        """(dp, pp, tp) of this rank in the generation layout, or None off it (``stage_data``)."""
        if self.rank not in self.layout.mesh:
            return None
        i = self.layout.mesh.index(self.rank)
        return i // self.layout.tp, 0, i % self.layout.tp

    def check(self, module: Module, plan: str) -> None:
        """``check_engine_layout`` of plan's layout of this model-stage (before any state moves)."""
        check_engine_layout(module, plan, self.model_stage, self.world)

    def move(self, module: Module, plan: str) -> bool:
        """The engines under ``plan``'s layout, on every rank of the default group; True when
        they restarted (another TP). Their weights come with the next ``push``."""
        self.check(module, plan)
        new = module.plans[bare_name(plan)].layouts[self.model_stage]
        restart = new.tp != self.layout.tp
        if restart:
            t0 = time.perf_counter()
            self.engine.close(keep_world=True)
            self.engine = self._start(new.tp)
            self.starts[-1] = self._slowest(time.perf_counter() - t0)
        self.layout = new
        return restart

    def push(self, actor: LiveLlama, group=None, members: list[int] | None = None) -> None:
        """The trained actor's weights into the engines of the layout (every rank of ``group``
        calls it; after a shrink, the Controller's group of the ranks that remain, ``members``):
        a ``WeightPush`` from the trainer's layout to the engine ranks, re-planned when either moved,
        with each engine's load behind the transfer. ``push_s``: the push's seconds on this rank,
        the load behind it included; ``load_s``: the engine's load, from the first wave it took to
        its end (inside ``push_s``)."""
        from .weight_push import WeightPush

        ranks = sorted(self.layout.mesh)
        members = list(range(self.world)) if members is None else list(members)
        if (
            self.pusher is None
            or not self.pusher.serves(actor.layout)
            or self.pusher.engines != ranks
            or self.pusher.members != members
        ):
            self.pusher = WeightPush(
                self.model, actor.layout, ranks, self.world, timeout=self.timeout, group=group, members=members
            )
        # the engine loads each wave as it lands, while the next is on the wire (``push_into``)
        engine = self.engine if self.rank in ranks else None
        t0 = time.perf_counter()
        self.pusher.push_into(engine, actor)
        self.push_s.append(time.perf_counter() - t0)
        self.load_s.append(self.pusher.stats.load_s if engine is not None else 0.0)

    def generate(self, prompts: list[list[int]], n: int, max_tokens: int, seeds: list[int]) -> list[Sampled]:
        """``VllmEngine.generate`` on this rank's engine (every rank of a replica calls it with
        the same prompts and seeds)."""
        return self.engine.generate(prompts, n=n, max_tokens=max_tokens, seeds=seeds)

    def close(self) -> None:
        """The last thing a rank does with torch.distributed (``VllmEngine.close``)."""
        self.engine.close()
