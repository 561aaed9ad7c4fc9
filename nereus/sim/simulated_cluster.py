"""The simulated cluster: what a plan really costs at a step of a trace.

Two truths. ``event`` plays the step out (``sim.truth.EventTruth``: kernels by shape,
collectives by algorithm, the pipeline schedule and continuous batching, event by event): it
shares no formula with the cost model, so the cost model has a real error against it.
``formula`` is the cost model run with *hidden* efficiency coefficients (``TRUTH``, not the
planner's priors): fast, but the planner's own form, so calibration converges to it by
construction. Either is taken at the step's response-length distribution and on the GPUs the
trace makes available; on top, per-step noise (log-normal) and stragglers (a step now and then slowed by a
slow GPU, as synchronous collectives wait for it). A plan that does not fit in memory fails the
step, as an out-of-memory would, and one that uses a GPU the trace took away cannot run. Policies
see only ``measure``'s noisy stage times and memory: they must calibrate to learn the truth.

Per step, every policy also pays the push of the actor's weights from its training layout to its
generation layout, by its own method (``sync_seconds``). Transitions cost what ``cost_of_move``
says: the live transition's scheduled makespan (at the true link efficiency) plus process-group
and engine restarts; a restart from a checkpoint (what verl- and OpenRLHF-like jobs do when the
GPUs change) reads each GPU's state back at ``RELOAD_BYTES_PER_S``. Every policy saves a
checkpoint every ``CHECKPOINT_EVERY`` steps, each GPU writing its state at the same rate.
"""

from __future__ import annotations

import copy
import math
import random
from dataclasses import dataclass

from ..ir import Module, Plan
from ..ir.cluster import Efficiency
from ..passes.cost.cost_model import Candidates, CostModel
from ..passes.cost.estimate import estimate_plan
from .trace import Trace, TraceStep
from .truth.misspecified import MISSPECIFIED, NONE
from .truth.network import LINK_EFFICIENCY
from .truth.step import EventTruth

# hidden truth: below every prior (compute 0.6, HBM/links 0.7, overlap 0.9); overhead per layer pass
# 4x the prior (40 us against 10 us)
TRUTH = Efficiency(compute=0.48, hbm=0.62, nvlink=0.6, nic=0.5, pcie=0.6, overhead=4e-5, overlap=0.75)
NOISE = 0.03  # sigma of the log-normal noise of a step's time
STRAGGLER_P, STRAGGLER_SLOWDOWN = 0.02, 1.3
PG_INIT, ENGINE_RESTART = 2.0, 30.0  # seconds, as admit's defaults
TRUTHS = ("event", "formula", *MISSPECIFIED)  # the event truth, alone or misspecified (``truth.misspecified``)
RELOAD_BYTES_PER_S = (
    2e9  # per GPU, reading state back from a checkpoint or writing it (assumed: local NVMe / parallel FS)
)
# every policy saves a checkpoint every this many steps (synchronously, as verl's and OpenRLHF's
# trainers save): verl's and OpenRLHF's defaults never save (-1), which no long job runs with;
# ``trainer.save_freq=20`` is what verl's example and recipe scripts most often set
CHECKPOINT_EVERY = 20


@dataclass
class Outcome:
    """A plan at a step, in truth (no noise): stage seconds and memory, or why it cannot run."""

    step_time: float
    seconds: dict[str, float]
    memory: dict[str, int]
    failure: str = ""  # "" | "out of memory" | "GPUs gone"


def conditions(step: TraceStep) -> tuple:
    """What a step's outcome depends on, in a canonical form: the event truth seeds its draws with
    its ``repr``, so the GPUs that are down go sorted (a frozenset's order is its table's, which
    a pickle round trip, as a worker process receives the trace, can change)."""
    return tuple(step.response_len_dist), tuple(sorted(step.unavailable))


