"""The plan-search problem: candidate layouts per model-stage, where their GPU blocks may start,
and an exact evaluator that the CP-SAT model and the brute-force enumerator share.

The abstraction is ``estimate``'s own model, placed:

- **Positions.** The available GPUs are put in a line: whole nodes first, then the nodes with
  failed GPUs, each node's free GPUs together. A layout of ``g`` GPUs takes a contiguous run of
  ``g`` positions (its mesh, TP fastest). Where the run starts decides which of its TP groups,
  pipeline pairs and DP groups cross a node boundary, so a candidate has one time per *start
  class*: the start's offset inside a whole node (every whole node is alike), or, for a run
  that reaches into a node with failed GPUs, the start itself. Each time is ``estimate``'s for
  that mesh: the solver's objective is the step time ``estimate`` computes for the placed plan
  (up to the rounding of times to integer units).
- **Stages.** Inside a stage the model-stages are split into groups: a group's members start at
  the same position and run one after another; groups of one stage take disjoint runs. Stages
  run in order.
- **Memory** is ``estimate``'s: on every GPU, the peak of the model-stage running there plus the
  state every model-stage placed on that GPU keeps between stages (less what it offloads).
  Memory is counted in KiB rounded up, a model-stage's state at most 1 KiB more than its bytes.
- **Generation** takes what memory the others leave for its KV cache: a generation candidate
  states how much others may keep on its GPUs (``rho``) and is costed at exactly that, at every
  point where its time changes: where the number of waves of sequences changes, or, when the
  workload gives a response-length distribution (continuous batching's decode then depends on the
  number of sequences at once), at every number of sequences at once (so no allowance is rounded
  to a coarser step). It is kept only when its peak fits for any smaller resident state, too.

The candidate space (what the docs of ``plan-search`` call its approximation): TP sizes that
divide the heads and divide or are multiples of the KV heads, up to a node; PP of every size up
to 16 and every divisor of the layers, layers split evenly; DP of every size that splits an
optimizer step evenly (``micro_batch x dp`` divides ``mini_batch``, as Megatron-LM and verl
require: ``replicas_share_steps``; the verifier warns of a plan that does not) while a layout
fits in two nodes, beyond that whole nodes in powers of two or up to 8 nodes, and all the GPUs;
micro-batches: the most a pipeline flush holds, and every count below PP (less memory, more
bubble; powers of two when PP > 8); counts between PP and the most are dominated (same memory,
more bubble). ZeRO 2 and 3 (0 and 1 take the same time as 2 and keep more), recomputation
on/off, offload of every subset of the state a stage keeps between stages; sequence parallelism
whenever TP is used for training or inference (``sequence_parallel``); interleaved pipelines of 2,
3 or 4 virtual stages where they divide every stage's layers, with the most micro-batches a
flush holds that are a multiple of PP.

Large jobs (more than ``EXHAUSTIVE_GPUS`` GPUs or ``FULL_SPACE_MODEL_STAGES`` model-stages)
get a thinner space to stay fast: only the most micro-batches a flush holds, three offload
choices for training, 8 generation allowances per layout, and runs that start aligned (at a
node's first GPU, or at a multiple of their size inside a node); a run across segments of
nodes with different free GPUs is costed as if every group that may cross a node did.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from ...ir import Cluster, Model, Workload
from ...ir.verifier import flush_samples, replicas_share_steps
from ..cost.cost_model import (
    C_PCIE,
    NIC,
    NVLINK,
    VLLM_GPU_MEMORY_UTILIZATION,
    Candidates,
    CostModel,
    ep_placement,
    mesh_links,
)

KIB = 1024
NO_RHO = 1 << 50  # not a generation candidate: any resident state of others is fine
STATE = ("weights", "grads", "optimizer")
OFFLOAD_CHOICES = {
    "train": tuple(tuple(k for k, on in zip(STATE, bits) if on) for bits in itertools.product((0, 1), repeat=3)),
    "infer": ((), ("weights",)),
    "generate": ((), ("weights",)),
}
EXHAUSTIVE_GPUS = 16  # up to this many available GPUs and
FULL_SPACE_MODEL_STAGES = 4  # this many model-stages: the full space and every start
# Memory plan-search keeps free on every GPU beyond what the cost model counts: the CUDA context
# (about 0.5 GiB), NCCL's buffers (1-2 GiB with several communicators) and the caching
# allocator's fragmentation (a few percent of what it holds). 10% of an 80 GiB GPU is 8 GiB,
# the same share vLLM leaves at its default gpu_memory_utilization = 0.9.
DEFAULT_HEADROOM = 0.1
MAX_WAVE_POINTS = 1 << 30  # generation allowances per layout: every one (8 on large clusters)
VIRTUAL_STAGES = (2, 3, 4)  # interleaved pipeline schedules tried (besides plain 1F1B)
LEAN_OFFLOAD = {
    "train": ((), ("optimizer",), ("grads", "optimizer")),
    "infer": ((), ("weights",)),
    "generate": ((), ("weights",)),
}  # generation allowances per layout (geometric beyond this many wave counts)


ANYWHERE = -1  # start class of a run costed for any start (links that may cross nodes taken as crossing)
SPAN = 1 << 30  # start classes SPAN + s: the single start s of a run across segments


_LINKS: dict[tuple, tuple[int, int, int, int]] = {}  # Positions.links, by segments and mesh
_EP_LINKS: dict[tuple, tuple[int, int]] = {}  # ``Positions.ep_links``, remembered likewise


@dataclass
class Positions:
    """Available GPUs in search order and the start classes of a run of positions.

    Nodes are ordered by free GPUs (whole nodes first, then nodes with one failed GPU, ...),
    each node's free GPUs together; nodes with the same free count form a *segment*, inside
    which every node is alike. A run inside segment ``j`` (start ``a``, period ``f`` free GPUs
    per node) has class ``j * per_node + r`` for its offset ``r`` in a node: every start of a
    class has the same links. A run across segments has class ``SPAN + s`` (its own start); on
    large jobs (not ``exhaustive``) those get one class ``ANYWHERE`` instead, costed with every
    group that may cross a node boundary crossing it (an upper bound for any start), and runs
    inside a segment start at a node's first GPU or, when smaller than a node, at a multiple of
    their size inside it."""

    gpus: list[int]  # position -> GPU id
    node: np.ndarray  # position -> node id
    per_node: int
    segments: list[tuple[int, int, int]]  # (first position, end, free GPUs per node)
    exhaustive: bool = True

    @classmethod
    def of(cls, cluster: Cluster, exhaustive: bool = True) -> "Positions":
        free: dict[int, list[int]] = {}
        for g in cluster.available_gpus():
            free.setdefault(cluster.node_of(g), []).append(g)
        nodes = sorted(free, key=lambda n: (-len(free[n]), n))
        gpus = [g for n in nodes for g in free[n]]
        segments, at = [], 0
        for f, group in itertools.groupby(nodes, key=lambda n: len(free[n])):
            size = f * len(list(group))
            segments.append((at, at + size, f))
            at += size
        return cls(
            gpus,
            np.array([cluster.node_of(g) for g in gpus], dtype=np.int64),
            cluster.gpus_per_node,
            segments,
            exhaustive,
        )

    @property
    def n(self) -> int:
        return len(self.gpus)

    def classes(self, size: int) -> list[int]:
        """Start classes of a run of ``size`` positions (see the class docs)."""
        if size > self.n:
            return []
        out = []
        for j, (a, e, f) in enumerate(self.segments):
            for r in range(f):
                if a + r + size > e:
                    break
                if self.exhaustive or r == 0 or (size < f and r % size == 0 and r + size <= f):
                    out.append(j * self.per_node + r)
        if not self.exhaustive:  # one class for every run across segments, if one can be
            crossing = size > max(e - a for a, e, _ in self.segments) or (size > 1 and len(self.segments) > 1)
            return out + [ANYWHERE] if crossing else out
        return out + [SPAN + s for s in range(self.n - size + 1) if not self._inside(s, size)]

    def _inside(self, start: int, size: int) -> bool:
        return any(a <= start and start + size <= e for a, e, _ in self.segments)

    def class_of(self, start: int, size: int) -> int:
        for j, (a, e, f) in enumerate(self.segments):
            if a <= start and start + size <= e:
                return j * self.per_node + (start - a) % f
        return SPAN + start if self.exhaustive else ANYWHERE

    def segment(self, cls: int) -> tuple[int, int, int, int]:
        """(first start, period, end, offset) of the starts of an in-segment class."""
        j, r = divmod(cls, self.per_node)
        a, e, f = self.segments[j]
        return a + r, f, e, r

    def starts(self, cls: int, size: int) -> list[int]:
        """Every start of class ``cls`` for a run of ``size``."""
        if cls == ANYWHERE:
            return [s for s in range(self.n - size + 1) if not self._inside(s, size)]
        if cls >= SPAN:
            return [cls - SPAN]
        first, period, end, _ = self.segment(cls)
        return list(range(first, end - size + 1, period))

    def links(self, tp: int, pp: int, dp: int, cls: int) -> tuple[int, int, int, int]:
        """(tp, pp, dp) link codes of the mesh of a run of class ``cls`` and its first DP group's
        members on the first GPU's node (as ``Candidates.of_layout``); ``ANYWHERE``: NIC for every
        kind of group with more than one GPU, one DP member a node. Remembered across
        searches by the segments: which positions share a node follows from them alone."""
        key = (tuple(self.segments), self.per_node, self.exhaustive, tp, pp, dp, cls)
        got = _LINKS.get(key)
        if got is None:
            if len(_LINKS) >= 1 << 17:
                _LINKS.clear()
            got = _LINKS[key] = self._links(tp, pp, dp, cls)
        return got

    def ep_links(self, tp: int, pp: int, dp: int, ep: int, etp: int, cls: int) -> tuple[int, int]:
        """(EP link code, EP group members on a node) of the mesh of a run of class ``cls``, as
        ``Candidates.of_layout`` derives them (``cost_model.ep_placement``)."""
        key = (tuple(self.segments), self.per_node, self.exhaustive, tp, pp, dp, ep, etp, cls)
        got = _EP_LINKS.get(key)
        if got is None:
            if len(_EP_LINKS) >= 1 << 17:
                _EP_LINKS.clear()
            if cls == ANYWHERE:
                got = (NIC, 1) if ep > 1 else (NVLINK, 1)
            else:
                start = self.starts(cls, tp * pp * dp)[0]
                got = ep_placement(self.node[start : start + tp * pp * dp].reshape(dp, pp, tp), ep, etp)
            _EP_LINKS[key] = got
        return got

    def _links(self, tp: int, pp: int, dp: int, cls: int) -> tuple[int, int, int, int]:
        if cls == ANYWHERE:
            return cast("tuple[int, int, int, int]", (*(NIC if k > 1 else NVLINK for k in (tp, pp, dp)), 1))
        start = self.starts(cls, tp * pp * dp)[0]
        return mesh_links(self.node[start : start + tp * pp * dp].reshape(dp, pp, tp))


@dataclass
class Option:
    """One candidate layout of a model-stage, with its cost for every start class."""

    tp: int
    pp: int
    dp: int
    micro_batches: int
    recompute: bool
    zero: int
    offload: tuple[str, ...]
    rho: int  # KiB of other model-stages' state this candidate tolerates on its GPUs (generation), else NO_RHO
    gpus: int
    times_s: dict[int, float]  # start class -> seconds
    times: dict[int, int]  # start class -> units of SearchProblem.unit_s, rounded up
    peak: int  # KiB: own peak during its stage (generation: its largest peak + others' state, less rho)
    resident: int  # KiB: own state kept between stages
    vpp: int = 1  # virtual pipeline stages per rank
    ep: int = 1  # expert parallelism (a mixture of experts)
    etp: int | None = None  # each expert's TP size (None: tp)

    @property
    def extra(self) -> int:
        """KiB its stage needs beyond what it keeps resident."""
        return self.peak - self.resident


class OptionRows(Sequence):
    """A model-stage's candidates as arrays, each an ``Option`` when first asked for: a search
    at 1,024 GPUs generates tens of thousands, of which ``restrict`` keeps a few percent, so
    most are never made. ``columns`` are the arrays bounds and look-ups read instead."""

    def __init__(
        self,
        columns: dict[str, np.ndarray],
        offload: list[tuple[str, ...]],
        classes: list[int],
        times_s: np.ndarray,
        units: np.ndarray,
    ) -> None:
        self.columns = columns  # tp pp dp mb rc zero rho gpus peak resident vpp ep etp fastest (units), one per option
        self.offload, self.classes, self.times_s, self.units = offload, classes, times_s, units
        self._made: dict[int, Option] = {}

    def __len__(self) -> int:
        return len(self.offload)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i = int(i) % len(self)
        o = self._made.get(i)
        if o is None:
            c = self.columns
            row_t, row_u = self.times_s[i].tolist(), self.units[i].tolist()
            at = [j for j, u in enumerate(row_u) if u != np.inf]
            o = self._made[i] = Option(
                int(c["tp"][i]),
                int(c["pp"][i]),
                int(c["dp"][i]),
                int(c["mb"][i]),
                bool(c["rc"][i]),
                int(c["zero"][i]),
                self.offload[i],
                int(c["rho"][i]),
                int(c["gpus"][i]),
                {self.classes[j]: row_t[j] for j in at},
                {self.classes[j]: int(row_u[j]) for j in at},
                int(c["peak"][i]),
                int(c["resident"][i]),
                int(c["vpp"][i]),
                int(c["ep"][i]),
                None if int(c["etp"][i]) == int(c["tp"][i]) else int(c["etp"][i]),
            )
        return o


def columns(options) -> dict[str, np.ndarray]:
    """The arrays of ``OptionRows.columns`` for any sequence of options."""
    if isinstance(options, OptionRows):
        return options.columns
    names = {
        "tp": "tp",
        "pp": "pp",
        "dp": "dp",
        "mb": "micro_batches",
        "rc": "recompute",
        "zero": "zero",
        "rho": "rho",
        "gpus": "gpus",
        "peak": "peak",
        "resident": "resident",
        "vpp": "vpp",
        "ep": "ep",
    }
    out = {
        k: np.array([getattr(o, a) for o in options], dtype=bool if k == "rc" else np.int64) for k, a in names.items()
    }
    out["etp"] = np.array([o.tp if o.etp is None else o.etp for o in options], dtype=np.int64)
    out["fastest"] = np.array([min(o.times.values()) for o in options], dtype=np.int64)
    return out


@dataclass
class Space:
    model_stage: str
    kind: str
    options: Sequence[Option]  # a list, or OptionRows as build_problem makes them
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
            out.append(part[:i] + [[first] + part[i]] + part[i + 1 :])
    return out


@dataclass
class SearchProblem:
    cluster: Cluster
    workload: Workload
    models: dict[str, Model]
    positions: Positions
    unit_s: float
    memory: int  # KiB per GPU
    stages: list[tuple[str, list[str]]]
    spaces: dict[str, Space]
    partitions: dict[str, list[list[list[str]]]] = field(default_factory=dict)
    headroom: float = 0.0  # fraction of GPU memory training and inference options leave free
    # a framework's rules beyond the candidates (``search.targets.Constraints``): ties between
    # model-stages' options and meshes; None: the free search
    constraints: Any = None

    @property
    def n(self) -> int:
        return self.positions.n

    def evaluate(self, choice: dict[str, int], start: dict[str, int], partition: dict[str, int]) -> int | None:
        """Step time (units) of options ``choice`` placed at ``start``, grouped by ``partition``;
        None if it breaks a constraint. The reference semantics of the CP-SAT model."""
        pos = self.positions
        opt = {ms: self.spaces[ms].options[i] for ms, i in choice.items()}
        span = {ms: (start[ms], start[ms] + opt[ms].gpus) for ms in opt}
        time = {}
        for ms, o in opt.items():
            lo, hi = span[ms]
            if lo < 0 or hi > pos.n:
                return None
            time[ms] = o.times.get(pos.class_of(lo, o.gpus), o.times.get(ANYWHERE))
            if time[ms] is None:
                return None
        total = 0
        for stage, _ in self.stages:
            groups = self.partitions[stage][partition[stage]]
            for g in groups:
                if len({start[ms] for ms in g}) > 1:
                    return None
            for ga, gb in itertools.combinations(groups, 2):
                for a in ga:
                    for b in gb:
                        if span[a][0] < span[b][1] and span[b][0] < span[a][1]:
                            return None
            total += max(sum(cast(int, time[ms]) for ms in g) for g in groups)
        load = np.zeros(pos.n, dtype=np.int64)
        for ms, o in opt.items():
            load[span[ms][0] : span[ms][1]] += o.resident
        for ms, o in opt.items():
            here = int(load[span[ms][0] : span[ms][1]].max())
            if o.extra + here > self.memory or here - o.resident > o.rho:
                return None
        if self.constraints is not None and not self.constraints.admits(self, choice, start):
            return None
        return total


def build_problem(
    cluster: Cluster,
    workload: Workload,
    models: dict[str, Model],
    cost: CostModel | None = None,
    max_tp: int | None = None,
    time_units: int = 1_000_000,
    max_pp: int = 0,
    max_zero: int = 3,
    offload: bool = True,
    exhaustive: bool | None = None,
    prune: bool = True,
    headroom: float = DEFAULT_HEADROOM,
    zeros: tuple[int, ...] | None = None,
) -> SearchProblem:
    """Generate, cost and prune the candidates of every model-stage of ``workload`` on ``cluster``.

    ``max_pp`` (0: no limit), ``max_zero`` and ``offload`` keep only layouts the job can run
    (a live model without pipeline stages, ZeRO or offload, say). ``exhaustive``: the full space,
    every start of a run and exact memory (default: on small jobs, see ``EXHAUSTIVE_GPUS``), else
    the large-cluster space and aligned starts. ``prune``: drop dominated candidates (``prune_rows``);
    ``plan_search.solve`` prunes the candidates each of its models holds, so it need not be done here.
    ``headroom``: the fraction of every GPU's memory training and inference leave free (see
    ``DEFAULT_HEADROOM``); generation keeps vLLM's own ``1 - gpu_memory_utilization``. Offload is
    searched only on a cluster that declares a host link and host memory. ``zeros``: the ZeRO
    stages of training candidates (default: 2 and 3, see ``layout_grid``)."""
    cost = cost or CostModel(cluster)
    n_avail = len(cluster.available_gpus())
    small = n_avail <= EXHAUSTIVE_GPUS and len(workload.model_stages()) <= FULL_SPACE_MODEL_STAGES
    pos = Positions.of(cluster, small if exhaustive is None else exhaustive)
    mem_kib = cluster.gpu_memory // KIB
    reserve_kib = int(np.ceil(headroom * cluster.gpu_memory / KIB))
    offload = offload and cluster.host_link is not None and cluster.host_memory is not None
    raw = {}
    for st in workload.stages:
        for ms in st.model_stages():
            raw[ms] = (
                st.kind,
                candidates(
                    cost,
                    pos,
                    workload,
                    models[ms.rpartition(".")[0]],
                    st.kind,
                    max_tp or cluster.gpus_per_node,
                    max_pp,
                    max_zero,
                    offload,
                    zeros,
                ),
            )
    # time unit: a step of the fastest candidates takes ``time_units`` units (the slowest ones
    # many more; CP-SAT's integers are 64-bit)
    best = sum(float(np.min(c.times, initial=np.inf)) for _, c in raw.values() if np.isfinite(c.times).any())
    unit = max(best / time_units, 1e-9) if best > 0 else 1e-3
    spaces = {}
    for ms, (kind, c) in raw.items():
        if kind != "generate":  # the headroom counts as part of the stage's own peak
            c.peak = np.minimum(c.peak + reserve_kib, np.iinfo(np.int64).max // 4)
        ok = np.isfinite(c.times).any(axis=1) & (c.peak <= mem_kib)
        units = np.where(np.isfinite(c.times), np.ceil(c.times / unit), np.inf)
        keep = np.flatnonzero(ok)
        if prune:
            keep = keep[
                prune_rows(c.gpus[keep], units[keep], c.peak[keep] - c.resident[keep], c.resident[keep], c.rho[keep])
            ]
        cols = {
            k: np.asarray(getattr(c, k))[keep]
            for k in ("tp", "pp", "dp", "mb", "rc", "zero", "rho", "gpus", "peak", "resident", "vpp", "ep", "etp")
        }
        kept_units = units[keep]
        cols["fastest"] = (
            kept_units.min(axis=1, initial=np.inf).astype(np.int64) if len(keep) else np.zeros(0, np.int64)
        )
        opts = OptionRows(
            cols, [c.offload[i] for i in keep.tolist()], np.asarray(c.classes).tolist(), c.times[keep], kept_units
        )
        spaces[ms] = Space(ms, kind, opts, len(c.tp))
    stages = [(st.name, st.model_stages()) for st in workload.stages]
    problem = SearchProblem(cluster, workload, models, pos, unit, mem_kib, stages, spaces, headroom=headroom)
    problem.partitions = {name: set_partitions(mss) for name, mss in stages}
    return problem


def layout_grid(
    model: Model,
    workload: Workload,
    kind: str,
    n: int,
    per_node: int,
    max_tp: int,
    max_pp: int = 0,
    max_zero: int = 3,
    offload: bool = True,
    full: bool = True,
    zeros: tuple[int, ...] | None = None,
) -> list[tuple]:
    """(tp, pp, dp, micro_batches, recompute, zero, offload, vpp, ep, etp) of every candidate
    layout (module docs); ``full=False`` is the large-cluster space; ``zeros``: the ZeRO stages of
    training layouts (default 2 and 3), each at most ``max_zero``. A mixture of experts also
    gets its expert carvings (``expert_carvings``)."""
    tps = [
        t
        for t in range(1, min(max_tp, model.heads) + 1)
        if model.heads % t == 0 and (t % model.kv_heads == 0 or model.kv_heads % t == 0) and t <= n
    ]
    top_pp = min(model.layers, n, max_pp or model.layers)
    pps = [p for p in range(1, top_pp + 1) if p <= 16 or model.layers % p == 0]
    # ZeRO 0 and 1 take the same time as 2 in the model and keep more state: 2 and 3 suffice
    stages = sorted({min(z, max_zero) for z in zeros or (2, 3)})
    rows = []
    for tp, pp in itertools.product(tps, pps):
        top = n // (tp * pp)
        dps = sorted(
            {
                d
                for d in range(1, top + 1)
                if tp * pp * d <= 2 * per_node
                or d & (d - 1) == 0
                or d == top
                or (tp * pp * d % per_node == 0 and tp * pp * d // per_node <= 8)
            }
        )
        for dp in dps:
            if dp > workload.samples or not replicas_share_steps(workload, kind, dp):
                continue  # Megatron-LM and verl cannot split an optimizer step over dp replicas
            if kind == "generate" or pp == 1:
                mbs = [1]
            else:
                most = flush_samples(workload, kind) // dp // workload.micro_batch
                if most < 1:
                    continue  # dp replicas of one micro-batch each exceed a pipeline flush
                fewer = range(1, pp) if pp <= 8 else [1 << k for k in range(pp.bit_length()) if 1 << k < pp]
                mbs = sorted({m for m in (fewer if full else ()) if m <= most} | {most})
            # interleaving: v virtual stages when they divide every stage's layers evenly, with
            # the most micro-batches a flush holds that are a multiple of pp (Megatron's rule)
            whole = (flush_samples(workload, kind) // dp // workload.micro_batch) // pp * pp if pp > 1 else 0
            shapes = [(mb, 1) for mb in mbs] + [
                (whole, v) for v in VIRTUAL_STAGES if kind != "generate" and whole and model.layers % (pp * v) == 0
            ]
            for mb, v in shapes:
                for rc in (False, True) if kind == "train" else (False,):
                    for z in stages if kind == "train" and dp > 1 else (0,):
                        for off in (OFFLOAD_CHOICES if full else LEAN_OFFLOAD)[kind] if offload else ((),):
                            for ep, etp in expert_carvings(model, kind, tp, dp):
                                rows.append((tp, pp, dp, mb, rc, z, off, v, ep, etp))
    return rows


EXPERT_PARALLEL = (1, 2, 4, 8, 16, 32, 64)  # EP sizes the search tries (powers of two, as deployments use)


def expert_carvings(model: Model, kind: str, tp: int, dp: int) -> list[tuple[int, int]]:
    """(ep, etp) choices of a layout: (1, tp) for a dense model. A mixture of experts in training
    or inference also splits its experts over EP ranks carved from dp x tp, each expert split as a
    dense MLP (etp = tp, EP from DP) or whole (etp = 1, Megatron's common MoE setting); in
    generation, vLLM's expert parallelism over each engine's TP ranks (ep = tp, etp = 1)."""
    out = [(1, tp)]
    if not model.moe:
        return out
    e = cast(int, model.experts)
    if kind == "generate":
        return out + ([(tp, 1)] if tp > 1 and e % tp == 0 else [])
    for etp in sorted({tp, 1}, reverse=True):
        out += [(ep, etp) for ep in EXPERT_PARALLEL[1:] if e % ep == 0 and (dp * tp) % (ep * etp) == 0]
    return out


_GRIDS: dict[tuple, tuple | None] = {}  # _grid_columns, by what layout_grid reads


def _grid_columns(
    model: Model,
    workload: Workload,
    kind: str,
    n: int,
    per_node: int,
    max_tp: int,
    max_pp: int,
    max_zero: int,
    offload: bool,
    full: bool,
    zeros: tuple[int, ...] | None = None,
) -> tuple | None:
    """``layout_grid`` as read-only arrays (tp, pp, dp, mb, rc, zero, vpp, ep, etp), the offload choices
    (a tuple per row, the distinct choices, and each row's choice's index), or None for an
    empty grid. Remembered by what the grid depends on: the model's heads, KV heads and layers,
    and the workload's batch sizes (a search at every step asks for the same grids again)."""
    key = (
        model.heads,
        model.kv_heads,
        model.layers,
        model.experts if model.moe else None,
        workload.samples,
        workload.mini_batch,
        workload.micro_batch,
        kind,
        n,
        per_node,
        max_tp,
        max_pp,
        max_zero,
        offload,
        full,
        zeros,
    )
    if key in _GRIDS:
        return _GRIDS[key]
    grid = layout_grid(model, workload, kind, n, per_node, max_tp, max_pp, max_zero, offload, full, zeros)
    out = None
    if grid:
        cols = list(zip(*grid))
        arrays = [np.array(cols[i], dtype=bool if i == 4 else np.int64) for i in (0, 1, 2, 3, 4, 5, 7, 8, 9)]
        for a in arrays:
            a.setflags(write=False)
        off = list(cols[6])
        choices = list(dict.fromkeys(off))
        index = {o: c for c, o in enumerate(choices)}
        code = np.array([index[o] for o in off], dtype=np.int64)
        code.setflags(write=False)
        out = (*arrays, tuple(off), choices, code)
    if len(_GRIDS) >= 256:
        _GRIDS.clear()
    _GRIDS[key] = out
    return out


def sequence_parallel(tp, kind: str):
    """Whether a candidate runs with sequence parallelism: whenever it has TP and is a Megatron-
    style training or inference pass (vLLM's generation has none). It moves the same bytes as
    TP's all-reduces and keeps less: no candidate without it is better."""
    return (np.asarray(tp) > 1) & (kind != "generate")


@dataclass
class Rows:
    """Candidates of one model-stage as arrays; ``times[i, j]``: seconds at start class ``classes[j]`` (inf: not a "
    "start)."""

    tp: np.ndarray
    pp: np.ndarray
    dp: np.ndarray
    mb: np.ndarray
    rc: np.ndarray
    zero: np.ndarray
    offload: list[tuple[str, ...]]
    rho: np.ndarray  # KiB (NO_RHO: not generation)
    gpus: np.ndarray
    classes: np.ndarray
    times: np.ndarray
    peak: np.ndarray  # KiB
    resident: np.ndarray  # KiB
    vpp: np.ndarray
    ep: np.ndarray
    etp: np.ndarray


def candidates(
    cost: CostModel,
    pos: Positions,
    workload: Workload,
    model: Model,
    kind: str,
    max_tp: int,
    max_pp: int = 0,
    max_zero: int = 3,
    offload: bool = True,
    zeros: tuple[int, ...] | None = None,
) -> Rows:
    """Every candidate of one model-stage with its time per start class, costed in vectorized calls."""
    cluster = cost.cluster
    g = _grid_columns(
        model, workload, kind, pos.n, pos.per_node, max_tp, max_pp, max_zero, offload, pos.exhaustive, zeros
    )
    if g is None:
        e = np.zeros(0, dtype=np.int64)
        return Rows(e, e, e, e, e.astype(bool), e, [], e, e, e, np.zeros((0, 0)), e, e, e, e, e)
    tp, pp, dp, mb, rc, zero, vpp, ep, etp, off, choices, code = g
    off = list(off)
    sp = sequence_parallel(tp, kind)
    weights, grads, optimizer = cost.state(
        model,
        kind,
        Candidates.grid(
            cluster, model.layers, tp, pp, dp, micro_batches=mb, recompute=rc, zero=zero, sp=sp, vpp=vpp, ep=ep, etp=etp
        ),
    )
    state = {"weights": weights, "grads": grads, "optimizer": optimizer}
    offloaded = np.zeros(len(tp))  # each row's offloaded state, summed in its choice's order
    for c, o in enumerate(choices):
        if o:
            mine = code == c
            offloaded[mine] = sum(np.asarray(state[k], dtype=float)[mine] for k in o)
    rho = np.full(len(tp), np.inf)  # bytes others may keep (generation)
    if kind == "generate":  # one row per number of waves the KV cache allows, at the most others may keep
        keep, rho = wave_points(cost, workload, model, weights, tp, pp, dp, MAX_WAVE_POINTS if pos.exhaustive else 8)
        tp, pp, dp, mb, rc, zero, offloaded, vpp, ep, etp = (
            v[keep] for v in (tp, pp, dp, mb, rc, zero, offloaded, vpp, ep, etp)
        )
        off = [off[i] for i in keep.tolist()]
    gpus = tp * pp * dp
    # every row at every start class of its size, with the links of the mesh at that start: the
    # classes of each size concatenated (``flat``), a row's expansion its size's slice of them
    sizes, size_of = np.unique(gpus, return_inverse=True)
    by_size = [pos.classes(int(s)) for s in sizes.tolist()]
    lens = np.array([len(ks) for ks in by_size], dtype=np.int64)
    flat = np.array([k for ks in by_size for k in ks], dtype=np.int64)
    classes = np.unique(flat)
    counts = lens[size_of]
    ex_row = np.repeat(np.arange(len(tp)), counts)
    first_of_size = np.cumsum(lens) - lens
    first_of_row = np.cumsum(counts) - counts
    ex_cls = flat[np.repeat(first_of_size[size_of] - first_of_row, counts) + np.arange(len(ex_row))]
    col = np.searchsorted(classes, ex_cls)
    lk = np.zeros((0, 4), dtype=np.int64)
    if len(ex_row):
        # the links of each distinct (mesh, class), a mesh numbered by its (tp, pp, dp) and named by its first row
        base = int(max(tp.max(), pp.max(), dp.max())) + 1
        _, row_of_mesh, mesh_of = np.unique((tp * base + pp) * base + dp, return_index=True, return_inverse=True)
        keys, key_of = np.unique(mesh_of.reshape(-1)[ex_row] * len(classes) + col, return_inverse=True)
        at, cls = row_of_mesh[keys // len(classes)], classes[keys % len(classes)]
        lk = np.array(
            [pos.links(*key) for key in zip(tp[at].tolist(), pp[at].tolist(), dp[at].tolist(), cls.tolist())],
            dtype=np.int64,
        ).reshape(-1, 4)[key_of.reshape(-1)]
    if len(ex_row) and np.any(ep > 1):  # the EP groups' links where the mesh at each start puts them
        keys = np.stack([tp[ex_row], pp[ex_row], dp[ex_row], ep[ex_row], etp[ex_row], classes[col]], axis=1)
        distinct, which = np.unique(keys, axis=0, return_inverse=True)
        got = np.array([pos.ep_links(*(int(v) for v in k)) for k in distinct], dtype=np.int64).reshape(-1, 2)
        lk = np.concatenate([lk, got[which.reshape(-1)]], axis=1)
    return costed_rows(
        cost,
        workload,
        model,
        kind,
        (tp, pp, dp, mb, rc, zero, vpp, ep, etp),
        off,
        offloaded,
        rho,
        classes,
        ex_row,
        col,
        lk,
    )


def costed_rows(
    cost: CostModel,
    workload: Workload,
    model: Model,
    kind: str,
    cols: tuple,
    off: list,
    offloaded: np.ndarray,
    rho: np.ndarray,
    classes: np.ndarray,
    ex_row: np.ndarray,
    col: np.ndarray,
    lk: np.ndarray,
) -> Rows:
    """``Rows`` of the candidates ``cols`` (tp, pp, dp, mb, rc, zero, vpp, ep, etp: one entry per row)
    expanded at their start classes: row ``ex_row[i]`` starting in class ``classes[col[i]]``, its
    mesh's (tp, pp, dp) links and DP members on a node ``lk[i]`` (then its EP link and EP members
    on a node, where a row has expert parallelism). Each expansion is costed for its time; a row's memory is
    its first expansion's."""
    tp, pp, dp, mb, rc, zero, vpp, ep, etp = cols
    cluster = cost.cluster
    times = np.full((len(tp), len(classes)), np.inf)
    peak = np.zeros(len(tp))
    resident = np.zeros(len(tp))
    if len(ex_row):
        r = ex_row
        cand = Candidates.grid(
            cluster,
            model.layers,
            tp[r],
            pp[r],
            dp[r],
            micro_batches=mb[r],
            recompute=rc[r],
            zero=zero[r],
            sp=sequence_parallel(tp[r], kind),
            vpp=vpp[r],
            ep=ep[r],
            etp=etp[r],
        )
        cand.tp_link, cand.pp_link, cand.dp_link, cand.dp_local = lk[:, 0], lk[:, 1], lk[:, 2], lk[:, 3]
        if lk.shape[1] > 4:  # expert parallelism: the EP groups' links and members on a node
            cand.ep_link, cand.ep_local = lk[:, 4], lk[:, 5]
        cand.resident = np.where(np.isfinite(rho[r]), rho[r], 0.0)
        sc = cost.stage(model, workload, kind, cand)
        feat, lat = cost.offload_time(offloaded[r])  # as estimate charges it
        off_time = np.where(offloaded[r] > 0, feat * cost.coeffs[C_PCIE] + lat, 0.0)
        # a node's host memory split evenly over its GPUs and the model-stages that may offload:
        # within its share no placement can overfill a node (estimate checks the plan's sum)
        host_share = (
            cluster.host_memory / cluster.gpus_per_node / len(workload.model_stages()) if cluster.host_memory else 0.0
        )
        off_time = np.where(offloaded[r] > host_share, np.inf, off_time)
        with np.errstate(invalid="ignore"):
            t = sc.time(cost.coeffs) + off_time
        times[r, col] = np.where(np.isfinite(t), t, np.inf)
        # memory does not depend on where the run starts: each row's first expansion
        first = np.unique(r, return_index=True)[1]
        rf = r[first]
        peak[rf] = sc.memory()[first]
        resident[rf] = sc.resident_state[first] - offloaded[rf]
        if kind == "generate":
            most = _generation_peak_bound(cost, workload, model, sc.weights[first], tp[rf], pp[rf], dp[rf], rho[rf])
            # stated so that own peak + others' state <= memory holds for every state up to rho
            # exactly when the largest one fits: (peak - resident) + (resident + others) <= memory
            peak[rf] = np.where(most <= cluster.gpu_memory, most - rho[rf], np.inf)
    with np.errstate(invalid="ignore"):
        return Rows(
            tp,
            pp,
            dp,
            mb,
            rc,
            zero,
            off,
            np.where(np.isfinite(rho), np.floor(rho / KIB), NO_RHO).astype(np.int64),
            tp * pp * dp,
            classes,
            times,
            np.where(np.isfinite(peak), np.ceil(peak / KIB), np.iinfo(np.int64).max // 4).astype(np.int64),
            np.ceil(resident / KIB).astype(np.int64),
            vpp,
            ep,
            etp,
        )


def per_sequence(workload: Workload, model: Model, tp, pp, dp) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(KV bytes, logits bytes, samples) per sequence and replica of generation rows, as the cost model counts them."""
    tp, pp, dp = (np.asarray(v, dtype=float) for v in (tp, pp, dp))
    layers = np.ceil(model.layers / pp)  # the fullest pipeline stage
    seq = workload.prompt_len_mean + workload.response_len_mean
    return seq * CostModel.kv_bytes_per_token(model, tp, layers), model.vocab * 4 / tp, workload.samples / dp


def wave_points(cost: CostModel, workload: Workload, model: Model, weights, tp, pp, dp, most: int = MAX_WAVE_POINTS):
    """Generation rows expanded at every resident state of others where generation's time changes.

    The KV cache gets ``0.9 x memory - weights - others`` (the cost model's vLLM rule) and holds
    ``c`` sequences at once, so others may keep at most ``budget - c x KV bytes per sequence``.
    Without a response-length distribution the time depends on ``c`` only through the number of
    waves: ``w`` waves need ``ceil(S / w)`` sequences, one point per wave count. With one,
    continuous batching's decode iterations depend on ``c`` itself (``decode_iterations``): one
    point per concurrency ``1 .. S``. Returns (row index per new row, rho in bytes).

    Rows share their concurrencies (one set per number of samples a replica generates, a few per
    job) and their geometric thinning (one per number of points): both made once per call."""
    kv_seq, _, samples = per_sequence(workload, model, tp, pp, dp)
    budgets = VLLM_GPU_MEMORY_UTILIZATION * cost.cluster.gpu_memory - np.asarray(weights, dtype=float)
    sizes: dict[float, np.ndarray] = {}  # samples -> concurrencies, descending
    thin: dict[int, np.ndarray] = {}  # number of points -> the indices kept
    keep, rho = [], []
    for i in range(len(kv_seq)):
        need = sizes.get(samples[i])
        if need is None:
            need = sizes[samples[i]] = np.array(
                sorted(concurrencies(samples[i], bool(workload.response_len_dist)), reverse=True), dtype=float
            )
        points = budgets[i] - need * kv_seq[i]
        points = points[points >= 0]
        n = len(points)
        if n > most:  # geometric in the wave count beyond this many
            idx = thin.get(n)
            if idx is None:
                idx = thin[n] = np.array(sorted({min(n - 1, int(round(x)) - 1) for x in np.geomspace(1, n, most)}))
            points = points[idx]
        keep.append(np.full(len(points), i, dtype=np.int64))
        rho.append(points)
    if not keep:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=float)
    return np.concatenate(keep), np.concatenate(rho)


def concurrencies(samples: float, by_length: bool) -> set[int]:
    """The numbers of sequences at once at which generation's time changes: every one of
    ``1 .. ceil(samples)`` when decode follows a response-length distribution (``by_length``),
    else the wave sizes."""
    return set(range(1, math.ceil(samples) + 1)) if by_length else wave_sizes(samples)


def wave_sizes(samples: float) -> set[int]:
    """Every distinct ``ceil(samples / w)`` for w = 1 .. ceil(samples): those of w up to about
    sqrt(samples), and below them every integer (O(sqrt) instead of O(samples))."""
    k = math.isqrt(math.ceil(samples)) + 1
    return {math.ceil(samples / w) for w in range(1, k + 1)} | set(range(1, math.ceil(samples / k) + 1))


def _generation_peak_bound(cost: CostModel, workload: Workload, model: Model, weights, tp, pp, dp, rho) -> np.ndarray:
    """The largest own peak + others' state of generation rows over every state ``x <= rho``
    others may keep. Own peak(x) = weights + n(x) x (KV + logits per sequence), n(x) = min(S,
    floor((0.9 M - weights - x) / KV per sequence)); n(x) + x is piecewise linear in x without the
    floor, so its largest value is at 0, at rho or at the kink where n reaches S."""
    kv_seq, act_seq, samples = per_sequence(workload, model, tp, pp, dp)
    budget = VLLM_GPU_MEMORY_UTILIZATION * cost.cluster.gpu_memory - weights

    def f(x, floor=True):
        n = (budget - x) / kv_seq
        return weights + np.clip(np.floor(n) if floor else n, 0, samples) * (kv_seq + act_seq) + x

    kink = np.clip(budget - samples * kv_seq, 0, rho)
    worst = np.maximum.reduce([f(np.zeros_like(rho), False), f(rho, False), f(kink, False)])
    return np.maximum(worst, f(rho))


def prune_rows(
    gpus: np.ndarray, times: np.ndarray, extra: np.ndarray, resident: np.ndarray, rho: np.ndarray
) -> np.ndarray:
    """Indices of the candidates no other dominates: none with no more GPUs, no more time at any
    start class (inf where it cannot start), no more peak beyond its resident state, no more
    resident state and no less allowance for others' state.

    Sound for the model: at the same start, the dominating candidate takes a subset of the GPUs
    (every start class of a run is a class of a shorter run, or marked inf for it and then never
    dominating there), and no constraint or the objective gets worse."""
    if not len(gpus):
        return np.zeros(0, dtype=np.int64)
    big = np.float64(1e300)
    keys = np.column_stack(
        [gpus, np.where(np.isfinite(times), times, big), extra, resident, -rho.astype(float)]
    ).astype(float)
    # in lexicographic order a row can only be dominated by an earlier one (or an equal one,
    # of which the first is kept); by transitivity, by an earlier one that is kept. Blocks of
    # rows are checked against the rows kept so far and against the earlier rows of the block.
    order = np.lexsort(keys.T[::-1])
    kept = np.zeros(0, dtype=np.int64)
    for lo in range(0, len(order), 256):
        idx = order[lo : lo + 256]
        k = keys[idx]
        dominated = np.all(keys[kept][None, :, :] <= k[:, None, :], axis=2).any(axis=1)
        earlier = np.tril(np.all(k[None, :, :] <= k[:, None, :], axis=2), -1)
        dominated |= earlier.any(axis=1)
        kept = np.concatenate([kept, idx[~dominated]])
    return np.sort(kept)


def prune(options: list[Option]) -> list[Option]:
    """``prune_rows`` on Option objects."""
    return [options[i] for i in prune_options(options)]


def prune_options(options: Sequence[Option], among: np.ndarray | None = None) -> np.ndarray:
    """Indices of the options ``prune_rows`` keeps; with ``among``, of ``options[among]``
    (positions in ``among``). ``OptionRows`` are pruned by their arrays, without making an
    option (a start class none of them can start at is a column of inf, which decides nothing)."""
    if isinstance(options, OptionRows):
        at = np.arange(len(options)) if among is None else np.asarray(among, dtype=np.int64)
        c = options.columns
        return prune_rows(
            c["gpus"][at], options.units[at], (c["peak"] - c["resident"])[at], c["resident"][at], c["rho"][at]
        )
    if among is not None:
        options = [options[i] for i in among]
    if not options:
        return np.zeros(0, dtype=np.int64)
    classes = sorted({k for o in options for k in o.times})
    times = np.array([[o.times.get(k, np.inf) for k in classes] for o in options], dtype=float).reshape(
        len(options), -1
    )
    col = columns(options)
    return prune_rows(col["gpus"], times, col["peak"] - col["resident"], col["resident"], col["rho"])
