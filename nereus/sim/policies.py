"""The policies ``nereus simulate`` runs side by side, each the best of its kind.

Every plan a policy starts from is found by ``plan-search``'s own solver over the whole job,
restricted to what that kind of system can run (``search``'s ``keep``):

- ``fixed`` (the paper's baseline): the best plan for step 0; when the GPUs change, or the plan
  stops fitting, the best plan with every model-stage's TP and PP kept, i.e. only DP (and
  micro-batching, ZeRO, placement) rescaled. A move is a restart from a checkpoint. When no plan
  with its TP/PP fits (responses outgrew them), it restarts with the best new TP/PP, as its user
  would, and keeps those; so do the next two.
- ``fixed-dp`` (the paper's baseline as its words read, "the initial fixed TP/PP layout with DP
  scaling"): as ``fixed``, and every model-stage also keeps its virtual stages; its memory knobs
  (recomputation, ZeRO, offload) are re-tuned at every restart, as its user would (``FixedDp``).
- ``verl``: every model-stage on all available GPUs (or the most its TP/PP can use; one colocated
  pool, run in turn), TP/PP fixed
  after step 0; the actor's weights all-gathered for generation every step; restarts as ``fixed``.
- ``openrlhf``: a separate pool per model (the generation engines' own), the split chosen at step 0
  among a few generation shares, each pool's layouts searched on its GPUs; weights gathered to
  rank 0 and broadcast every step; restarts as ``fixed``.
- ``nereus``: the live controller's decision core (``nereus.control.DecisionCore``) fed the
  simulated measurements: it recalibrates online, re-plans on its triggers and moves only when
  admission says it pays (or must); a move is a live transition (its scheduled makespan).
- ``oracle``: re-plans at every change of conditions knowing the truth, and moves for free: with
  the true coefficients (formula truth), or with the cost model fitted to the truth's exact times
  and the truth judging between the found plan and its incumbent (event truths; ``Oracle``).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from dataclasses import dataclass

import numpy as np

from ..control import ControlOptions, DecisionCore, StepRecord
from ..ir import DiagnosticError, Module, Plan
from ..ir import verify as verify_module
from ..ir.cluster import Efficiency
from ..passes import run_pipeline
from ..passes.cost.calibrate import calibrate_records
from ..passes.cost.estimate import Estimate
from ..passes.search.plan_search import PlanSearch
from ..passes.search.space import DEFAULT_HEADROOM, columns
from . import POLICY_NAMES
from .simulated_cluster import ENGINE_RESTART, PG_INIT, RELOAD_BYTES_PER_S, Outcome, SimCluster, conditions
from .truth.step import seed_of

SEARCH_S = 10.0
# a restarting policy's user, after an out-of-memory crash, leaves more memory free (a smaller
# micro-batch, vLLM's gpu_memory_utilization lowered): each crash adds this much headroom
OOM_HEADROOM_STEP, MAX_HEADROOM = 0.1, 0.5


class NoPlan(RuntimeError):
    pass


def search(
    m: Module,
    keep=None,
    name: str = "p",
    time_limit: float = SEARCH_S,
    headroom: float = DEFAULT_HEADROOM,
    incumbent: Plan | None = None,
    verify: str = "end",
) -> Plan:
    """The best plan of ``m``'s job on its available GPUs among the options ``keep(ms, options,
    n)`` returns of each model-stage's (``plan-search{keep=...}``, keeping plan-search's memory
    ``headroom`` free as a real system would), estimated in ``m``. ``incumbent``: the plan the
    policy runs, where the search may start from it (``plan-search{incumbent=@...}``).

    The module is verified once, at the end (``verify="end"``), after the incumbent left it (it
    ran on GPUs that may be gone: it is the search's start, not a plan of ``m``): ``m`` holds
    the job and the plans only, no EMUs, and a restarting policy searches at every change."""
    given = ""
    if incumbent is not None:
        given = f"{name}_incumbent"
        m.plans[given] = dataclasses.replace(incumbent, name=given)
    try:
        run_pipeline(
            m,
            [
                PlanSearch(
                    time_limit=time_limit,
                    seed=0,
                    deterministic=True,  # every run of a trace decides the same, on a loaded machine too
                    into=f"@{name}",
                    headroom=headroom,
                    incumbent=f"@{given}" if given else "",
                    keep=keep,
                )
            ],
            verify_input=False,
            verify="off",
        )
    except DiagnosticError as e:
        raise NoPlan(e.diagnostics[0].message) from None
    finally:
        m.plans.pop(given, None)
    if verify == "end":
        verify_module(m)
    return m.plans.pop(name)


def rows(options, mask: np.ndarray) -> list:
    """The options where ``mask`` (one entry per option) holds. Made only for those: a search's
    ``OptionRows`` makes an option when first asked for, and a 1,024-GPU problem has tens of
    thousands per model-stage, of which a fixed layout keeps a few."""
    return [options[i] for i in np.flatnonzero(mask).tolist()]


def same_tp_pp(options, tp_pp: tuple[int, int]) -> list:
    """The options with these TP and PP."""
    c = columns(options)
    return rows(options, (c["tp"] == tp_pp[0]) & (c["pp"] == tp_pp[1]))


@dataclass
class Move:
    seconds: float = 0.0  # the transition or restart
    decide_s: float = 0.0  # time the policy spent deciding (wall, this machine)
    moved: bool = False


class Policy:
    name = ""
    sync = "p2p"
    start_s = 0.0  # wall seconds its start took (its first search)
    restarts_from_checkpoint = False  # a failed step crashes the job: it restarts from its last save

    def start(self, sim: SimCluster) -> None:
        raise NotImplementedError

    def react(self, sim: SimCluster, i: int) -> Move:
        """Before step ``i``: what the policy does with what it knows (the GPUs of step ``i``)."""
        return Move()

    def recover(self, sim: SimCluster, i: int, out: Outcome) -> Move:
        """Step ``i`` failed under the current plan: move to one that can run."""
        raise NotImplementedError

    def observe(self, sim: SimCluster, i: int, out: Outcome, factor: float) -> Move:
        """After step ``i`` (measured): a decision whose move is paid before step ``i + 1``."""
        return Move()


class Restarting(Policy):
    """A fixed-layout system: re-searched (TP/PP kept) when its GPUs change or it cannot run; each
    move a restart from a checkpoint (saved first when the change was announced). After an
    out-of-memory crash its searches keep more memory free (``OOM_HEADROOM_STEP``), as its user
    would: without that, a layout the cost model wrongly thinks fits crashed step after step."""

    restarts_from_checkpoint = True

    def __init__(self):
        self.plan: Plan | None = None
        self.tp_pp: dict[str, tuple[int, int]] = {}
        self.gpus: frozenset[int] = frozenset()
        self.headroom = DEFAULT_HEADROOM  # memory its searches keep free; grows after each out-of-memory

    def initial(self, sim: SimCluster, i: int = 0) -> Plan:
        """The best plan of this kind for step ``i``'s conditions, TP/PP free."""
        raise NotImplementedError

    def keep(self, ms, options, n) -> list:
        return same_tp_pp(options, self.tp_pp[ms])

    def start(self, sim: SimCluster) -> None:
        self.gpus = frozenset(sim.trace.available(0))
        self.adopt(self.initial(sim))

    @staticmethod
    def known(sim: SimCluster, i: int) -> frozenset[int]:
        """The GPUs the job knows it has before step ``i``, as Nereus's core knows them: those of
        the step before less the ones announced to leave after it. A GPU lost without notice is
        found by the step that fails on it (``recover``); one granted is seen after a step."""
        if i == 0:
            return frozenset(sim.trace.available(0))
        return frozenset(sim.trace.available(i - 1)) - sim.trace.steps[i - 1].leaving

    def view(self, sim: SimCluster, i: int):
        """A copy of the job at step ``i`` on the GPUs this policy knows of (``self.gpus``)."""
        m = copy.deepcopy(sim.module_at(i))
        for c in m.clusters.values():
            c.unavailable = sorted(set(range(c.nodes * c.gpus_per_node)) - self.gpus)
        return m

    def adopt(self, plan: Plan) -> None:
        """Run ``plan`` from now on; what it keeps fixed is taken from it."""
        self.plan = plan
        self.tp_pp = {ms: (lay.tp, lay.pp) for ms, lay in plan.layouts.items()}

    def replan(self, sim: SimCluster, i: int) -> Plan:
        return search(self.view(sim, i), self.keep, f"{self.name}{i}", headroom=self.headroom, incumbent=self.plan)

    def _move(self, sim: SimCluster, i: int, gpus: frozenset[int] | None = None) -> Move:
        """A restart onto ``gpus`` (known before the step: a checkpoint is saved first), or onto
        the step's GPUs, which a failed attempt revealed (the crash left the last save)."""
        t0 = time.perf_counter()
        save = sim.save_seconds(self.plan) if gpus is not None else 0.0
        self.gpus = frozenset(sim.trace.available(i)) if gpus is None else gpus
        for headroom in dict.fromkeys((self.headroom, DEFAULT_HEADROOM)):  # at the default if nothing fits with more
            self.headroom = headroom
            try:
                self.adopt(self.replan(sim, i))
            except NoPlan:  # nothing fits with TP/PP kept: restart with new ones, as its user would
                try:
                    self.adopt(self.initial(sim, i))
                except NoPlan:
                    continue
            return Move(save + sim.reload_seconds(self.plan), time.perf_counter() - t0, True)
        return Move(0.0, time.perf_counter() - t0)

    def react(self, sim, i):
        known = self.known(sim, i)
        if known != self.gpus:
            return self._move(sim, i, known)
        return Move()

    def recover(self, sim, i, out):
        if out.failure == "out of memory":  # as its user would: more memory left free from now on
            self.headroom = min(self.headroom + OOM_HEADROOM_STEP, MAX_HEADROOM)
        return self._move(sim, i)


class Fixed(Restarting):
    name = "fixed"

    def initial(self, sim, i=0):
        return search(self.view(sim, i), None, f"fixed{i}", headroom=self.headroom)


class FixedDp(Fixed):
    """The paper's baseline as its words read ("the initial fixed TP/PP layout with DP scaling"),
    run as its user would: every model-stage keeps its step-0 TP, PP and virtual stages; at every
    restart DP follows the GPUs and the memory knobs (recomputation, ZeRO stage, offload) and the
    micro-batching and placement are re-tuned for the new GPUs. When nothing fits with those
    kept, its user changes TP/PP too (``Restarting.replan``, as ``fixed``). It differs from
    ``fixed`` only in keeping the virtual stages."""

    name = "fixed-dp"

    def adopt(self, plan):
        super().adopt(plan)
        self.vpp = {ms: lay.vpp for ms, lay in plan.layouts.items()}

    def keep(self, ms, options, n):
        c = columns(options)
        tp, pp = self.tp_pp[ms]
        return rows(options, (c["tp"] == tp) & (c["pp"] == pp) & (c["vpp"] == self.vpp[ms]))

    def replan(self, sim, i):
        try:
            return super().replan(sim, i)
        except NoPlan:
            kept = lambda ms, o, n: Restarting.keep(self, ms, o, n)  # noqa: E731
            return search(self.view(sim, i), kept, f"{self.name}{i}", headroom=self.headroom)


class Verl(Restarting):
    name, sync = "verl", "megatron"

    @staticmethod
    def widest(options: list) -> list:
        """The options on the most GPUs there are options for: all of them, or the most a layout
        of these shapes can use (as verl runs on the GPUs its TP/PP divide)."""
        gpus = columns(options)["gpus"]
        return rows(options, gpus == gpus.max()) if len(gpus) else []

    def initial(self, sim, i=0):
        return search(self.view(sim, i), lambda ms, opts, n: self.widest(opts), f"verl{i}", headroom=self.headroom)

    def keep(self, ms, options, n):
        return self.widest(same_tp_pp(options, self.tp_pp[ms]))


class OpenRLHF(Restarting):
    """Pools: the generation engines, then one per model for its other stages."""

    name, sync = "openrlhf", "broadcast"
    GEN_SHARES = (0.25, 0.375, 0.5)

    def pools(self, m: Module) -> list[list[str]]:
        (w,) = m.workloads.values()
        gen = [ms for st in w.stages if st.kind == "generate" for ms in st.model_stages()]
        rest: dict[str, list[str]] = {}
        for st in w.stages:
            if st.kind != "generate":
                for ms in st.model_stages():
                    rest.setdefault(ms.rpartition(".")[0], []).append(ms)
        return [gen] + list(rest.values())

    def split(self, m: Module, gen_share: float) -> list[list[int]]:
        """GPUs per pool, whole nodes where it can: the generation share, the rest by each pool's
        work (a trained model's stages count 4: forward, and training's three passes)."""
        (c,) = m.clusters.values()
        gpus = c.available_gpus()
        pools = self.pools(m)
        weight = [sum(4 if ms.endswith(".train") else 1 for ms in p) for p in pools[1:]]
        per = c.gpus_per_node if len(gpus) >= c.gpus_per_node * len(pools) else 1
        units = len(gpus) // per
        counts = [max(1, round(units * gen_share))]
        left = units - counts[0]
        shares = [max(1, math.floor(left * x / sum(weight))) for x in weight]
        shares[0] += left - sum(shares)
        counts += shares
        out, at = [], 0
        for k in counts:
            out.append(gpus[at * per : (at + k) * per])
            at += k
        return out

    def pooled(self, m: Module, gen_share: float, name: str, fixed: bool) -> Plan:
        (w,) = m.workloads.values()
        (c,) = m.clusters.values()
        layouts, colocate = {}, []
        for pool, ids in zip(self.pools(m), self.split(m, gen_share)):
            sub = copy.deepcopy(m)
            sw, sc = sub.workloads[w.name], sub.clusters[c.name]
            sc.unavailable = sorted(set(range(sc.nodes * sc.gpus_per_node)) - set(ids))
            sw.stages = [copy.copy(st) for st in sw.stages if any(ms in pool for ms in st.model_stages())]
            for st in sw.stages:
                st.models = [x for x in st.models if f"{x}.{st.name}" in pool]
            keep = (lambda ms, opts, n: same_tp_pp(opts, self.tp_pp[ms])) if fixed else None
            # a pool's part of the job is no job the verifier accepts (PPO without its critic's
            # stages): the pool's plan is not verified alone; the pooled plan is, below
            p = search(sub, keep, name, headroom=self.headroom, verify="off")
            layouts.update(p.layouts)
            colocate += p.colocate
        order = [ms for st in w.stages for ms in st.model_stages()]
        m.plans[name] = Plan(
            name=name, workload=w.name, cluster=c.name, colocate=colocate, layouts={ms: layouts[ms] for ms in order}
        )
        try:
            run_pipeline(m, [Estimate(plan=f"@{name}")], verify_input=False, verify="end")
        except DiagnosticError:
            raise NoPlan("the pooled plan does not fit") from None
        finally:
            plan = m.plans.pop(name)
        return plan

    def initial(self, sim, i=0):
        m = self.view(sim, i)
        best = None
        for share in self.GEN_SHARES:
            try:
                plan = self.pooled(m, share, f"openrlhf{i}", False)
            except NoPlan:
                continue
            if best is None or plan.step_time < best[0].step_time:
                best = (plan, share)
        if best is None:
            raise NoPlan("no pool split fits")
        self.share = best[1]
        return best[0]

    def replan(self, sim, i):
        return self.pooled(self.view(sim, i), self.share, f"openrlhf{i}", True)


class Nereus(Policy):
    """The decision core of ``nereus.control``, as the live Controller runs it."""

    name = "nereus"

    VERIFY_GPUS = 64  # up to this many GPUs the core verifies each move it plans (``verify="end"``)

    def __init__(self, options: ControlOptions | None = None, start_plan: Plan | None = None):
        self.options = options
        self.start_plan = start_plan
        self.pending = Move()
        self.example: tuple | None = None  # (step, gantt rows) of the first transition

    def start(self, sim):
        m = copy.deepcopy(sim.module_at(0))
        if self.options is None:
            # the core as the live controller runs it, except two things. Its solves are bounded by
            # CP-SAT's deterministic time, not the clock: a solve that stopped at a wall-clock limit
            # stopped elsewhere on a loaded machine, and two runs of one trace moved other bytes
            # (a replayed move and the worker-process runs differed under a parallel test suite).
            # And verification on large jobs: at
            # 1,024 GPUs one verification of a planned move (plans A and B, a million slices,
            # half a million operations) costs more than planning it (11.5 s against 7 s on
            # availability's first move), and the simulator never runs its moves; the small jobs
            # the tests simulate verify every move the core plans
            (c,) = m.clusters.values()
            small = c.nodes * c.gpus_per_node <= self.VERIFY_GPUS
            self.options = ControlOptions(
                search_time_limit=5.0,
                schedule_time_limit=0.5,
                deterministic=True,
                verify="end" if small else "off",
            )
        plan = copy.deepcopy(self.start_plan) if self.start_plan is not None else search(m, None, "p0")
        plan.name = "p0"
        m.plans["p0"] = plan
        self.core = DecisionCore(m, "p0", self.options, total_steps=len(sim.trace.steps))
        # the job keeps checkpoints, as the restarting policies' reloads assume: what only failed
        # GPUs held is read back from the last one (the move plans it as ``restored`` bytes)
        self.core.checkpoint = ("checkpoint", 0)
        self.plan = self.core.m.plans[self.core.plan]
        self.last_seconds: dict[str, float] = {}

    def _record(self, sim, i, out: Outcome | None, factor: float) -> StepRecord:
        s = sim.trace.steps[i]
        w = sim.workload
        seconds = dict(self.last_seconds)
        memory: dict[str, int] = {}
        if out and out.seconds:
            seconds, memory = measured(self.plan, out, factor, seed_of("measure", sim.seed, i))
        n = w.samples
        return StepRecord(
            step=i,
            seconds=seconds or {"_": 1.0},
            memory=memory,
            responses=(n, n * s.response_len_mean, max(s.response_len_dist)),
            length_shares=s.response_len_dist,
            gpus=tuple(sim.trace.available(i)),
            leaving=tuple(sorted(s.leaving)),
        )

    def _decide(self, sim, i, record: StepRecord) -> Move:
        t0 = time.perf_counter()
        self.core.observe(record)
        d = self.core.decide()
        if d.action != "transition":
            return Move(0.0, time.perf_counter() - t0)
        n = d.numbers
        prior_nic = (self.core.m.clusters[self.core.m.plans[self.core.plan].cluster].efficiency or Efficiency()).nic
        cost = float(n.get("cost") or (n.get("makespan", 0.0) + PG_INIT + ENGINE_RESTART))
        cost += float(n.get("makespan", 0.0)) * (prior_nic / sim.nic_efficiency - 1)  # the true links are slower
        if n.get("restored"):  # read back as a restart reads: each lost GPU's share by one GPU
            a = self.core.m.plans[self.core.plan]
            lost = {g for lay in a.layouts.values() for g in lay.mesh} - set(sim.trace.available(i))
            cost += float(n["restored"]) / max(1, len(lost)) / RELOAD_BYTES_PER_S
        if self.example is None:  # one transition's transfer schedule, for the Gantt chart
            self.example = (i, gantt_rows(d.module, d.module.transitions[d.transition]))
        self.core.commit(d)
        self.plan = self.core.m.plans[self.core.plan]
        return Move(cost, time.perf_counter() - t0, True)

    def react(self, sim, i):
        move, self.pending = self.pending, Move()
        return move

    def observe(self, sim, i, out, factor):
        record = self._record(sim, i, out, factor)
        if out.seconds:
            self.last_seconds = dict(record.seconds)
        self.pending = self._decide(sim, i, record)
        return Move()

    def recover(self, sim, i, out):
        # the failed step is what the core measures: the GPUs it lost, or a memory peak at the limit
        record = self._record(sim, i, None if out.failure == "GPUs gone" else out, 1.0)
        return self._decide(sim, i, record)


# sigma of the log-normal noise of one rank's timer, per model-stage and step: a stage's ranks end
# together at its last collective, so they time the same span up to their skew (an assumption)
RANK_NOISE = 0.005
RANK_MEMORY_NOISE = 0.01  # how far under the fullest GPU's peak another rank's is (log-normal, one-sided)


def measured(plan: Plan, out: Outcome, factor: float, seed: int) -> tuple[dict[str, float], dict[str, int]]:
    """What the live Controller measures of a step: every rank of a model-stage times it and reads
    its peak memory, each with its own noise, and the stage takes its slowest rank's time and
    largest peak (``Controller._record``). A rank's peak is at most the fullest GPU's, which the
    truth gives (a peak above it would not have run). ``factor``: the step's noise, which every
    rank shares."""
    rng = np.random.default_rng(seed)
    seconds, memory = {}, {}
    for ms, t in out.seconds.items():
        if not t:
            continue
        ranks = len(plan.layouts[ms].mesh) if ms in plan.layouts else 1
        seconds[ms] = t * factor * float(np.exp(rng.normal(0.0, RANK_NOISE, ranks)).max())
        b = out.memory.get(ms)
        if b and math.isfinite(b):  # every rank at or under the fullest (what ran fitted), the peak taken
            memory[ms] = int(b * float(np.exp(-np.abs(rng.normal(0.0, RANK_MEMORY_NOISE, ranks))).max()))
    return seconds, memory


ORACLE_HEADROOMS = (0.15, 0.3, 0.45)  # the event oracle's retries where no plan it found runs


class Oracle(Policy):
    """Knows the truth; re-plans whenever the conditions change; moves for free.

    Under the formula truth it searches with the true coefficients, memory included (so it keeps
    no headroom): its plan is plan-search's optimum in truth. The event truth has no coefficients
    to search with, so there, at each change of conditions, it fits the cost model to the truth's
    exact times of the plan it runs (``calibrate``, no noise), searches with that fit, and runs
    whichever of the found plan and its incumbent the truth says is faster. That is the best the
    search can find knowing the truth, not a proven optimum: a plan outside what the fitted model
    ranks first is never tried."""

    name = "oracle"

    def start(self, sim):
        self.cache: dict[tuple, Plan] = {}
        self.plan: Plan | None = None
        self.plan = self._best(sim, 0)

    def _best(self, sim, i) -> Plan:
        key = conditions(sim.trace.steps[i])
        if key not in self.cache:
            self.cache[key] = self._formula(sim, i) if sim.events is None else self._event(sim, i)
        return self.cache[key]

    def _formula(self, sim, i) -> Plan:
        # the truth's memory is exact, so the oracle needs no headroom: its plan is the fastest that runs
        m = copy.deepcopy(sim.module_at(i, truth=True))
        return search(m, None, f"oracle{i}", headroom=0.0, incumbent=self.plan)

    def _event(self, sim, i) -> Plan:
        m = copy.deepcopy(sim.module_at(i))
        runs = [] if self.plan is None else [self.plan]
        if self.plan is None:  # step 0: the priors' plan is the first to learn from
            runs.append(search(copy.deepcopy(m), None, f"oracle{i}a"))
        fitted = {}
        for k, plan in enumerate(runs):
            out = sim.evaluate(plan, i)
            if out.seconds and not out.failure:
                fitted[f"seen{k}"] = (plan, out)
        if fitted:
            for name, (plan, _) in fitted.items():
                m.plans[name] = dataclasses.replace(
                    copy.deepcopy(plan), name=name, workload=sim.workload.name, cluster=sim.cluster.name
                )
            records = [(n, ms, t, None, 0) for n, (_, out) in fitted.items() for ms, t in out.seconds.items() if t]
            calibrate_records(m, records)
            for name in fitted:
                del m.plans[name]
        # the search keeps plan-search's memory headroom; where the truth allocates more than the
        # fitted model thinks even so, more headroom, until a plan runs
        for headroom in (DEFAULT_HEADROOM, *ORACLE_HEADROOMS):
            try:
                runs.append(search(copy.deepcopy(m), None, f"oracle{i}", headroom=headroom, incumbent=self.plan))
            except NoPlan:
                pass
            outs = [sim.evaluate(p, i) for p in runs]
            ok = [(out.step_time, k) for k, out in enumerate(outs) if not out.failure]
            if ok:
                return runs[min(ok)[1]]
        raise NoPlan("no plan the oracle found runs in truth")

    def react(self, sim, i):
        t0 = time.perf_counter()
        before = self.plan
        try:
            self.plan = self._best(sim, i)
        except NoPlan:
            pass
        return Move(0.0, time.perf_counter() - t0, self.plan is not before)

    def recover(self, sim, i, out):
        return Move()


def gantt_rows(m: Module, t) -> list[tuple[int, float, float, str]]:
    """(receiving GPU, start s, duration s, kind) of every scheduled operation of transition ``t``:
    its destinations' GPUs, or its sources' where it writes none. A reference names a shard of
    the plan its kind says (a load writes plan A's shards, an offload reads plan B's)."""
    rows = []
    for op in t.ops:
        if op.start is None or op.duration is None:
            continue
        kind = op.spec
        if op.dst:
            refs, plan = op.dst, t.source if kind.destination_plan == "source" else t.target
        else:
            refs, plan = op.src, t.target if kind.source_plan == "target" else t.source
        for ref in refs:
            gpu = ref.gpu if hasattr(ref, "gpu") else m.emus[(plan, ref.model_stage, ref.dp)].shard(ref.pp, ref.tp).gpu
            rows.append((gpu, op.start, op.duration, op.kind))
    return rows


POLICIES = {"fixed": Fixed, "fixed-dp": FixedDp, "verl": Verl, "openrlhf": OpenRLHF, "nereus": Nereus, "oracle": Oracle}
assert tuple(POLICIES) == POLICY_NAMES
