"""The baseline ``plan-search`` is measured against: the plan a careful operator writes by hand.

As in verl's hybrid engine and OpenRLHF's colocated mode, every model-stage of a stage shares
all available GPUs and they run one after another (no search over how a stage's GPUs are split
between its model-stages: that is what ``plan-search`` adds). For each model-stage, the operator
tries every layout the frameworks accept and keeps the best one ``estimate`` predicts:

- TP: every size that divides the heads and is a multiple or a divisor of the KV heads, up to a
  node (TP groups stay inside nodes);
- PP: every size that divides the layers, and every power of two up to the layers (split as
  evenly as ``tensor_split`` splits them);
- DP: fills the GPUs the TP groups can use (after failures, the free GPUs of each node in whole
  TP groups), at most one replica per sample;
- training: with or without activation recomputation, and ZeRO 0, 1, 2 or 3 when DP > 1 (the
  operator's memory knobs: Megatron's recompute and distributed optimizer, FSDP's sharding);
- the frameworks' defaults otherwise: pipelines with 4 x PP micro-batches (at most the
  micro-batches a replica has, as ``plan-search``'s largest choice), no offload.

Each model-stage is chosen with the others fixed, by the plan's step time under ``estimate``
(plans that do not fit in memory rank after every plan that fits, the smaller shortfall first);
model-stages are revisited until no single one can change its layout for a shorter step (first
among the frameworks' default knobs, recomputation and ZeRO-1, then among every knob), so the
result is the best layout of every model-stage given the others. The plan is costed by the same
``estimate`` as searched plans, so the comparison is like for like.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np

from ...ir import Cluster, Layout, Module, Plan, Workload
from ...ir.model import Model, even_split
from ...ir.verifier import flush_samples, replicas_share_steps
from ...passes.cost.cost_model import Candidates, CostModel
from ...passes.cost.estimate import estimate_plan
from ...passes.cost.layout_costs import step_time


def place_blocks(gpus: list[int], per_node: int, blocks: list[tuple[int, int]]) -> list[list[int]]:
    """GPU ids for each (size, tp) block, keeping every TP group of ``tp`` GPUs inside one node.

    Blocks are served in the given order from the nodes' free GPUs, ``tp`` GPUs at a time from
    nodes that still have that many; what cannot be served that way (too many failed GPUs)
    takes any free GPUs, and ``estimate`` then charges the cross-node TP links it implies.
    """
    free: dict[int, list[int]] = {}
    for g in gpus:
        free.setdefault(g // per_node, []).append(g)
    out = []
    for size, tp in blocks:
        got: list[int] = []
        for node in sorted(free, key=lambda n: (len(free[n]) % tp != 0, n)):
            while len(got) + tp <= size and len(free[node]) >= tp:
                got.extend(free[node][:tp])
                del free[node][:tp]
        if len(got) < size:  # fall back: any free GPUs
            rest = [g for node in sorted(free) for g in free[node]][: size - len(got)]
            for g in rest:
                free[g // per_node].remove(g)
            got.extend(rest)
        out.append(got)
    return out


def tp_sizes(model: Model, cluster: Cluster) -> list[int]:
    """TP sizes the frameworks accept for ``model`` inside one node of ``cluster``."""
    n = len(cluster.available_gpus())
    return [
        t
        for t in range(1, min(cluster.gpus_per_node, n) + 1)
        if model.heads % t == 0 and (t % model.kv_heads == 0 or model.kv_heads % t == 0)
    ]


def pp_sizes(model: Model) -> list[int]:
    """PP sizes: divisors of the layers and powers of two up to the layers."""
    return sorted(
        {p for p in range(1, model.layers + 1) if model.layers % p == 0}
        | {1 << k for k in range(model.layers.bit_length()) if 1 << k <= model.layers}
    )


def layout_variations(m: Module, workload: Workload, cluster: Cluster, model_stage: str, kind: str) -> list[Layout]:
    """Every layout of ``model_stage`` the baseline considers (see the module docstring)."""
    model = m.models[model_stage.rpartition(".")[0]]
    gpus = cluster.available_gpus()
    per_node = cluster.gpus_per_node
    free: dict[int, int] = {}
    for g in gpus:
        free[cluster.node_of(g)] = free.get(cluster.node_of(g), 0) + 1
    out = []
    for tp in tp_sizes(model, cluster):
        usable = sum(f // tp * tp for f in free.values())  # TP groups inside nodes
        for pp in pp_sizes(model):
            dp = min(usable // (tp * pp), workload.samples)
            while dp > 1 and not replicas_share_steps(workload, kind, dp):
                dp -= 1  # the most replicas that share an optimizer step evenly
            if dp < 1:
                continue
            (mesh,) = place_blocks(gpus, per_node, [(tp * pp * dp, tp)])
            train = kind == "train"
            micro = flush_samples(workload, kind) // dp // workload.micro_batch
            if pp > 1 and kind != "generate" and micro < 1:
                continue  # dp replicas of one micro-batch each exceed a pipeline flush
            mb = min(4 * pp, micro) if pp > 1 and kind != "generate" else 1
            layers = [(lo, hi - 1) for lo, hi in (even_split(model.layers, pp, r) for r in range(pp))]
            for recompute in (False, True) if train else (False,):
                for zero in (0, 1, 2, 3) if train and dp > 1 else (0,):
                    out.append(
                        Layout(
                            model_stage=model_stage,
                            tp=tp,
                            pp=pp,
                            dp=dp,
                            layers=layers,
                            mesh=mesh,
                            micro_batches=mb,
                            zero=zero,
                            recompute=recompute,
                        )
                    )
    return out


class _Scorer:
    """``estimate``'s step time and memory check for a choice of layouts (one per model-stage),
    computed as ``estimate_plan`` computes them (``layout_costs``, ``step_time``) but with each
    layout's mesh analysis done once: the baseline scores thousands of plans that differ in one
    layout. ``greedy_plan`` checks the result against ``estimate_plan`` itself."""

    def __init__(
        self,
        m: Module,
        workload: Workload,
        cluster: Cluster,
        options: dict[str, list[Layout]],
        kinds: dict[str, str],
        name: str,
    ):
        self.m, self.workload, self.cluster, self.options, self.kinds, self.name = (
            m,
            workload,
            cluster,
            options,
            kinds,
            name,
        )
        self.cm = CostModel(cluster)
        self.coeffs = self.cm.coeffs
        self.cand: dict[tuple[str, int], Candidates] = {}
        self.kept: dict[tuple[str, int], float] = {}
        self.mesh: dict[tuple[str, int], np.ndarray] = {}
        for ms, opts in options.items():
            for i, lay in enumerate(opts):
                cand = Candidates.of_layout(cluster, lay)
                self.cand[(ms, i)] = cand
                self.kept[(ms, i)] = float(self._stage(ms, cand).resident_state[0])  # the baseline offloads nothing
                self.mesh[(ms, i)] = np.array(lay.mesh, dtype=np.int64)
        self.memo: dict[tuple[str, int, float], tuple[float, float]] = {}

    def _stage(self, ms: str, cand: Candidates):
        return self.cm.stage(self.m.models[ms.rpartition(".")[0]], self.workload, self.kinds[ms], cand)

    def _cost(self, ms: str, i: int, resident: float) -> tuple[float, float]:
        """(time, own peak memory) of option ``i`` of ``ms`` beside ``resident`` bytes of others."""
        key = (ms, i, resident)
        if key not in self.memo:
            c = self._stage(ms, dataclasses.replace(self.cand[(ms, i)], resident=np.array([resident])))
            self.memo[key] = (float(c.features_for(self.coeffs)[0] @ self.coeffs + c.latency[0]), float(c.memory()[0]))
        return self.memo[key]

    def cost_alone(self, ms: str, i: int) -> float:
        """Time of option ``i`` of ``ms`` with nothing else on its GPUs."""
        return self._cost(ms, i, 0.0)[0]

    def plan(self, choice: dict[str, int]) -> Plan:
        layouts = {ms: copy.copy(self.options[ms][i]) for ms, i in choice.items()}
        colocate = [list(st.model_stages()) for st in self.workload.stages if len(st.model_stages()) > 1]
        return Plan(
            name=self.name, workload=self.workload.name, cluster=self.cluster.name, colocate=colocate, layouts=layouts
        )

    def score(self, choice: dict[str, int]) -> tuple[int, float, float]:
        """(does not fit, bytes over the GPU memory, step time): smaller is better."""
        on_gpu = np.zeros(self.cluster.num_gpus)
        for ms, i in choice.items():
            on_gpu[self.mesh[(ms, i)]] += self.kept[(ms, i)]
        times, bad, short = {}, 0, 0.0
        memory = self.cluster.gpu_memory
        for ms, i in choice.items():
            mesh = self.mesh[(ms, i)]
            others = float((on_gpu[mesh] - self.kept[(ms, i)]).max()) if len(mesh) else 0.0
            t, own = self._cost(ms, i, others)
            times[ms] = t
            if not np.isfinite(t) or own + others > memory:
                bad = 1
                short += max(own + others - memory, 0.0)
        if bad:
            return (1, short, float("inf"))
        plan = self.plan(choice)
        return (0, 0.0, step_time(self.m, plan, times))


def descend(
    scorer: _Scorer,
    options: dict[str, list[Layout]],
    choice: dict[str, int],
    allowed: dict[str, list[int]] | None = None,
) -> tuple[tuple, dict[str, int]]:
    """From ``choice``, each model-stage in turn takes its best layout given the others (ties: the
    current one), among its ``allowed`` options (default: all), until a whole round changes
    nothing: (score, choice)."""
    best = scorer.score(choice)
    improved = True
    while improved:  # ends: every change lowers the score, and there are finitely many plans
        improved = False
        for ms, opts in options.items():
            for i in range(len(opts)) if allowed is None else allowed[ms]:
                if i == choice[ms]:
                    continue
                trial = dict(choice, **{ms: i})
                s = scorer.score(trial)
                if s < best:
                    best, choice, improved = s, trial, True
    return best, choice


def greedy_plan(m: Module, workload: Workload, cluster: Cluster, name: str = "greedy") -> Plan | None:
    """The hand-tuned baseline, estimated; None when no choice of layouts fits in memory."""
    options: dict[str, list[Layout]] = {}
    colocate = []
    for st in workload.stages:
        mss = st.model_stages()
        if len(mss) > 1:
            colocate.append(list(mss))
        for ms in mss:
            options[ms] = layout_variations(m, workload, cluster, ms, st.kind)
            if not options[ms]:
                return None

    kinds = {ms: st.kind for st in workload.stages for ms in st.model_stages()}
    scorer = _Scorer(m, workload, cluster, options, kinds, name)

    # start from the rule of thumb: the largest TP, then the smallest power-of-two PP with which
    # the plan fits (doubled for the model-stages that do not fit), at the frameworks' defaults
    def defaults(ms: str, o: Layout) -> bool:  # the frameworks' defaults: training recomputes, at ZeRO-1
        train = kinds[ms] == "train"
        return (o.recompute, o.zero) == (train, 1 if train and o.dp > 1 else 0)

    def option(ms: str, tp: int, pp: int) -> int | None:
        at = [i for i, o in enumerate(options[ms]) if (o.tp, o.pp) == (tp, pp)]
        return ([i for i in at if defaults(ms, options[ms][i])] or at or [None])[0]

    top = {ms: max(o.tp for o in opts) for ms, opts in options.items()}
    choice = {ms: option(ms, top[ms], 1) for ms in options}
    while True:
        plan = scorer.plan(choice)
        short = {d.message.split()[0].rstrip(":") for d in estimate_plan(m, plan)}
        grown = {ms: option(ms, top[ms], 2 * options[ms][choice[ms]].pp) for ms in short if ms in choice}
        grown = {ms: i for ms, i in grown.items() if i is not None}
        if not grown:
            break
        choice.update(grown)
    # then every model-stage in turn takes its best layout given the others, until none changes;
    # from that start and from every model-stage's fastest layout on its own (which may not fit
    # beside the others at first), among the default knobs and among all, keeping the best end.
    # Each start descends first among the frameworks' default knobs (what the operator tries
    # first), then among every knob: more options can lead a descent to a worse local optimum
    usual = {ms: [i for i, o in enumerate(opts) if defaults(ms, o)] for ms, opts in options.items()}

    def two_phase(start: dict[str, int]) -> tuple[tuple, dict[str, int]]:
        if all(start[ms] in usual[ms] for ms in start):
            start = descend(scorer, options, start, usual)[1]
        return descend(scorer, options, start)

    def alone(among: dict[str, list[int]]) -> dict[str, int]:  # each model-stage's fastest on its own
        return {ms: min(among[ms], key=lambda i: (scorer.cost_alone(ms, i), i)) for ms in options}

    every = {ms: list(range(len(opts))) for ms, opts in options.items()}
    starts = (choice, alone(usual), alone(every))
    best, choice = min((two_phase(start) for start in starts), key=lambda sc: sc[0])
    if best[0]:
        return None
    plan = scorer.plan(choice)
    if estimate_plan(m, plan) or abs(plan.step_time - best[2]) > 1e-3 * best[2]:
        raise AssertionError(f"greedy_plan's scorer disagrees with estimate: {best[2]} s vs {plan.step_time} s")
    return plan
