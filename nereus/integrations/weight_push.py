"""The actor's weights, from its training layout to the generation engines, by a Nereus transition.

In an RL step the trainer updates the actor and the generation engines must serve the new
weights before the next rollout. The engines' layout is one more plan of the actor's weights:
``WeightPush`` builds a weights-only job (``job.training_job`` of ``actor.generate`` layouts) with two
plans of the actor's ``generate`` model-stage:

- ``@held``: the trainer's layout (its TP, PP, DP, layer ranges and GPUs): where the weights are;
- ``@engine``: one engine per engine rank, each holding the whole model (TP 1 x DP ``n``): where
  they must be. (vLLM's CPU build takes whole Hugging Face tensors at a reload and cuts its own
  TP shards, so on CPU an engine rank needs every byte of every tensor; see docs/embedding.md
  for GPUs.)

``plan-transition{source=@held,to=@engine,drain=true}`` plans the fewest bytes (a rank already
holding a slice keeps it; ranks off the engines still send), and ``lower`` makes the program
once: the layouts do not change between steps, so every push runs the same program
(``execute``), with this rank's live parameters (views, never written) as plan A's state.
What comes out on an engine rank is every tensor whole, named as Hugging Face names them, for
the engine's own load step (``VllmEngine.load``).

From an FSDP2 trainer (``zero = 3``: the weights sharded over DP), each DP group first gathers
its weights back to their TP shards (``DTensor.redistribute`` of the DP placement to
``Replicate``: torch's all-gather, ``_StridedShard`` included), which is ``@held`` with
``zero = 0``; the push program then runs from there. The gather moves ``(dp - 1) / dp`` of the
weights into every trainer rank, engine or not (verl's FSDP -> vLLM sync gathers the same way).

``push_into(engine, live)`` hides the engine's own load behind the transfer: the same transition
lowered in ``waves`` rounds (the model's tensors in the order the engine loads them, cut into
runs), run on a thread of its own, each round's tensors handed to the engine's loader
(``VllmEngine.load`` of a ``WeightStream``: vLLM's ``reload_weights`` processes a layer as soon as
its weights are in) while the next round is on the wire, as verl's checkpoint engine receives a
bucket while the engine loads the last. The engine takes tensors before the commit agreement, so
a push that fails after the first wave leaves it ``torn``: it refuses to generate or score until
a push completes, and the trainer's weights, untouched, are pushed again. No rollout comes from
mixed weights.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from ..backend.shards import StateKey, plan_layout
from ..ir import Layout, Model, Module
from ..ir.diagnostics import plural
from ..runtime.execute import Stats, execute
from ..runtime.private_group import is_private
from .hf_llama import PREFIX, LiveLlama
from .job import training_job
from .llama_state import live_tensor
from .move import plan_move

MAX_WAVES = 16  # more rounds add per-round latency and checksum messages for little more overlap


def hf_name(name: str) -> str:
    """The Hugging Face name of an IR tensor name (``layers.0.mlp.up_proj.weight`` ->
    ``model.layers.0.mlp.up_proj.weight``; ``lm_head.weight`` stays)."""
    return name if name.startswith("lm_head") else PREFIX + name


def _key(lay: Layout) -> tuple:
    return (
        lay.tp,
        lay.pp,
        lay.dp,
        lay.cp,
        lay.zero,
        tuple(map(tuple, lay.layers)),
        tuple(lay.mesh),
        lay.ep,
        lay.expert_tp,
    )


def gathered_over_dp(p: torch.Tensor) -> torch.Tensor:
    """An FSDP2 parameter (a DTensor over a mesh with a ``dp`` dimension) as the local tensor it
    is with its DP placement made ``Replicate``: the TP shard whole (the whole tensor without TP).
    A collective over the DP group."""
    if not isinstance(p, DTensor):
        return p.detach()
    if "dp" not in (p.device_mesh.mesh_dim_names or ()):
        if p.device_mesh.ndim == 1:  # FSDP2 over a one-dimensional mesh (accelerate's): all of it is DP
            return p.detach().full_tensor()
        return p.detach()
    placements = list(p.placements)
    placements[p.device_mesh.mesh_dim_names.index("dp")] = Replicate()
    return p.detach().redistribute(p.device_mesh, placements).to_local()


class WeightStream:
    """A push's weights as its waves land, for an engine's loader: ``put`` (on the pushing
    thread) queues each wave's (Hugging Face name, tensor) pairs; iterating takes them until the
    push ends (it always ends: the pushing thread closes the stream, and each of its waits is
    bounded). ``complete``: the push committed and every tensor was taken; ``taken``: the pairs
    taken. ``abandon``: the loader failed, and the next ``put`` fails the push on this rank (so
    every rank rolls back)."""

    _END = object()

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._head: list | None = None  # the first item, when ``first`` took it
        self.complete, self.abandoned, self.taken = False, None, 0
        self.load_s = 0.0  # the engine's load of it, from the first wave it took to its end (``load_behind``)

    def put(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        if self.abandoned is not None:
            raise RuntimeError(f"the engine stopped loading ({self.abandoned})")
        self._queue.put(pairs)

    def close(self, error: BaseException | None = None) -> None:
        self._queue.put(self._END if error is None else error)

    def abandon(self, error: BaseException) -> None:
        self.abandoned = error

    def _next(self) -> list | None:
        """The next wave, or None where the push ended (``complete`` if it committed)."""
        item, self._head = (self._head, None) if self._head is not None else (self._queue.get(), None)
        if item is self._END:
            self.complete = True
        return None if item is self._END or isinstance(item, BaseException) else item

    def first(self) -> bool:
        """Wait for the first wave: true if the push handed tensors, false if it ended first
        (then ``complete`` says whether it committed, with nothing for this engine)."""
        self._head = self._next()
        return self._head is not None

    def __iter__(self):
        while (item := self._next()) is not None:
            for pair in item:
                self.taken += 1
                yield pair


def load_behind(engine, push, stream: WeightStream | None = None):
    """Run ``push(put)`` on a thread of its own while ``engine`` loads what it ``put``s, as it
    comes (``stream``, a new ``WeightStream`` by default); returns ``push``'s result. The engine's load
    starts with the first wave: a push that fails before it leaves the engine as it was.
    ``push``'s error is raised once the engine has stopped loading (chained to the engine's, if
    the engine failed too); an engine error alone abandons the stream, which fails ``push`` at
    its next ``put``, and is raised. Raises ``RuntimeError`` if ``push`` succeeded but the
    engine did not take the whole stream (it is then torn). The thread runs on the caller's CUDA
    device, where there is one."""
    stream = WeightStream() if stream is None else stream
    result: dict = {}
    device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def run():
        try:
            if device is not None:  # the current device is per thread
                torch.cuda.set_device(device)
            result["value"] = push(stream.put)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            result["error"] = e
        finally:
            stream.close(result.get("error"))

    pushing = threading.Thread(target=run, name="nereus-push", daemon=True)
    pushing.start()
    failed: BaseException | None = None
    try:
        if stream.first():
            stream.load_s = engine.load(stream)
    except BaseException as e:  # noqa: BLE001 - raised below, after the push has ended
        stream.abandon(e)
        failed = e
    pushing.join()
    if "error" in result:
        raise result["error"] from failed
    if failed is not None:
        raise failed
    if not stream.complete:
        raise RuntimeError("the push completed but the engine stopped loading before its end: it is torn")
    return result["value"]


@dataclass
class PushStats:
    pushes: int = 0
    seconds: list[float] = field(default_factory=list)  # execute, per push
    bytes_received: int = 0  # by this rank, in the last push
    bytes_sent: int = 0  # by this rank, in the last push
    streamed: int = 0  # tensors this rank's engine took in the last ``push_into`` (failed or not)
    load_s: float = 0.0  # seconds of this rank's engine's load in the last ``push_into`` that completed


class WeightPush:
    """The push of ``model``'s weights from the trainer's ``held`` layout to engines on ``engines``
    (GPU ids = ranks of the default group, which has ``world`` ranks). Every rank constructs it
    (planning and lowering are pure: every rank gets the same program) and calls ``push``;
    after a shrink, every rank of ``group`` (its ranks ``members`` of the default group).
    ``waves``: the rounds ``push_into`` streams in (default: one per layer, plus the first and
    last stages' tensors, at most ``MAX_WAVES``)."""

    def __init__(
        self,
        model: Model,
        held: Layout,
        engines: list[int],
        world: int,
        *,
        timeout: float = 60.0,
        group=None,
        members: list[int] | None = None,
        waves: int | None = None,
    ):
        if not engines or len(set(engines)) != len(engines) or not all(0 <= g < world for g in engines):
            raise ValueError(
                f"engine ranks {engines} must be distinct ranks of the {plural(world, 'process', 'processes')}"
            )
        self.model, self.engines, self.world, self.timeout = model, sorted(engines), world, timeout
        self.group = group  # the process group the push runs in (None: the default group), its
        self.members = members  # ranks in the default group (the GPUs of its ranks, in order)
        self.held_key = _key(held)
        if held.zero in (1, 2) and held.dp > 1:
            raise ValueError(
                f"{held.model_stage}: zero = {held.zero}: the live trainer's ZeRO is FSDP2 (zero = 3) or none"
            )
        self.gather_dp = held.zero == 3 and held.dp > 1  # FSDP2: gathered over DP first (``state_of``)
        stage = f"{model.name}.generate"
        held = Layout(
            model_stage=stage,
            tp=held.tp,
            pp=held.pp,
            dp=held.dp,
            cp=held.cp,
            layers=list(held.layers),
            mesh=list(held.mesh),
            ep=held.ep,  # an expert-parallel trainer holds only its EP rank's experts
            etp=held.etp,
        )
        engine = Layout(
            model_stage=stage, tp=1, pp=1, dp=len(self.engines), layers=[(0, model.layers - 1)], mesh=list(self.engines)
        )
        m = training_job(model, {"held": held, "engine": engine}, world)
        self.module: Module = m
        self.program = plan_move(m, "held", "engine", "push", world, gpus=members)
        self.waves = waves if waves is not None else min(MAX_WAVES, model.layers + 2)
        self._streamed = None  # the program ``push_into`` runs, lowered at its first call
        self.held_specs = plan_layout(self.module, "held")
        self.stats = PushStats()

    @property
    def gpu(self) -> int:
        """This process's GPU id in the plans: its rank in a private group (``PrivateGroup``), else
        its rank in the default group."""
        return self.group.rank if is_private(self.group) else dist.get_rank()

    def serves(self, layout: Layout) -> bool:
        """Whether this push was planned from ``layout`` (the trainer's, which a move changes)."""
        return _key(layout) == self.held_key

    @property
    def planned_bytes(self) -> int:
        """Bytes the transition moves over the wire in all (the planner's figure)."""
        return int(self.module.transitions["push"].bytes_moved or 0)

    def state_of(self, live: LiveLlama) -> dict[StateKey, torch.Tensor]:
        """This rank's weight shards under ``@held`` (views of the live parameters; under FSDP2
        the TP shards gathered over DP), checked box by box."""
        if live.model is None:
            return {}
        specs = self.held_specs.get(dist.get_rank(), [])
        params = live.params()
        if not self.gather_dp:
            return {s.key: live_tensor(live, params, s) for s in specs}
        out = {}
        with torch.no_grad():
            for s in specs:
                t = gathered_over_dp(params[s.key.tensor])
                if tuple(t.shape) != tuple(hi - lo for lo, hi in s.box):
                    raise ValueError(
                        f"{s.key}: gathered over DP the live tensor is {tuple(t.shape)}; "
                        f"the plan says {s.box} of {s.shape}"
                    )
                out[s.key] = t
        return out

    def state_of_params(self, params: dict[str, torch.Tensor]) -> dict[StateKey, torch.Tensor]:
        """This rank's weight shards under ``@held`` from a plain model's parameters (IR tensor
        name -> parameter: whole tensors, or FSDP2 DTensors gathered over DP first), for a
        trainer that holds the whole model on every rank (no TP, no PP), as TRL's and
        accelerate's DDP and FSDP2 do; each checked against the plan's shape."""
        specs = self.held_specs.get(self.gpu, [])
        out = {}
        with torch.no_grad():
            for s in specs:
                p = params.get(s.key.tensor)
                if p is None:
                    raise KeyError(f"{s.key}: the trainer's model has no parameter {s.key.tensor}")
                t = gathered_over_dp(p) if self.gather_dp else p.detach()
                if tuple(t.shape) != tuple(hi - lo for lo, hi in s.box):
                    raise ValueError(
                        f"{s.key}: the trainer's tensor is {tuple(t.shape)}; the plan says {s.box} of {s.shape}"
                    )
                out[s.key] = t
        return out

    def push(self, live: LiveLlama, faults: tuple = (), timeout: float | None = None) -> dict[str, torch.Tensor]:
        """Run the push on this rank (every rank calls it); on an engine rank, every weight whole,
        by Hugging Face name; ``{}`` elsewhere. Raises ``TransitionError`` (the trainer's weights
        untouched) when it fails: then the default group must be re-created before the next
        collective (the executor's contract), and the engines still hold the last weights they
        loaded."""
        return self.push_state(self.state_of(live), faults, timeout)

    def push_state(
        self, state: dict[StateKey, torch.Tensor], faults: tuple = (), timeout: float | None = None
    ) -> dict[str, torch.Tensor]:
        """``push`` from this rank's ``@held`` state as given (``state_of`` or ``state_of_params``)."""
        return self._run(self.program, state, faults, timeout)

    @property
    def streamed(self):
        """The push lowered in ``waves`` rounds, in the order an engine loads the model."""
        if self._streamed is None:
            self._streamed = plan_move(
                self.module, "held", "engine", "push", self.world, gpus=self.members, waves=self.waves
            )
        return self._streamed

    def push_into(
        self,
        engine,
        live: LiveLlama | None = None,
        *,
        state: dict[StateKey, torch.Tensor] | None = None,
        faults: tuple = (),
        timeout: float | None = None,
    ) -> dict[str, torch.Tensor]:
        """``push`` with this rank's ``engine`` (None on a rank without one) loading each wave as
        it lands while the next is on the wire; returns what ``push`` returns. Every rank calls
        it, with ``live`` or its ``@held`` ``state``. On failure it raises ``TransitionError``
        (the trainer's weights untouched); an engine that took part of the new weights is then
        ``torn`` (it refuses to generate until a push completes). A loader that fails fails the
        push on every rank, if the push has not committed yet."""
        state = self.state_of(live) if state is None else state
        if engine is None:
            return self._run(self.streamed, state, faults, timeout)

        def push(put):
            def ready(shards):
                put([(hf_name(k.tensor), t) for k, t in shards.items() if k.state == "weight"])

            return self._run(self.streamed, state, faults, timeout, ready=ready)

        stream = WeightStream()
        try:
            return load_behind(engine, push, stream)
        finally:
            self.stats.streamed, self.stats.load_s = stream.taken, stream.load_s

    def _run(self, program, state, faults, timeout, ready=None) -> dict[str, torch.Tensor]:
        stats = Stats()
        t0 = time.perf_counter()
        new = execute(
            program,
            state,
            timeout=self.timeout if timeout is None else timeout,
            faults=faults,
            stats=stats,
            group=self.group,
            ready=ready,
        )
        self.stats.seconds.append(time.perf_counter() - t0)
        self.stats.pushes += 1
        self.stats.bytes_received = stats.received
        self.stats.bytes_sent = stats.sent
        return {hf_name(k.tensor): t for k, t in new.items() if k.state == "weight"}
