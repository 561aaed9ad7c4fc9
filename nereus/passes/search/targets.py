"""``plan-search{target=verl|openrlhf|megatron}``: search only the plans a framework runs as
written; ``as_run_by``: any plan rewritten as that framework would run it.

A target is a set of constraints on the search problem, applied three ways: candidates the
framework cannot run are dropped (``apply_target``), stages keep only the groupings it runs,
and ties between model-stages (``Constraints``: equal sizes, equal starts, disjoint or identical
meshes) enter the CP-SAT model (``Constraints.add``) and the reference evaluator
(``Constraints.admits``, which ``SearchProblem.evaluate`` and so the brute force obey). Dominance
pruning compares only options the ties treat alike (``Constraints.prune``).

Read in the frameworks' own code (volcengine/verl b178a3c, OpenRLHF/OpenRLHF 3c3be62,
NVIDIA/Megatron-LM d98e8a6):

- ``verl`` (the colocated hybrid engine, FSDP or Megatron workers):
  every role is mapped to one resource pool of every GPU (``verl/trainer/main_ppo.py``:
  ``resource_pool_spec = {"global_pool": [n_gpus_per_node] * nnodes}``, each role's
  ``self.mapping[role] = "global_pool"``), so every layout spans all GPUs and a stage's
  model-stages run one after another (``ray_trainer.py`` fuses a pool's roles into one process,
  ``create_colocated_worker_cls``, and calls them in turn). The rollout has TP and DP, no PP
  (``verl/workers/config/rollout.py``: ``pipeline_model_parallel_size > 1`` raises
  ``NotImplementedError`` for vllm, sglang and trtllm). Training and inference layouts share one
  set of model-parallel sizes: FSDP workers have none (``fsdp_workers.py``: a 1-D ``fsdp`` mesh
  over the world, ``FULL_SHARD`` = ZeRO-3, or ``SHARD_GRAD_OP`` = ZeRO-2 with
  ``reshard_after_forward=False``); Megatron workers initialise ``mpu`` once per process with
  the actor's ``actor.megatron`` TP/PP/VPP/CP (``megatron_workers.py``: ``if self._is_actor or
  self._is_ref: mpu.initialize_model_parallel(...)``, the critic's and reward model's own
  call guarded by ``if not torch.distributed.is_initialized()``), with the distributed optimizer
  (``use_distributed_optimizer``, ZeRO-1). This export runs Megatron workers when a trained
  layout has TP or PP, FSDP otherwise. A pipeline flushes once per mini-batch
  (``megatron_actor.py``: ``forward_backward_func(..., num_microbatches=n_micro_batch)``).
  Offload: ``param_offload`` and ``optimizer_offload`` (FSDP ``fsdp_config``, Megatron
  ``McoreEngineConfig``), no gradients. The FSDP reference model is always CPU-offloaded
  (``fsdp_workers.py``: ``cpu_offload = None if role == "actor" else
  CPUOffload(offload_params=True)``), so on a cluster with a host link its weights are
  offloaded. Left out: HSDP (``fsdp_size``), Ulysses (``ulysses_sequence_parallel_size``;
  the search has no CP), a separate reward pool (``reward_model.enable_resource_pool``), and
  clusters with failed GPUs (verl takes whole nodes).
- ``openrlhf`` (Ray, DeepSpeed training, vLLM rollout; ``openrlhf/cli/train_ppo_ray.py``):
  each model is one ``RayActorGroup`` of ``num_nodes x num_gpus_per_node`` GPUs, its forward
  passes and training on the same GPUs and sizes; DeepSpeed's ``ds.tensor_parallel_size``
  (AutoTP) and ``ds.zero_stage`` are one setting for every model (``deepspeed.py``); no
  pipeline parallelism; vLLM engines have TP only (``vllm.num_engines`` x
  ``vllm.tensor_parallel_size``). Placement: with ``train.colocate_all`` every model and the
  engines share the actor's placement group (asserted: actor GPUs == engines x TP); otherwise
  the engines have GPUs of their own (and no sleep mode: ``vllm.enable_sleep`` is turned off
  without ``colocate_all``), actor and reference share GPUs only with
  ``train.colocate_actor_ref`` (same sizes, asserted), critic and reward model only with
  ``train.colocate_critic_reward``, and every other pair of models takes disjoint GPUs (one GPU
  per Ray actor). Offload: ``ds.adam_offload`` (optimizer) for training (``offload=False`` for
  the trained weights), ``ref.offload`` and ``reward.offload`` for the frozen models. Left out:
  ``ds.enable_sleep`` (offloading all DeepSpeed state under ``colocate_all``), ring attention.
- ``megatron`` (Megatron-LM training only, ``megatron/training/arguments.py``): the trained
  model-stages with the distributed optimizer (ZeRO-1) or Megatron-FSDP
  (``--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads|optim_grads_params``:
  ZeRO-2/3), one pipeline flush per global batch, no state offloaded between stages (an RL
  framework's job); generation and inference are not Megatron-LM's and stay free.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from ...ir import Layout, Module, Plan
from ...ir.model import even_split
from ...ir.verifier import flush_samples
from .space import Option, OptionRows, SearchProblem, columns, prune_options

TARGETS = ("verl", "openrlhf", "megatron")


# ------------------------------------------------------------------ relations
@dataclass(frozen=True)
class Same:
    """``attr`` (an option column, ``offload_weights`` or ``gpus``) equal over ``members``."""

    attr: str
    members: tuple[str, ...]


@dataclass(frozen=True)
class Fixed:
    attr: str
    member: str
    value: int


@dataclass(frozen=True)
class SameStart:
    members: tuple[str, ...]


@dataclass(frozen=True)
class Apart:
    """The meshes of ``a`` and ``b`` share no GPU."""

    a: str
    b: str


@dataclass(frozen=True)
class SameOrApart:
    """The meshes of ``a`` and ``b`` are the same GPUs (same start and size) or share none."""

    a: str
    b: str


Relation = Same | Fixed | SameStart | Apart | SameOrApart


def _offloads(options: Sequence[Option]) -> list[tuple[str, ...]]:
    return list(options.offload) if isinstance(options, OptionRows) else [o.offload for o in options]


def attribute(options: Sequence[Option], name: str) -> np.ndarray:
    """One integer per option: a column of ``columns`` or ``offload_weights`` (0/1)."""
    if name == "offload_weights":
        return np.array(["weights" in o for o in _offloads(options)], dtype=np.int64)
    return columns(options)[name].astype(np.int64)


def _members(r: Relation) -> tuple[str, ...]:
    if isinstance(r, Same | SameStart):
        return r.members
    if isinstance(r, Fixed):
        return (r.member,)
    return (r.a, r.b)


@dataclass
class Constraints:
    """A framework's rules beyond its candidates: ``alternatives`` (name, relations), of which
    exactly one holds (OpenRLHF: everything colocated, or separate placement groups)."""

    target: str
    alternatives: list[tuple[str, list[Relation]]]

    @property
    def members(self) -> set[str]:
        return {ms for _, rels in self.alternatives for r in rels for ms in _members(r)}

    def _keys(self, ms: str) -> list[str]:
        keys: set[str] = set()
        for _, rels in self.alternatives:
            for r in rels:
                if isinstance(r, Same | Fixed) and ms in _members(r):
                    keys.add(r.attr)
                elif isinstance(r, SameOrApart) and ms in _members(r):
                    keys.add("gpus")
        return sorted(keys)

    def prune(self, ms: str, options: Sequence[Option], among: np.ndarray) -> np.ndarray:
        """``prune_options`` within each group of options with equal tied attributes: an option
        that dominates another but has other sizes may break a tie the other keeps."""
        among = np.asarray(among, dtype=np.int64)
        keys = self._keys(ms)
        if not keys or not len(among):
            return among[prune_options(options, among)]
        vals = np.column_stack([attribute(options, k)[among] for k in keys])
        _, group = np.unique(vals, axis=0, return_inverse=True)
        group = np.asarray(group).reshape(-1)
        kept = []
        for g in np.unique(group).tolist():
            sub = among[group == g]
            kept.append(sub[prune_options(options, sub)])
        return np.sort(np.concatenate(kept))

    def admits(self, problem: SearchProblem, choice: dict[str, int], start: dict[str, int]) -> bool:
        """Whether options ``choice`` placed at ``start`` keep one of the alternatives."""
        opts = {ms: problem.spaces[ms].options[c] for ms, c in choice.items()}

        def value(ms: str, attr: str) -> int:
            return opts[ms].gpus if attr == "gpus" else int(attribute([opts[ms]], attr)[0])

        def apart(a: str, b: str) -> bool:
            return start[a] + opts[a].gpus <= start[b] or start[b] + opts[b].gpus <= start[a]

        def holds(r: Relation) -> bool:
            if isinstance(r, Same):
                return len({value(ms, r.attr) for ms in r.members}) <= 1
            if isinstance(r, Fixed):
                return value(r.member, r.attr) == r.value
            if isinstance(r, SameStart):
                return len({start[ms] for ms in r.members}) <= 1
            if isinstance(r, Apart):
                return apart(r.a, r.b)
            same = start[r.a] == start[r.b] and opts[r.a].gpus == opts[r.b].gpus
            return same or apart(r.a, r.b)

        return any(all(holds(r) for r in rels) for _, rels in self.alternatives)

    def add(self, m, problem: SearchProblem, pick: dict, s: dict, G: dict) -> None:
        """The relations into a CP-SAT model whose ``pick[ms][(option, class)]`` booleans choose
        the options of ``problem`` (``s``: starts, ``G``: GPU counts)."""
        made: dict[tuple[str, str], object] = {}

        def value(ms: str, attr: str):
            if attr == "gpus":
                return G[ms]
            if (ms, attr) not in made:
                vals = attribute(problem.spaces[ms].options, attr)
                v = m.new_int_var(int(vals.min()), int(vals.max()), f"{attr}[{ms}]")
                m.add(v == sum(int(vals[c]) * b for (c, _), b in pick[ms].items()))
                made[ms, attr] = v
            return made[ms, attr]

        def apart(a: str, b: str, on: list) -> None:
            side = m.new_bool_var(f"apart[{a},{b}]")
            m.add(s[a] + G[a] <= s[b]).only_enforce_if(on + [side])
            m.add(s[b] + G[b] <= s[a]).only_enforce_if(on + [side.Not()])

        if len(self.alternatives) == 1:
            lits: list[list] = [[]]
        else:
            bools = [m.new_bool_var(f"alternative[{name}]") for name, _ in self.alternatives]
            m.add_exactly_one(bools)
            lits = [[b] for b in bools]
        for (_, rels), on in zip(self.alternatives, lits):
            for r in rels:
                if isinstance(r, Same):
                    for a, b in itertools.pairwise(r.members):
                        m.add(value(a, r.attr) == value(b, r.attr)).only_enforce_if(on)
                elif isinstance(r, Fixed):
                    m.add(value(r.member, r.attr) == r.value).only_enforce_if(on)
                elif isinstance(r, SameStart):
                    for a, b in itertools.pairwise(r.members):
                        m.add(s[a] == s[b]).only_enforce_if(on)
                elif isinstance(r, Apart):
                    apart(r.a, r.b, on)
                else:
                    eq = m.new_bool_var(f"same[{r.a},{r.b}]")
                    m.add(s[r.a] == s[r.b]).only_enforce_if(on + [eq])
                    m.add(G[r.a] == G[r.b]).only_enforce_if(on + [eq])
                    apart(r.a, r.b, on + [eq.Not()])


# ------------------------------------------------------------------- targets
@dataclass
class TargetRules:
    """What ``apply_target`` does to a problem: per model-stage the options kept (a mask over
    its options), per stage the groupings kept (None: all), and the ties."""

    keep: dict[str, np.ndarray]
    partitions: dict[str, list[int]] | None
    constraints: Constraints | None
    notes: list[str] = field(default_factory=list)


def zeros_of(target: str) -> tuple[int, ...] | None:
    """The ZeRO stages training candidates are generated with for ``target`` (None: the
    default 2 and 3): verl's Megatron workers run the distributed optimizer, ZeRO-1, which the
    free search leaves out as dominated by ZeRO-2."""
    return (1, 2, 3) if target == "verl" else None


def roles(models: dict, workload) -> dict[str, str]:
    """model -> actor (generates, or a trained LM), critic (trained value head), ref (frozen LM
    head), reward (frozen value head), as ``nereus export`` assigns them."""
    gen = {md for st in workload.stages if st.kind == "generate" for md in st.models}
    out = {}
    for name in workload.roles:
        md = models[name]
        out[name] = (
            "actor"
            if name in gen or (md.trained and md.head == "lm")
            else "critic"
            if md.trained
            else "ref"
            if md.head == "lm"
            else "reward"
        )
    return out


def _one_flush(problem: SearchProblem, kind: str, col: dict[str, np.ndarray]) -> np.ndarray:
    """A pipeline flushes once per optimizer step (training) or once per step (forward only):
    ``flush_samples / (dp x micro_batch)`` micro-batches, as verl and Megatron-LM derive them."""
    w = problem.workload
    most = flush_samples(w, kind) // np.maximum(col["dp"], 1) // w.micro_batch
    return (col["pp"] == 1) | (col["mb"] == most)


def _kinds(problem: SearchProblem) -> dict[str, str]:
    return {ms: sp.kind for ms, sp in problem.spaces.items()}


def _single_group(problem: SearchProblem) -> dict[str, list[int]]:
    return {st: [i for i, part in enumerate(problem.partitions[st]) if len(part) == 1] for st, _ in problem.stages}


def _verl(problem: SearchProblem) -> TargetRules:
    n, c = problem.n, problem.cluster
    role = roles(problem.models, problem.workload)
    offload_ok = c.host_link is not None and c.host_memory is not None
    keep = {}
    for ms, sp in problem.spaces.items():
        col, off = columns(sp.options), _offloads(sp.options)
        ok = col["gpus"] == n  # one resource pool of every GPU
        if sp.kind == "generate":
            ok &= col["pp"] == 1  # rollout.py: no rollout PP
        else:
            ok &= _one_flush(problem, sp.kind, col)
            fsdp = col["tp"] * col["pp"] == 1  # no model parallelism: FSDP workers
            if sp.kind == "train":
                # FSDP: FULL_SHARD (3) or SHARD_GRAD_OP (2); Megatron: distributed optimizer (1)
                ok &= np.where(fsdp, (col["zero"] >= 2) | (col["dp"] == 1), col["zero"] <= 1)
                ok &= np.array(["grads" not in o for o in off], dtype=bool)  # param/optimizer offload only
            if role[ms.rpartition(".")[0]] == "ref" and offload_ok:  # FSDP forces the ref's CPUOffload
                ok &= ~fsdp | attribute(sp.options, "offload_weights").astype(bool)
        keep[ms] = ok
    shared = tuple(ms for ms, k in _kinds(problem).items() if k != "generate")
    rels: list[Relation] = [Same(a, shared) for a in ("tp", "pp", "vpp")] if len(shared) > 1 else []
    return TargetRules(keep, _single_group(problem), Constraints("verl", [("verl", rels)]))


def _node_shaped(g: np.ndarray, nodes: int, per_node: int) -> np.ndarray:
    """``num_nodes x num_gpus_per_node`` GPUs with at most ``per_node`` on each of at most ``nodes``."""
    return np.array(
        [any(x % b == 0 and x // b <= nodes for b in range(1, per_node + 1)) for x in g.tolist()], dtype=bool
    )


def _openrlhf(problem: SearchProblem) -> TargetRules:
    c = problem.cluster
    role = roles(problem.models, problem.workload)
    kinds = _kinds(problem)
    keep = {}
    for ms, sp in problem.spaces.items():
        col, off = columns(sp.options), _offloads(sp.options)
        md = ms.rpartition(".")[0]
        ok = (col["pp"] == 1) & (col["vpp"] == 1)  # DeepSpeed and vLLM engines here: no PP
        if sp.kind != "generate":
            ok &= _node_shaped(col["gpus"], c.nodes, c.gpus_per_node)
            if sp.kind == "train":  # ds.adam_offload only
                ok &= np.array([set(o) <= {"optimizer"} for o in off], dtype=bool)
            elif problem.models[md].trained:  # the forward pass of the training engine
                ok &= np.array([not o for o in off], dtype=bool)
        keep[ms] = ok
    shared = tuple(ms for ms, k in kinds.items() if k != "generate")
    trained = tuple(ms for ms, k in kinds.items() if k == "train")
    common: list[Relation] = []
    if len(shared) > 1:
        common.append(Same("tp", shared))  # ds.tensor_parallel_size
    if len(trained) > 1:
        common.append(Same("zero", trained))  # ds.zero_stage
    group: dict[str, list[str]] = {}  # model -> its forward and training model-stages (one RayActorGroup)
    for ms in shared:
        group.setdefault(ms.rpartition(".")[0], []).append(ms)
    for mss in group.values():
        if len(mss) > 1:
            common += [SameStart(tuple(mss)), Same("dp", tuple(mss))]
    every = tuple(problem.spaces)
    together = common + ([SameStart(every), Same("gpus", every)] if len(every) > 1 else [])
    apart: list[Relation] = list(common)
    gens = [ms for ms, k in kinds.items() if k == "generate"]
    rep = {md: mss[0] for md, mss in group.items()}
    for g in gens:
        apart.append(Fixed("offload_weights", g, 0))  # vllm.enable_sleep needs colocate_all
        apart += [Apart(g, r) for r in rep.values()]
    for (ma, a), (mb, b) in itertools.combinations(rep.items(), 2):
        pair = {role[ma], role[mb]}
        shareable = pair in ({"actor", "ref"}, {"critic", "reward"})  # colocate_actor_ref, colocate_critic_reward
        apart.append(SameOrApart(a, b) if shareable else Apart(a, b))
    alts = [("colocate_all", together), ("placement groups", apart)]
    return TargetRules(keep, None, Constraints("openrlhf", alts))


def _megatron(problem: SearchProblem) -> TargetRules:
    keep = {}
    for ms, sp in problem.spaces.items():
        col = columns(sp.options)
        ok = np.ones(len(sp.options), dtype=bool)
        if sp.kind == "train":
            ok &= (col["zero"] >= 1) | (col["dp"] == 1)  # distributed optimizer or Megatron-FSDP
            ok &= _one_flush(problem, "train", col)
            ok &= np.array([not o for o in _offloads(sp.options)], dtype=bool)
        keep[ms] = ok
    return TargetRules(keep, None, None)


def _subset(options: Sequence[Option], idx: np.ndarray) -> Sequence[Option]:
    if isinstance(options, OptionRows):
        cols = {k: v[idx] for k, v in options.columns.items()}
        return OptionRows(
            cols, [options.offload[i] for i in idx.tolist()], options.classes, options.times_s[idx], options.units[idx]
        )
    return [options[i] for i in idx.tolist()]


def rules_of(problem: SearchProblem, target: str) -> TargetRules:
    if target not in TARGETS:
        raise ValueError(f"unknown target '{target}'; targets: {', '.join(TARGETS)}")
    return {"verl": _verl, "openrlhf": _openrlhf, "megatron": _megatron}[target](problem)


def apply_target(problem: SearchProblem, target: str) -> SearchProblem:
    """``problem`` with only what ``target`` runs as written: its candidates, groupings and ties
    (in place; returned for convenience)."""
    rules = rules_of(problem, target)
    for ms, sp in problem.spaces.items():
        sp.options = _subset(sp.options, np.flatnonzero(rules.keep[ms]))
    if rules.partitions is not None:
        problem.partitions = {st: [problem.partitions[st][i] for i in rules.partitions[st]] for st, _ in problem.stages}
    problem.constraints = rules.constraints
    return problem


def unavailable_reason(cluster, target: str) -> str | None:
    """Why ``target`` cannot run on ``cluster`` at all, or None."""
    if target == "verl" and cluster.unavailable:
        return (
            "verl's resource pool takes every GPU of its nodes (trainer.nnodes x trainer.n_gpus_per_node); "
            "the cluster has unavailable GPUs"
        )
    return None


# --------------------------------------------------------------- as run by
def _layers(m: Module, model: str, pp: int) -> list[tuple[int, int]]:
    n = m.models[model].layers
    return [(lo, hi - 1) for lo, hi in (even_split(n, pp, r) for r in range(pp))]


def _fresh(lay: Layout, **kw) -> Layout:
    """``lay`` with ``kw`` changed and its estimates dropped. Its expert carving is kept where the
    new sizes can still carve it (EP x ETP dividing dp x cp x tp, ETP dividing TP), else dropped:
    the framework then runs the experts split as TP splits a dense MLP."""
    out = replace(lay, **kw, time=None, memory=None, time_breakdown=None, memory_breakdown=None, runner_up=None)
    if out.carves_experts and (out.tp % out.expert_tp or (out.replicas * out.tp) % (out.ep * out.expert_tp)):
        out = replace(out, ep=1, etp=None)
    return out


def as_run_by(m: Module, plan: Plan, target: str) -> Plan:
    """``plan`` as ``target`` runs the settings ``nereus export`` writes for it (no estimates;
    ``estimate`` it). Raises ValueError where the framework cannot run it at all (sizes that do
    not divide its GPUs)."""
    w, c = m.workloads[plan.workload], m.clusters[plan.cluster]
    kinds = {ms: st.kind for st in w.stages for ms in st.model_stages()}
    role = roles(m.models, w)
    lays = plan.layouts
    trains = [ms for ms, k in kinds.items() if k == "train"]
    actor_train = next((ms for ms in trains if role[lays[ms].model] == "actor"), trains[0] if trains else None)
    out: dict[str, Layout] = {}
    colocate = [list(g) for g in plan.colocate]
    if target == "verl":
        gpus = c.available_gpus()
        n = len(gpus)
        megatron = any(lays[ms].tp > 1 or lays[ms].pp > 1 for ms in trains)  # the export's choice of workers
        src = lays[actor_train] if actor_train else None
        offload_ok = c.host_link is not None and c.host_memory is not None
        for ms, lay in lays.items():
            k = kinds[ms]
            if k == "generate":
                tp = lay.tp if n % lay.tp == 0 else math.gcd(lay.tp, n)
                out[ms] = _fresh(
                    lay,
                    tp=tp,
                    pp=1,
                    cp=1,
                    vpp=1,
                    dp=n // tp,
                    mesh=list(gpus),
                    micro_batches=1,
                    layers=_layers(m, lay.model, 1),
                )
                continue
            tp, pp, vpp = (src.tp, src.pp, src.vpp) if megatron and src else (1, 1, 1)
            # an inference pass runs on its role's engine, with the actor's transformer config
            # (verl's ref defaults to the actor's overrides): its pipeline sends as the actor's
            overlap = src.pp_overlap if megatron and src and k != "train" else lay.pp_overlap
            cp = src.cp if src else 1
            if n % (tp * pp * cp):
                raise ValueError(f"{ms}: tp {tp} x pp {pp} x cp {cp} does not divide verl's {n} GPUs")
            dp = n // (tp * pp * cp)
            zero = 0
            if k == "train" and dp * cp > 1:
                zero = (1 if lay.zero >= 1 else 0) if megatron else (2 if lay.zero == 2 else 3)
            off = [o for o in lay.offload if k != "train" or o != "grads"]
            if role[lay.model] == "ref" and not megatron and offload_ok and "weights" not in off:
                off = ["weights"] + off
            mb = max(flush_samples(w, k) // dp // w.micro_batch, 1) if pp > 1 else 1
            out[ms] = _fresh(
                lay,
                tp=tp,
                pp=pp,
                vpp=vpp,
                cp=cp,
                dp=dp,
                mesh=list(gpus),
                layers=_layers(m, lay.model, pp),
                micro_batches=mb,
                zero=zero,
                sp=tp > 1,
                offload=off,
                pp_overlap=overlap,
            )
        colocate = [st.model_stages() for st in w.stages if len(st.model_stages()) > 1]
    elif target == "openrlhf":
        tp_ds = lays[actor_train].tp if actor_train else 1  # ds.tensor_parallel_size, one for all
        zero_ds = lays[actor_train].zero if actor_train else 0  # ds.zero_stage, one for all
        home = {}  # model -> the mesh of its RayActorGroup (its training layout's, else its first)
        for ms, lay in lays.items():
            if kinds[ms] != "generate" and (lay.model not in home or kinds[ms] == "train"):
                home[lay.model] = lay.mesh
        for ms, lay in lays.items():
            mesh = lay.mesh if kinds[ms] == "generate" else home[lay.model]
            tp = lay.tp if kinds[ms] == "generate" else tp_ds
            if len(mesh) % tp:
                raise ValueError(f"{ms}: tp {tp} does not divide its {len(mesh)} GPUs")
            zero = zero_ds if kinds[ms] == "train" and len(mesh) // tp > 1 else 0
            off = list(lay.offload)
            if kinds[ms] == "train":
                off = [o for o in off if o == "optimizer"]
            elif kinds[ms] == "infer" and m.models[lay.model].trained:
                off = []
            out[ms] = _fresh(
                lay,
                tp=tp,
                pp=1,
                vpp=1,
                cp=1,
                dp=len(mesh) // tp,
                mesh=list(mesh),
                layers=_layers(m, lay.model, 1),
                micro_batches=1,
                zero=zero,
                sp=tp > 1 and kinds[ms] != "generate",
                offload=off,
            )
        colocate = []
        for st in w.stages:
            by_mesh: dict[tuple[int, ...], list[str]] = {}
            for ms in st.model_stages():
                by_mesh.setdefault(tuple(out[ms].mesh), []).append(ms)
            colocate += [g for g in by_mesh.values() if len(g) > 1]
    elif target == "megatron":
        for ms, lay in lays.items():
            if kinds[ms] != "train":
                out[ms] = _fresh(lay)
                continue
            mb = max(flush_samples(w, "train") // lay.dp // w.micro_batch, 1) if lay.pp > 1 else lay.micro_batches
            out[ms] = _fresh(
                lay,
                zero=max(lay.zero, 1) if lay.replicas > 1 else lay.zero,
                micro_batches=mb,
                offload=[],
            )
    else:
        raise ValueError(f"unknown target '{target}'; targets: {', '.join(TARGETS)}")
    # every target runs Megatron's schedules (or none); TP overlap only Megatron's workers, under SP;
    # pipeline sends as Megatron runs them (overlapped in the interleaved schedule unless turned
    # off); DP overlap as asked, but under FSDP (verl's other workers), which always overlaps
    overlaps = target in ("megatron", "verl")
    fsdp = target == "verl" and not any(lays[ms].tp > 1 or lays[ms].pp > 1 for ms in trains)  # the export's choice
    out = {
        ms: replace(
            lay,
            schedule=None,
            tp_overlap=overlaps and lay.tp_overlap and lay.sp and lay.tp > 1,
            pp_overlap=lay.pp_overlap if overlaps and lay.vpp > 1 else None,
            dp_overlap=lay.dp_overlap or fsdp,
            attention=lay.attention if target == "megatron" else "flash",  # verl's workers: flash attention
        )
        for ms, lay in out.items()
    }
    return replace(
        plan,
        name=f"{plan.name}_as_run_by_{target}",
        layouts=out,
        colocate=colocate,
        step_time=None,
        search=None,
        remap=None,
    )


def run_report(m: Module, plan: Plan, target: str) -> tuple[list[str], list[str]]:
    """What ``target`` really runs of ``plan`` (``as_run_by``), estimated: (comment lines with
    its step time and peak memory beside the plan's, warnings where they differ: a different
    step time, a layout over GPU memory or over the headroom the plan was searched with)."""
    from ...ir import DiagnosticError
    from ...ir import Module as Mod
    from ..infra.pass_manager import run_pipeline
    from .space import DEFAULT_HEADROOM

    name = {"verl": "verl", "openrlhf": "OpenRLHF", "megatron": "Megatron-LM"}[target]
    try:
        run = as_run_by(m, plan, target)
    except ValueError as e:
        return [], [f"{name} cannot run this plan as exported: {e}"]
    mine = _fresh_plan(plan)
    copy = Mod(clusters=m.clusters, models=m.models, workloads=m.workloads, plans={mine.name: mine, run.name: run})
    copy.filename = m.filename
    try:
        run_pipeline(copy, "estimate{oom=warn}", verify="end")
    except DiagnosticError as e:
        return [], [f"{name} would run this plan as {run.name}, which does not verify: {e.diagnostics[0].message}"]
    c = m.clusters[plan.cluster]
    searched = plan.search.headroom if plan.search is not None else None
    headroom = DEFAULT_HEADROOM if searched is None else searched
    kinds = {ms: st.kind for st in m.workloads[plan.workload].stages for ms in st.model_stages()}
    gib = lambda b: f"{b / 2**30:.1f} GiB"

    def peak(p: Plan) -> tuple[str, int]:
        ms = max(p.layouts, key=lambda k: p.layouts[k].memory or 0)
        return ms, p.layouts[ms].memory or 0

    if run.step_time is None:  # a model-stage cannot run at all there (one sequence's KV cache does not fit)
        why = next((d.message for d in copy.warnings), "a model-stage has no finite time")
        return [], [f"{name} would run this plan as {run.name}, which cannot run: {why}"]
    if mine.step_time is None:
        why = next((d.message for d in copy.warnings), "a model-stage has no finite time")
        return [], [f"the plan as exported cannot run: {why}"]
    (pm, pb), (rm, rb) = peak(mine), peak(run)
    lines = [
        f"as {name} runs these settings: step {run.step_time:.1f} s, peak {gib(rb)} per GPU on {rm} "
        f"(the plan as exported: {mine.step_time:.1f} s, {gib(pb)} on {pm})"
    ]
    from ...ir.attributes import compress_ints

    for ms, lay in run.layouts.items():
        a = mine.layouts[ms]
        if (a.tp, a.pp, a.dp, a.cp, a.zero, sorted(a.mesh), sorted(a.offload)) != (
            lay.tp,
            lay.pp,
            lay.dp,
            lay.cp,
            lay.zero,
            sorted(lay.mesh),
            sorted(lay.offload),
        ):
            lines.append(
                f"  {ms} runs as tp {lay.tp} x pp {lay.pp} x dp {lay.dp}, zero {lay.zero}, offload "
                f"[{', '.join(lay.offload)}] on GPUs {compress_ints(sorted(lay.mesh))}: {lay.time or 0:.2f} s, "
                f"{gib(lay.memory or 0)} (planned {a.time or 0:.2f} s, {gib(a.memory or 0)})"
            )
    warnings = []
    if abs(run.step_time - mine.step_time) > 1e-3 * mine.step_time:
        warnings.append(
            f"{name} runs this plan in {run.step_time:.1f} s per step, not the {mine.step_time:.1f} s planned "
            f"({(run.step_time - mine.step_time) / mine.step_time:+.1%}); plan-search{{target={target}}} "
            f"searches inside {name}'s rules"
        )
    for ms, lay in run.layouts.items():
        limit = c.gpu_memory * (1 if kinds[ms] == "generate" else 1 - headroom)
        if (lay.memory or 0) > limit:
            what = (
                "the GPU's memory"
                if kinds[ms] == "generate" or not headroom
                else (f"the {gib(limit)} plan-search leaves (headroom {headroom:g} of {gib(c.gpu_memory)})")
            )
            warnings.append(f"as {name} runs it, {ms} needs {gib(lay.memory or 0)} per GPU, over {what}")
    warnings += [d.message for d in copy.warnings]
    return lines, list(dict.fromkeys(warnings))


def _fresh_plan(plan: Plan) -> Plan:
    return replace(plan, layouts={ms: _fresh(lay) for ms, lay in plan.layouts.items()}, step_time=None)