class SimCluster:
    """The trace's job (``module``: its workload and cluster, plans ignored) under the trace."""

    def __init__(self, module: Module, trace: Trace, truth: Efficiency = TRUTH, seed: int = 0, model: str = "event"):
        if model not in TRUTHS:
            raise ValueError(f"unknown truth {model!r}: {', '.join(TRUTHS)}")
        self.base = copy.deepcopy(module)
        self.base.plans.clear()
        self.base.emus.clear()
        self.base.transitions.clear()
        (self.workload,) = self.base.workloads.values()
        (self.cluster,) = self.base.clusters.values()
        self.trace, self.truth, self.model = trace, truth, model
        self.events = None if model == "formula" else EventTruth(MISSPECIFIED.get(model, NONE))
        self.seed, self.rng = seed, random.Random(seed)
        self._modules: dict[tuple, Module] = {}
        self._outcomes: dict[tuple, Outcome] = {}

    # -- the job at a step -------------------------------------------------------------------------
    def module_at(self, i: int, truth: bool = False) -> Module:
        """The job at step ``i``: the step's length distribution and available GPUs; the cluster
        has the priors' efficiency (``truth``: the hidden one). Shared: copy before changing."""
        key = (conditions(self.trace.steps[i]), truth)
        m = self._modules.get(key)
        if m is None:
            s = self.trace.steps[i]
            m = copy.deepcopy(self.base)
            w, c = m.workloads[self.workload.name], m.clusters[self.cluster.name]
            w.response_len_dist = list(s.response_len_dist)
            w.response_len_mean = s.response_len_mean
            w.response_len_max = max(self.workload.response_len_max, max(s.response_len_dist))
            c.unavailable = sorted(set(c.unavailable) | set(s.unavailable))
            c.efficiency = self.truth if truth else None
            self._modules[key] = m
        return m

    def evaluate(self, plan: Plan, i: int) -> Outcome:
        """``plan`` at step ``i`` in truth (cached per plan and conditions)."""
        key = (id(plan), conditions(self.trace.steps[i]))
        out = self._outcomes.get(key)
        if out is None:
            out = self._outcomes[key] = self._evaluate(plan, i)
            self._keep = getattr(self, "_keep", [])
            self._keep.append(plan)  # ids stay unique while cached
        return out

    @property
    def nic_efficiency(self) -> float:
        """The share of the NIC's bandwidth a transfer gets in truth."""
        return LINK_EFFICIENCY["nic"] if self.events is not None else self.truth.nic

    def _evaluate(self, plan: Plan, i: int) -> Outcome:
        s = self.trace.steps[i]
        used = {g for lay in plan.layouts.values() for g in lay.mesh}
        if used & s.unavailable:
            return Outcome(math.inf, {}, {}, "GPUs gone")
        if self.events is not None:
            p = copy.deepcopy(plan)
            p.workload, p.cluster = self.workload.name, self.cluster.name
            step_time, seconds, memory, failure = self.events.evaluate(self.module_at(i), p, conditions(s))
            return Outcome(step_time, seconds, memory, failure)
        m = self.module_at(i, truth=True)
        p = copy.deepcopy(plan)
        p.name, p.workload, p.cluster = "_truth", self.workload.name, self.cluster.name
        m.plans["_truth"] = p
        try:
            problems = estimate_plan(m, p)
        finally:
            del m.plans["_truth"]
        seconds = {ms: lay.time for ms, lay in p.layouts.items()}
        memory = {ms: lay.memory for ms, lay in p.layouts.items()}
        if problems:
            return Outcome(math.inf, seconds, memory, "out of memory")
        return Outcome(p.step_time, seconds, memory)

    def noise(self) -> float:
        """This step's factor: log-normal noise, now and then a straggler."""
        f = math.exp(self.rng.gauss(0.0, NOISE))
        return f * (STRAGGLER_SLOWDOWN if self.rng.random() < STRAGGLER_P else 1.0)

    # -- costs beside the step --------------------------------------------------------------------
    def weight_bytes(self, model: str) -> float:
        """Bytes of ``model``'s weights (once per model: every policy's push asks every step)."""
        cache = self.__dict__.setdefault("_weight_bytes", {})
        if model not in cache:
            m = self.base.models[model]
            c = Candidates.grid(self.cluster, m.layers, 1, 1, 1)
            cache[model] = float(CostModel(self.cluster).params_per_gpu(m, c)[0]) * m.dtype_bytes
        return cache[model]

    def sync_seconds(self, plan: Plan, method: str) -> float:
        """Seconds per step to push the actor's weights from training to generation.

        ``p2p`` (Nereus): each generation GPU receives its shard once; over NVLink when the
        generation layout sits on nodes of the training layout, else the NIC. ``allgather``
        (verl): every GPU all-gathers the full weights over the NIC (FSDP across nodes).
        ``broadcast`` (OpenRLHF): rank 0 gathers the full weights, then broadcasts them to the
        engines, each over the NIC. ``megatron`` (verl's Megatron workers, colocated engines):
        every GPU gathers its pipeline stage's parameters whole over its TP group, then receives
        the other stages' from their owners over the PP group (a broadcast per stage), and its
        engine cuts its own TP shard from the whole tensors, in place."""
        train = next((lay for ms, lay in plan.layouts.items() if ms.endswith(".train") and lay.model == "actor"), None)
        gen = next((lay for ms, lay in plan.layouts.items() if ms.endswith(".generate")), None)
        if train is None or gen is None:
            return 0.0
        full = self.weight_bytes(gen.model)
        events = self.events is not None
        nic = self.cluster.inter_node.bandwidth * (LINK_EFFICIENCY["nic"] if events else self.truth.nic)
        nvl = self.cluster.intra_node.bandwidth * (LINK_EFFICIENCY["nvlink"] if events else self.truth.nvlink)
        if method == "p2p":
            if (
                gen.tp == train.tp
                and gen.pp == train.pp
                and gen.mesh[: gen.tp * gen.pp] == train.mesh[: train.tp * train.pp]
            ):
                return 0.0  # the same shards in place
            per = self.cluster.gpus_per_node
            same_nodes = {g // per for g in gen.mesh} <= {g // per for g in train.mesh}
            return full / (gen.tp * gen.pp) / (nvl if same_nodes else nic)
        if method == "megatron":
            per = self.cluster.gpus_per_node

            def rate(gpus: list[int]) -> float:
                return nvl if len({g // per for g in gpus}) <= 1 else nic

            stage = full / train.pp
            tp_gpus, pp_gpus = train.mesh[: train.tp], train.mesh[: train.tp * train.pp : train.tp]
            gather = (train.tp - 1) / train.tp * stage / rate(tp_gpus) if train.tp > 1 else 0.0
            return gather + ((train.pp - 1) * stage / rate(pp_gpus) if train.pp > 1 else 0.0)
        if method == "allgather":
            world = len(train.mesh)
            return full * (world - 1) / world / nic
        if method == "broadcast":
            return 2 * full / nic
        raise ValueError(f"unknown sync method {method}")

    def state_bytes(self, plan: Plan) -> float:
        """Bytes of training state (weights, gradients, optimizer) on ``plan``'s fullest GPU."""
        cache = self.__dict__.setdefault("_state_bytes", {})
        if id(plan) not in cache:
            m = self.module_at(0)
            p = copy.deepcopy(plan)
            p.workload, p.cluster = self.workload.name, self.cluster.name
            m.plans["_state"] = p
            try:
                estimate_plan(m, p)
            finally:
                del m.plans["_state"]
            cache[id(plan)] = max(
                (lay.memory_breakdown.weights + lay.memory_breakdown.grads + lay.memory_breakdown.optimizer)
                for lay in p.layouts.values()
                if lay.memory_breakdown is not None
            )
            self.__dict__.setdefault("_state_plans", []).append(plan)  # ids stay unique while cached
        return cache[id(plan)]

    def save_seconds(self, plan: Plan) -> float:
        """A synchronous checkpoint save: each GPU writes its state."""
        return self.state_bytes(plan) / RELOAD_BYTES_PER_S

    def reload_seconds(self, plan: Plan) -> float:
        """A restart from a checkpoint: process groups, engines, and each GPU's state read back."""
        return PG_INIT + ENGINE_RESTART + self.state_bytes(plan) / RELOAD_BYTES_PER_S
