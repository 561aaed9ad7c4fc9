"""The plan-search problem: candidate layouts per model-stage, GPU groupings per stage, and an
exact evaluator that the CP-SAT model, the brute-force enumerator and the greedy peer share.

The abstraction (what makes it small):

- GPUs are interchangeable: a layout needs ``tp x pp x dp`` GPUs of the available ones, not
  particular ids. Inside a stage, the model-stages are split into groups; a group's members
  share one block of GPUs (as large as its largest member; each member uses the first GPUs of
  it) and run one after another; groups get disjoint blocks. TP groups stay inside nodes, so
  with failed GPUs a layout counts against what its TP size can use (``capacity``). After
  solving, blocks are laid out on the available GPU ids, largest first.
- Memory is checked conservatively, so that any placement of the blocks fits: a GPU holds, from
  every stage, at most the resident state of that stage's heaviest group. A model-stage fits
  when its own peak + that bound - its own resident state <= GPU memory.
- Generation's KV cache depends on what else is resident; each generation candidate assumes an
  allowance ``rho`` of memory held by others, and the model requires the bound to stay within it.
- Times are integers (``unit_s`` seconds each, rounded up) and memory integers (MiB, rounded up)
  so that the solver and the enumerator optimise exactly the same numbers.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from ..ir import Cluster, Model, Workload
from ..ir.verifier import flush_samples
from .cost_model import C_PCIE, Candidates, CostModel

MIB = 2**20
OFFLOAD_CHOICES = {"train": ((), ("optimizer",), ("grads", "optimizer")), "infer": ((), ("weights",)),
                   "generate": ((),)}
RHO_STEPS = 8  # generation candidates assume 0/8 .. 7/8 of GPU memory held by other model-stages


@dataclass
class Option:
    """One candidate layout of a model-stage, with its cost."""

    tp: int
    pp: int
    dp: int
    micro_batches: int
    recompute: bool
    zero: int
    offload: tuple[str, ...]
    rho: int  # MiB of other model-stages' state this candidate tolerates (generation), else "any"
    gpus: int
    units: int  # share of the GPUs it takes, in SearchProblem.capacity units (see build_problem)
    time_s: float
    time: int  # in units of SearchProblem.unit_s, rounded up
    peak: int  # MiB: own peak during its stage
    resident: int  # MiB: own state kept between stages

    def describe(self) -> str:
        extra = "".join([f" m{self.micro_batches}" if self.pp > 1 else "", " rc" if self.recompute else "",
                         f" z{self.zero}" if self.zero else "", f" off:{'+'.join(self.offload)}" if self.offload else ""])
        return f"tp{self.tp} pp{self.pp} dp{self.dp}{extra}"


@dataclass
class Space:
    model_stage: str
    kind: str
    options: list[Option]
    generated: int  # candidates before pruning


def set_partitions(items: list[str]) -> list[list[list[str]]]:
    """All ways to split ``items`` into groups (Bell-number many), in a deterministic order."""
    if not items:
        return [[]]
    first, rest = items[0], items[1:]
    out = []
    for part in set_partitions(rest):
        out.append([[first]] + part)
        for i in range(len(part)):
            out.append(part[:i] + [[first] + part[i]] + part[i + 1:])
    return out


@dataclass
class SearchProblem:
    cluster: Cluster
    workload: Workload
    models: dict[str, Model]
    gpus: list[int]  # available GPU ids
    capacity: int  # GPU capacity units of a stage (see build_problem)
    unit_s: float
    memory: int  # MiB per GPU
    stages: list[tuple[str, list[str]]]
    spaces: dict[str, Space]
    partitions: dict[str, list[list[list[str]]]] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return len(self.gpus)

    def evaluate(self, choice: dict[str, int], partition: dict[str, int]) -> int | None:
        """Step time (units) of a choice of options and groupings, or None if it breaks a constraint."""
        opt = {ms: self.spaces[ms].options[i] for ms, i in choice.items()}
        total_time, total_resident = 0, 0
        for stage, mss in self.stages:
            groups = self.partitions[stage][partition[stage]]
            size = 0
            t_stage = r_stage = 0
            for g in groups:
                size += max(opt[ms].units for ms in g)
                t_stage = max(t_stage, sum(opt[ms].time for ms in g))
                r_stage = max(r_stage, sum(opt[ms].resident for ms in g))
            if size > self.capacity:
                return None
            total_time += t_stage
            total_resident += r_stage
        for ms, o in opt.items():
            if o.peak - o.resident + total_resident > self.memory:
                return None
            if self.spaces[ms].kind == "generate" and total_resident - o.resident > o.rho:
                return None
        return total_time


def build_problem(cluster: Cluster, workload: Workload, models: dict[str, Model], cost: CostModel | None = None,
                  max_tp: int | None = None, time_units: int = 10_000_000, max_pp: int = 0, max_zero: int = 3,
                  offload: bool = True) -> SearchProblem:
    """Generate, cost and prune the candidates of every model-stage of ``workload`` on ``cluster``.

    ``max_pp`` (0: no limit), ``max_zero`` and ``offload`` keep only layouts the job can run
    (a live model without pipeline stages, ZeRO or offload, say)."""
    cost = cost or CostModel(cluster)
    gpus = cluster.available_gpus()
    n = len(gpus)
    mem_mib = cluster.gpu_memory // MIB
    # TP groups stay inside nodes, so a layout with TP t can use only cap[t] of the GPUs: the
    # free GPUs of each node in whole groups of t (a TP group larger than a node takes whole free
    # nodes). An option of n GPUs takes n / cap[t] of a
    # stage's capacity; in integers, capacity = lcm(cap) and units = n x capacity / cap[t].
    # Without failed GPUs every cap[t] is the GPU count and units are GPUs (scaled).
    free_per_node: dict[int, int] = {}
    for g in gpus:
        free_per_node[cluster.node_of(g)] = free_per_node.get(cluster.node_of(g), 0) + 1
    per_node = cluster.gpus_per_node
    full_nodes = sum(1 for f in free_per_node.values() if f == per_node)
    cap = {t: sum(f // t * t for f in free_per_node.values()) if t <= per_node
           else (full_nodes // (t // per_node)) * t if t % per_node == 0 else 0  # TP across whole nodes
           for t in range(1, max(n, 1) + 1)}
    raw: dict[str, tuple[str, dict]] = {}
    for st in workload.stages:
        for ms in st.model_stages():
            raw[ms] = (st.kind, _candidates(cost, cluster, workload, models[ms.rpartition(".")[0]], st.kind, n,
                                            max_tp or cluster.gpus_per_node, cap))
    used_tp = {int(t) for _, c in raw.values() for t in c["tp"]}
    capacity = math.lcm(*(cap[t] for t in used_tp if cap[t] > 0)) if used_tp else 1
    finite = [t for _, c in raw.values() for t in c["time"] if np.isfinite(t)]
    # time unit: the whole step of the slowest candidates fits in ``time_units`` units
    worst = sum(max((t for t in c["time"] if np.isfinite(t)), default=0.0) for _, c in raw.values())
    unit = max(worst / time_units, 1e-6) if finite else 1e-3
    spaces = {}
    for ms, (kind, c) in raw.items():
        fits = np.array([g <= cap.get(int(t), 0) for g, t in zip(c["gpus"], c["tp"])], dtype=bool)
        keep = np.isfinite(c["time"]) & (c["peak"] <= mem_mib) & fits
        if len(c["tp"]):
            keep &= (c["pp"] <= (max_pp or c["pp"].max())) & (c["zero"] <= max_zero)
            if not offload:
                keep &= np.array([not o for o in c["offload"]], dtype=bool)
        opts = [Option(int(c["tp"][i]), int(c["pp"][i]), int(c["dp"][i]), int(c["mb"][i]), bool(c["rc"][i]),
                       int(c["zero"][i]), c["offload"][i], int(c["rho"][i]), int(c["gpus"][i]),
                       int(c["gpus"][i]) * (capacity // cap[int(c["tp"][i])]), float(c["time"][i]),
                       int(math.ceil(c["time"][i] / unit)), int(c["peak"][i]), int(c["resident"][i]))
                for i in np.flatnonzero(keep)]
        spaces[ms] = Space(ms, kind, prune(opts), len(c["tp"]))
    stages = [(st.name, st.model_stages()) for st in workload.stages]
    problem = SearchProblem(cluster, workload, models, gpus, capacity, unit, mem_mib, stages, spaces)
    problem.partitions = {name: set_partitions(mss) for name, mss in stages}
    return problem


def _candidates(cost: CostModel, cluster: Cluster, workload: Workload, model: Model, kind: str, n: int, max_tp: int,
                cap: dict[int, int] | None = None) -> dict:
    """Every layout of one model-stage, costed in one vectorized call (``cap[t]``: GPUs usable with TP t)."""
    tps = [t for t in range(1, min(max_tp, model.heads) + 1) if model.heads % t == 0
           and (t % model.kv_heads == 0 or model.kv_heads % t == 0) and t <= n]
    pps = [p for p in (1, 2, 4, 8, 16) if p <= model.layers and p <= n]
    rows = []
    samples = workload.samples
    for tp in tps:
        for pp in pps:
            top = (cap[tp] if cap else n) // (tp * pp)
            if top < 1:
                continue
            # DP sizes: every size up to 8 GPUs' worth, then powers of two, and "all the rest"
            dps = sorted({d for d in range(1, top + 1) if tp * pp * d <= 8 or d & (d - 1) == 0 or d == top})
            for dp in dps:
                n_gpus = tp * pp * dp
                if dp > samples or (n_gpus > cluster.gpus_per_node and n_gpus % cluster.gpus_per_node):
                    continue  # beyond one node, layouts take whole nodes
                # micro-batches one pipeline flush holds per replica (the verifier's bound)
                micro = flush_samples(workload, kind) // dp // workload.micro_batch if kind != "generate" else 1
                if pp > 1 and micro < 1:
                    continue  # dp replicas of one micro-batch each exceed the flush
                # pp, 4 x pp and the most the flush holds (the smallest bubble)
                mbs = [1] if pp == 1 or kind == "generate" else sorted({min(k * pp, micro) for k in (1, 4)} | {micro})
                for mb in mbs:
                    for rc in ((False, True) if kind == "train" else (False,)):
                        for z in ((0, 1, 2, 3) if kind == "train" and dp > 1 else (0,)):
                            for off in OFFLOAD_CHOICES[kind]:
                                for rho in (range(RHO_STEPS) if kind == "generate" else (RHO_STEPS,)):
                                    rows.append((tp, pp, dp, mb, rc, z, off, rho))
    if not rows:
        return {k: np.array([]) for k in ("tp", "pp", "dp", "mb", "rc", "zero", "offload", "rho", "gpus", "time", "peak", "resident")}
    tp, pp, dp, mb, rc, z, off, rho_step = (list(col) for col in zip(*rows))
    mem_mib = cluster.gpu_memory // MIB
    rho = np.array(rho_step) * mem_mib // RHO_STEPS
    cand = Candidates.grid(cluster, model.layers, tp, pp, dp, micro_batches=mb, recompute=rc, zero=z)
    cand.resident = np.where(np.array(rho_step) < RHO_STEPS, rho * MIB, 0.0)
    sc = cost.stage(model, workload, kind, cand)
    coeffs = cost.coeffs
    offloaded = np.array([sum({"weights": sc.weights[i], "grads": sc.grads[i], "optimizer": sc.optimizer[i]}[k]
                              for k in o) for i, o in enumerate(off)], dtype=float)
    link = cluster.host_link or cluster.inter_node
    off_time = np.where(offloaded > 0, 2 * offloaded / link.bandwidth * coeffs[C_PCIE] + 2 * link.latency, 0.0)
    with np.errstate(invalid="ignore"):
        time = sc.time(coeffs) + off_time
    resident = np.ceil((sc.resident_state - offloaded) / MIB)
    peak = np.ceil(sc.memory() / MIB)
    return {"tp": np.array(tp), "pp": np.array(pp), "dp": np.array(dp), "mb": np.array(mb), "rc": np.array(rc),
            "zero": np.array(z), "offload": off, "rho": np.where(np.array(rho_step) < RHO_STEPS, rho, 1 << 40),
            "gpus": np.array(tp) * np.array(pp) * np.array(dp), "time": time, "peak": peak, "resident": resident}


def prune(options: list[Option]) -> list[Option]:
    """Drop dominated options: no better in GPU share, time, peak - resident, resident and rho.

    Sound for the model: an option that is no worse on every quantity the constraints and the
    objective read (fewer GPUs only shrink a block) can replace a dominated one in any solution.
    """
    if not options:
        return []
    keys = np.array([(o.units, o.time, o.peak - o.resident, o.resident, -o.rho) for o in options], dtype=float)
    order = np.lexsort(keys.T[::-1])
    kept: list[int] = []
    kept_keys = np.empty((0, keys.shape[1]))
    for i in order:
        if len(kept) and np.any(np.all(kept_keys <= keys[i], axis=1)):
            continue
        kept.append(i)
        kept_keys = np.vstack([kept_keys, keys[i]])
    return [options[i] for i in sorted(kept)]


def brute_force(problem: SearchProblem, limit: int = 4_000_000) -> tuple[int | None, dict[str, int] | None, dict[str, int] | None]:
    """The optimum by enumerating every combination of options and groupings (small instances).

    Vectorized: one array axis per model-stage. Independent of the CP-SAT model; shares only
    the candidates and the constraints as ``evaluate`` states them. Returns (objective, choice,
    partition), or Nones when nothing is feasible.
    """
    names = list(problem.spaces)
    shape = tuple(len(problem.spaces[ms].options) for ms in names)
    if not all(shape):
        return None, None, None
    if math.prod(shape) > limit:
        raise ValueError(f"{math.prod(shape):,} combinations exceed the brute-force limit")
    axis = {ms: i for i, ms in enumerate(names)}

    def arr(ms: str, f) -> np.ndarray:
        v = np.array([f(o) for o in problem.spaces[ms].options], dtype=np.int64)
        return v.reshape([-1 if i == axis[ms] else 1 for i in range(len(names))])

    n = {ms: arr(ms, lambda o: o.units) for ms in names}
    t = {ms: arr(ms, lambda o: o.time) for ms in names}
    r = {ms: arr(ms, lambda o: o.resident) for ms in names}
    a = {ms: arr(ms, lambda o: o.peak - o.resident) for ms in names}
    rho = {ms: arr(ms, lambda o: o.rho) for ms in names if problem.spaces[ms].kind == "generate"}
    best = (None, None, None)
    for parts in itertools.product(*(range(len(problem.partitions[s])) for s, _ in problem.stages)):
        ok = np.ones(shape, dtype=bool)
        total_t = np.zeros(shape, dtype=np.int64)
        total_r = np.zeros(shape, dtype=np.int64)
        for (stage, _), k in zip(problem.stages, parts):
            groups = problem.partitions[stage][k]
            blocks = sum(functools.reduce(np.maximum, [n[ms] for ms in g]) for g in groups)
            ok &= np.broadcast_to(blocks <= problem.capacity, shape)
            total_t = total_t + functools.reduce(np.maximum, [sum(t[ms] for ms in g) for g in groups])
            total_r = total_r + functools.reduce(np.maximum, [sum(r[ms] for ms in g) for g in groups])
        for ms in names:
            ok &= a[ms] + total_r <= problem.memory
            if ms in rho:
                ok &= total_r - r[ms] <= rho[ms]
        if not ok.any():
            continue
        masked = np.where(ok, total_t, np.iinfo(np.int64).max)
        flat = int(np.argmin(masked))
        value = int(masked.flat[flat])
        if best[0] is None or value < best[0]:
            idx = np.unravel_index(flat, shape)
            best = (value, {ms: int(i) for ms, i in zip(names, idx)},
                    {s: k for (s, _), k in zip(problem.stages, parts)})
    return best
