"""The decision: re-plan when a trigger fires, and move only when it pays (or must).

``DecisionCore.decide()`` after each step (``check()``: steps 1-2, then ``replan()``: 3-4):

1. at the first step and every ``recalibrate_every`` steps, refit the cost model's coefficients
   to the stage times and memory peaks of the last ``window`` steps (``calibrate``: the peaks set
   ``memory_slack``) and re-estimate the current plan; when a memory trigger fires between
   those steps, refit then too, so that the re-plan weighs plans at the slack of the peak that fired;
2. check the triggers (``triggers.py``); none: ``stay``, at the cost of a few comparisons. A GPU
   change that a re-plan already weighed and rejected fires again only when the GPUs change again
   (or when it forces a move); a length drift weighed and rejected, when the lengths drift again
   from those weighed; a memory peak weighed and kept, past half the way from it to the GPU's
   memory;
3. otherwise re-plan on a copy of the job under the conditions measured now (the GPUs that are
   left, the response lengths of the window): ``plan-search`` for plan B on those GPUs (from
   the running plan where it is still a plan of them: as plan-search gave it, before remap
   renamed its GPUs), ``remap`` (plan B's GPUs renamed to keep the most state in place),
   ``plan-transition`` (GPUs announced to leave still send; GPUs that are gone hold nothing),
   ``schedule-transfers`` and ``admit`` over the remaining steps. A plan B whose saving cannot
   pay even the move's fixed costs (process groups, engine restart) is rejected right after the
   search;
4. ``transition`` when admitted or forced (the current plan uses GPUs that are gone or leaving,
   or does not fit any more), else ``stay``; ``infeasible`` when a forced move finds no plan.

The runtime applies a ``transition`` decision (lowers ``decision.module``'s transition and runs
it) and then calls ``commit(decision)``; the core then runs under plan B.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import cast

import numpy as np

from ..ir import Diagnostic, DiagnosticError, Module, Plan, Stage, bare_name
from ..ir.attributes import compress_ints
from ..ir.diagnostics import plural
from ..ir.verifier import replicas_share_steps
from ..passes import ModulePass, run_pipeline
from ..passes.cost.calibrate import Calibrate
from ..passes.cost.estimate import Estimate
from ..passes.schedule.schedule_transfers import ScheduleTransfers
from ..passes.search.plan_search import PlanSearch
from ..passes.search.space import DEFAULT_HEADROOM, columns
from ..passes.transition.admit import Admit, fixed_costs
from ..passes.transition.derive_emus import DeriveEmus
from ..passes.transition.plan_transition import PlanTransition
from ..passes.transition.remap import Remap
from .measurements import StepRecord
from .options import ControlOptions
from .triggers import Trigger, gpu_triggers, measured_triggers

ACTIONS = ("stay", "transition", "infeasible")


@dataclass
class Decision:
    """What to do after ``step``, and why. ``numbers`` holds every figure behind it (seconds,
    bytes); ``module`` (not logged) is the job with plans A and B and the transition between them
    when the core re-planned, until ``DecisionCore.commit`` takes it over (the decision history
    then keeps no job alive: at 1,024 GPUs each is a plan's every slice)."""

    step: int
    action: str
    source: str
    target: str | None = None
    transition: str | None = None
    forced: bool = False
    triggers: list[Trigger] = field(default_factory=list)
    numbers: dict = field(default_factory=dict)
    message: str = ""
    module: Module | None = field(default=None, repr=False)
    searched: Plan | None = field(default=None, repr=False)  # plan B as plan-search gave it, before remap

    def to_json(self) -> dict:
        return {
            "step": self.step,
            "action": self.action,
            "source": self.source,
            "target": self.target,
            "transition": self.transition,
            "forced": self.forced,
            "triggers": [t.to_json() for t in self.triggers],
            "numbers": self.numbers,
            "message": self.message,
        }


class DecisionCore:
    """Measurements in, decisions out; see the module docstring."""

    def __init__(
        self,
        module: Module,
        plan: str,
        options: ControlOptions | None = None,
        total_steps: int | None = None,
        log: str | Path | None = None,
        keep: Callable | None = None,
    ):
        if options is not None and not isinstance(options, ControlOptions):
            raise TypeError(f"options must be a ControlOptions, got {type(options).__name__}")
        plan = bare_name(plan)
        self.keep = keep  # plan-search's option filter: the layouts the running job can take
        if plan not in module.plans:
            raise ValueError(f"no plan @{plan} in the module; its plans: {', '.join('@' + p for p in module.plans)}")
        self.options = options or ControlOptions()
        self.m = copy.deepcopy(module)
        self.plan = plan
        # the running plan as plan-search gave it, before remap renamed its GPUs (the same shapes,
        # time and memory): the next search starts from it where its runs of GPUs are still
        # available (``PlanSearch``'s incumbent); where remap renamed GPUs, the running plan's
        # meshes are not runs of the search's GPU order and no search could start from them.
        # None: the plan the core began with
        self.searched: Plan | None = None
        p = self.m.plans[plan]
        self.workload = self.m.workloads[p.workload]
        self.total_steps = total_steps if total_steps is not None else (self.workload.steps or 0)
        # the state the running plan holds, derived from its layouts once (a module may declare
        # only some of its EMUs, e.g. weights only; the live job holds all of its states)
        for key in [k for k in self.m.emus if k[0] == plan]:
            del self.m.emus[key]
        p.step_time = None
        self._run(self.m, [], verify_input=True)
        # what no longer fits the job as the module states it (``what_if`` weighs such a plan A
        # as forced to move; a live job's measured peaks are its memory trigger)
        self.unfit = self._estimate(self.m, plan)
        self._run(self.m, [DeriveEmus(plan=f"@{plan}", only_missing=True)])
        self.gpus_planned = set(self.m.clusters[p.cluster].available_gpus())
        self.gpus_now = set(self.gpus_planned)
        self.leaving: set[int] = set()
        self.planned_response = float(self.workload.response_len_mean)
        self.weighed_memory: dict[str, int] = {}  # model-stage -> the peak a re-plan weighed and kept plan A at
        self.peaks_fitted = False  # calibrate has set memory_slack from measured training or inference peaks
        self.history: list[StepRecord] = []
        self.last_replan = -(10**9)
        self.gpus_considered: tuple | None = None  # (GPUs, leaving) the last re-plan weighed
        # the job's last checkpoint (path, step), where it keeps one: what only failed GPUs held
        # is then read from it (``plan-transition`` ``restore``) instead of the move being infeasible
        self.checkpoint: tuple[str, int] | None = None
        self.log = Path(log) if log is not None else None
        self.decisions: list[Decision] = []
        self._pending = None  # what check() found for replan()
        self._asking = False  # in what_if()

    # -- inputs ----------------------------------------------------------------------------------
    def observe(self, record: StepRecord) -> None:
        if not isinstance(record, StepRecord):
            raise TypeError(f"observe takes a StepRecord, got {type(record).__name__}")
        self.history.append(record)
        if record.gpus is not None:
            self.gpus_now = set(record.gpus)
        self.leaving = set(record.leaving)

    # -- the decision ----------------------------------------------------------------------------
    def decide(self) -> Decision:
        """``check()``, then ``replan()`` when a trigger fired."""
        quiet = self.check()
        return quiet if quiet is not None else self.replan()

    def check(self) -> Decision | None:
        """Steps 1 and 2: recalibrate when due, then the triggers. None fired: the ``stay``
        decision (recorded). One or more fired: None, and ``replan()`` takes it from there.

        Deterministic in the observed records: every rank of a job that observed the same
        records gets the same answer, so the runtime runs it everywhere and needs no message
        for a stay; only ``replan`` (a time-limited search) runs on one rank."""
        if not self.history:
            raise ValueError("decide() needs at least one observed step")
        t0 = time.perf_counter()
        opts, step = self.options, self.history[-1].step
        window = self.history[-opts.window :]
        numbers: dict = {}
        if opts.recalibrate_every and ((step + 1) % opts.recalibrate_every == 0 or len(self.history) == 1):
            numbers.update(self._recalibrate(window))  # at the first step too: the priors are not the job
        plan = self.m.plans[self.plan]
        triggers = gpu_triggers(plan, self.gpus_now, self.gpus_planned, self.leaving)
        if (frozenset(self.gpus_now), frozenset(self.leaving)) == self.gpus_considered:
            # a GPU change already weighed (and rejected) does not fire again until the GPUs change again
            triggers = [t for t in triggers if t.forced]
        measured = measured_triggers(self.m, plan, window, self.planned_response, opts, self.weighed_memory)
        forced_measured = [t for t in measured if t.forced]
        if step - self.last_replan >= opts.cooldown:
            triggers += measured
        else:
            triggers += forced_measured
        if opts.recalibrate_every and "recalibrated" not in numbers and any(t.kind == "memory" for t in triggers):
            # the re-plan weighs plans by memory: fit the slack to the peak that fired (the fit's
            # times come along, from the same window)
            numbers.update(self._recalibrate(window))
        if not triggers:
            numbers["decide_s"] = round(time.perf_counter() - t0, 6)
            self._pending = None
            return self._record(Decision(step, "stay", self.plan, numbers=numbers))
        self._pending = (t0, step, window, triggers, numbers)
        return None

    def replan(self) -> Decision:
        """Steps 3 and 4, after a ``check()`` whose triggers fired."""
        if self._pending is None:
            raise ValueError("replan() follows a check() that found a trigger")
        t0, step, window, triggers, numbers = self._pending
        self._pending = None
        self.last_replan = step
        self.gpus_considered = (frozenset(self.gpus_now), frozenset(self.leaving))
        decision = self._replan(step, window, triggers, numbers)
        decision.numbers["decide_s"] = round(time.perf_counter() - t0, 4)
        return self._record(decision)

    def what_if(
        self, gpus: set[int] | None = None, leaving: set[int] | frozenset[int] = frozenset(), step: int = 0
    ) -> Decision:
        """Re-plan now, as a trigger would make it re-plan, for the job as the module states it
        with ``gpus`` available (None: as now) and ``leaving`` announced to leave: the answer to
        "what do I move to, and what does it cost" (``nereus replan``). GPUs of the running plan
        missing from ``gpus`` are gone with their state; a plan A that no longer fits is forced
        to move. ``step``: the steps done (the horizon is what is left of ``total_steps``)."""
        t0 = time.perf_counter()
        if gpus is not None:
            self.gpus_now = set(gpus)
        self.leaving = set(leaving)
        triggers = gpu_triggers(self.m.plans[self.plan], self.gpus_now, self.gpus_planned, self.leaving)
        triggers = triggers or [Trigger("what_if", "asked for a re-plan of the job as it is now")]
        self._pending = (t0, step, [], triggers, {})
        self._asking = True  # the decision keeps plan B and the transition to show, whatever it is
        try:
            return self.replan()
        finally:
            self._asking = False

    def failed(self, gone: set[int], step: int) -> None:
        """GPUs ``gone`` failed without notice during ``step`` (the runtime saw them die): set up
        the re-plan they force, as a ``check()`` whose triggers fired sets it up, so that the
        leader's ``replan()`` and the others' ``follow()`` take it from here. The decision plans
        from what the remaining GPUs hold (``gpus_lost``: their state comes from replicas)."""
        t0 = time.perf_counter()
        self.gpus_now = self.gpus_planned - set(gone)
        self.leaving = set()
        triggers = gpu_triggers(self.m.plans[self.plan], self.gpus_now, self.gpus_planned, self.leaving)
        self._pending = (t0, step, self.history[-self.options.window :], triggers, {})

    def follow(self, decision: Decision) -> None:
        """On a rank that did not re-plan (after a ``check()`` whose triggers fired): take the
        decision ``replan()`` made on another rank from the same records, and what it changed in
        the core (the step of the last re-plan, the GPUs, lengths and memory peaks it weighed), so that this
        rank's next ``check()`` gives the same answer as that rank's."""
        if self._pending is None:
            raise ValueError("follow() follows a check() that found a trigger")
        self._pending = None
        self.last_replan = decision.step
        self.gpus_considered = (frozenset(self.gpus_now), frozenset(self.leaving))
        if decision.numbers.get("weighed_response") is not None:
            self.planned_response = float(decision.numbers["weighed_response"])
        if decision.numbers.get("weighed_memory") is not None:
            self.weighed_memory = dict(decision.numbers["weighed_memory"])
        self.decisions.append(decision)

    def commit(self, decision: Decision) -> None:
        """The runtime applied ``decision``'s transition: run under its plan B from now on."""
        if decision.action != "transition":
            raise ValueError(f"nothing to commit: the decision was {decision.action}")
        m = decision.module
        keep = decision.target
        for name in [n for n in m.plans if n != keep]:
            del m.plans[name]
        for key in [k for k in m.emus if k[0] != keep]:
            del m.emus[key]
        m.transitions.clear()
        decision.module = None  # the core's job from now on, not the history's
        self.m, self.plan = m, keep
        self.searched, decision.searched = decision.searched, None
        self.history = []  # measurements of plan A say nothing of plan B: calibration and triggers start afresh
        self.workload = m.workloads[m.plans[keep].workload]
        self.gpus_planned = set(m.clusters[m.plans[keep].cluster].available_gpus())
        self.gpus_now = set(self.gpus_planned)
        self.leaving = set()
        self.planned_response = float(self.workload.response_len_mean)
        self.weighed_memory = {}

    # -- steps of a decision ---------------------------------------------------------------------
    def _recalibrate(self, window: list[StepRecord]) -> dict:
        records = [
            (self.plan, ms, s, r.memory.get(ms), r.step)
            for r in window
            for ms, s in r.seconds.items()
            if ms in self.m.plans[self.plan].layouts
        ]
        if not records:
            return {}
        w = self.m.workloads[self.m.plans[self.plan].workload]
        if any(peak and getattr(w.stage_of(ms), "kind", "generate") != "generate" for _, ms, _, peak, _ in records):
            self.peaks_fitted = True  # calibrate sets memory_slack from them (and keeps it after)
        # cost the measured steps at the lengths they generated: fitted at stale lengths, the
        # coefficients would absorb the difference (a plan committed for 1,733-token responses,
        # run at 2,000, learned a 13% slower cluster)
        measured_lengths(self.m.workloads[self.m.plans[self.plan].workload], window)
        self._run(self.m, [Calibrate(records=records)])
        fit = self.m.clusters[self.m.plans[self.plan].cluster].calibration
        # at the measured lengths plan A may no longer fit: the memory trigger and the re-plan see it
        self._estimate(self.m, self.plan)
        return {"recalibrated": True, "fit_error_before": fit.error_before, "fit_error_after": fit.error_after}

    def _replan(
        self, step: int, window: list[StepRecord], triggers: list[Trigger], numbers: dict, offload: bool | None = None
    ) -> Decision:
        """``offload``: plan-search's (None: the options'); see ``_host_bound`` for when it is
        turned off."""
        opts = self.options
        forced = any(t.forced for t in triggers)
        m = self._copy_job()
        a = m.plans[self.plan]
        w = m.workloads[a.workload]
        measured_lengths(w, window)  # plan for the responses the job generates now
        # plan B's cluster: the GPUs available now, less those announced to leave
        usable = self.gpus_now - self.leaving
        cluster = copy.deepcopy(m.clusters[a.cluster])
        cluster.name = f"{a.cluster.split('_at_')[0]}_at_{step}"
        cluster.unavailable = sorted(set(range(cluster.nodes * cluster.gpus_per_node)) - usable)
        m.clusters[cluster.name] = cluster
        lost = self.gpus_planned - self.gpus_now  # gone without notice: their state is lost
        unfit = self._estimate(m, self.plan)
        if unfit:
            forced = True
            if not any(t.kind == "memory" and t.forced for t in triggers):
                triggers = triggers + [Trigger("memory", f"estimate: {unfit[0].message}", forced=True)]
        numbers["step_time_now"] = a.step_time
        target = f"p{step}"
        while target in m.plans:  # a plan of that name exists (the starting plan may be @p0)
            target += "_next"
        failed = self._search(m, w, cluster, target, offload=offload)
        if failed is not None:
            action = "infeasible" if forced else "stay"
            return Decision(
                step,
                action,
                self.plan,
                forced=forced,
                triggers=triggers,
                numbers=numbers,
                message=f"plan-search found no plan: {failed}",
            )
        b = m.plans[target]
        numbers["step_time_new"] = b.step_time
        numbers["search_status"] = b.search.status
        horizon = max(1, self.total_steps - step - 1)
        if not forced and a.step_time is not None:
            # a move pays at least its fixed costs (the transfers add to them, and so may a placement
            # that remap cannot undo): a saving that cannot pay those is rejected before the
            # transition is planned, as admit would reject it after
            pg, restart = fixed_costs(m, a, b, opts.pg_init, opts.engine_restart, placement=False)
            saving = a.step_time - b.step_time
            cannot = saving * horizon <= (pg + restart) * (1 + opts.margin)
            if restart and cannot and saving * horizon > pg * (1 + opts.margin):
                # restarting the engines is what does not pay: the best plan that keeps their
                # layout may (it saves no more than plan B, so it is tried only when plan B
                # without the restart would have paid)
                kept = self._search(m, w, cluster, target, keep=generation_kept(m, a), offload=offload)
                if kept is None:
                    b = m.plans[target]
                    numbers.update(step_time_restarting=numbers["step_time_new"], step_time_new=b.step_time)
                    numbers["engines"] = "kept"
                    pg, restart = fixed_costs(m, a, b, opts.pg_init, opts.engine_restart, placement=False)
                    saving = a.step_time - b.step_time
            if saving * horizon <= (pg + restart) * (1 + opts.margin):
                numbers.update(
                    saving=saving,
                    benefit=saving * horizon,
                    cost_lower_bound=pg + restart,
                    horizon=horizon,
                    admission="reject",
                )
                self._weighed(w, window, numbers)
                why = (
                    "plan A is still the best plan found"
                    if pg + restart == 0
                    else "rejected before planning the transition: "
                    f"{saving:.4g} s per step over {plural(horizon, 'step')} "
                    f"cannot pay its fixed costs of {pg + restart:.4g} s"
                )
                return Decision(
                    step, "stay", self.plan, target, forced=False, triggers=triggers, numbers=numbers, message=why
                )
        searched = copy.deepcopy(b)  # before remap renames its GPUs
        # plan B's EMUs (plan A's are in ``self.m``, derived at the start or the commit), then
        # remap; plan-transition takes remap's bytes after as its lower bound (in the module's
        # analyses: not computed a second time, 0.3-1.5 s a move at 1,024 GPUs)
        gone = tuple(sorted(lost))
        self._run(m, [Remap(to=f"@{target}", source=f"@{self.plan}", lost=gone)])
        rec = b.remap
        numbers["remap_bytes_before"], numbers["remap_bytes_after"] = rec.before, rec.after
        name = f"{self.plan}_to_{target}"
        try:
            restore = bool(lost) and self.checkpoint is not None
            self._run(
                m,
                [PlanTransition(to=f"@{target}", source=f"@{self.plan}", into=f"@{name}", lost=gone, restore=restore)],
            )
        except DiagnosticError as e:
            why = e.diagnostics[0].message
            if offload is None and _host_bound(why, b):
                # plan B fits only with some of its state in host memory between stages, but the
                # transition delivers all of it onto its GPUs before offloading any (offloads
                # follow the commit): the best plan that keeps its state on the GPUs, once
                numbers["offload_retry"] = why
                return self._replan(step, window, triggers, numbers, offload=False)
            if lost:
                why = f"state lost with GPUs {sorted(lost)} (restore it from a checkpoint): {why}"
            return Decision(
                step,
                "infeasible" if forced else "stay",
                self.plan,
                target,
                forced=forced,
                triggers=triggers,
                numbers=numbers,
                message=f"plan-transition: {why}",
            )
        t = m.transitions[name]
        gpu_kinds = ("gpus_lost", "gpus_leaving")
        forced_by = "gpus" if any(t.forced and t.kind in gpu_kinds for t in triggers) else "memory" if forced else ""
        notes = len(m.warnings)
        self._run(
            m,
            [
                ScheduleTransfers(
                    time_limit=opts.schedule_time_limit,
                    seed=opts.seed,
                    deterministic=opts.deterministic,
                    transition=f"@{name}",
                ),
                Admit(
                    horizon=horizon,
                    margin=opts.margin,
                    pg_init=opts.pg_init,
                    engine_restart=opts.engine_restart,
                    transition=f"@{name}",
                    forced=forced_by,
                ),
            ],
            last=True,
        )
        adm = t.admit
        assert adm is not None
        del m.warnings[notes:]  # admit's note: the decision's message says it
        forced = adm.decision == "forced"
        numbers.update(admission=adm.decision, cost=adm.cost)
        if forced:
            numbers["forced_by"] = adm.forced_by
        else:
            numbers.update(saving=adm.saving, benefit=adm.benefit, break_even=adm.break_even)
        if t.restored:  # only lost GPUs held these bytes: they come from the last checkpoint
            assert self.checkpoint is not None
            numbers.update(restored=t.restored, restored_from=self.checkpoint[0], restored_step=self.checkpoint[1])
        numbers.update(
            horizon=horizon,
            bytes_moved=t.bytes_moved,
            lower_bound=t.lower_bound,
            makespan=t.makespan,
            port_bound=t.port_bound,
        )
        where = placement(b, usable, w)
        numbers.update(where)
        lines = [where_text(where)]
        if "offload_retry" in numbers:
            lines.append(
                "searched again without offload: the first plan B keeps state in host memory, which no order delivers"
            )
        if numbers.get("engines") == "kept":
            lines.append(
                f"engines kept: the plan that restarts them ({numbers['step_time_restarting']:.4g} s per step) "
                f"cannot pay a restart of {opts.engine_restart:.4g} s"
            )
        leader = min(self.gpus_planned & {g for lay in a.layouts.values() for g in lay.mesh}, default=None)
        if leader is not None and leader in (self.leaving | lost):
            after = min(g for lay in b.layouts.values() for g in lay.mesh)
            numbers["leader"] = after
            gone = "leaves" if leader in self.leaving else "is gone"
            lines.append(f"the leader (GPU {leader}) {gone}: GPU {after} leads after the move")
        if forced:
            why = {"gpus": "it uses GPUs that are gone or leaving", "memory": "it does not fit the job as it is now"}
            action, message = "transition", f"forced: the current plan cannot go on ({why[adm.forced_by or 'memory']})"
        elif adm.decision == "accept":
            action, message = "transition", "admitted: it pays back within the remaining steps"
        else:
            action, message = "stay", "rejected: it does not pay back within the remaining steps"
            self._weighed(w, window, numbers)
        message = "; ".join([message, *lines])
        return Decision(
            step,
            action,
            self.plan,
            target,
            name,
            forced,
            triggers,
            numbers,
            message,
            module=m if action == "transition" or self._asking else None,
            searched=searched if action == "transition" else None,
        )

    def _search(self, m: Module, w, cluster, target: str, keep=None, offload: bool | None = None) -> str | None:
        """plan-search for the job on ``cluster`` into ``target`` (replaced if there), started
        from the running plan; ``keep``: plan-search's option filter; ``offload``: whether plan B
        may keep state in host memory (None: as the options say). None, or why no plan."""
        opts = self.options
        m.plans.pop(target, None)
        incumbent = self.plan
        if self.searched is not None:  # the running plan before remap, under a name of its own for the search
            incumbent = f"{target}_incumbent"
            while incumbent in m.plans:
                incumbent += "_"
            m.plans[incumbent] = replace(self.searched, name=incumbent)  # read only, and removed after the search
        try:
            self._run(
                m,
                [
                    PlanSearch(
                        time_limit=opts.search_time_limit,
                        seed=opts.seed,
                        deterministic=opts.deterministic,
                        workload=f"@{w.name}",
                        cluster=f"@{cluster.name}",
                        into=f"@{target}",
                        max_pp=opts.max_pp,
                        max_zero=opts.max_zero,
                        offload=opts.offload if offload is None else offload,
                        incumbent=f"@{incumbent}",
                        keep=both(self.keep, keep),
                        # the default headroom stands for what the count leaves out; once measured
                        # peaks set the slack, only the memory trigger's margin is kept free
                        headroom=opts.memory_headroom if self.peaks_fitted else DEFAULT_HEADROOM,
                    )
                ],
            )
        except DiagnosticError as e:
            return e.diagnostics[0].message
        finally:
            if incumbent != self.plan:
                del m.plans[incumbent]
        return None

    def _copy_job(self) -> Module:
        """The job to re-plan on: a deep copy, which shares the EMUs (frozen values) and what
        the module's analyses read from them: at 1,024 GPUs, every slice of plan A."""
        return copy.deepcopy(self.m)

    def _run(self, m: Module, passes: list[ModulePass], verify_input: bool = False, last: bool = False) -> None:
        """Passes through the pass manager, verified as ``options.verify`` says: after each pass
        (``each``), or once, after the last pipeline of a re-plan (``last``: the job with plans
        A and B and the transition the runtime would run) for ``end``. The core's own modules
        are the output of its pipelines: their input is not verified again."""
        policy = self.options.verify
        verify = "end" if policy == "end" and last else "each" if policy == "each" else "off"
        run_pipeline(m, passes, verify_input=verify_input, verify=verify)

    def _weighed(self, w, window: list[StepRecord], numbers: dict) -> None:
        """A re-plan at the measured lengths of workload ``w`` and the memory peaks of ``window``
        kept plan A: the response-length trigger measures drift from those lengths from now on
        (as a rejected GPU change fires again only when the GPUs change again), not from the
        lengths plan A was made for, and the memory trigger counts from those peaks
        (``measured_triggers``). The decision carries both (``weighed_response``,
        ``weighed_memory``) for the ranks that ``follow`` it."""
        self.planned_response = numbers["weighed_response"] = float(w.response_len_mean)
        peaks = {
            ms: max((r.memory.get(ms, 0) for r in window), default=0)
            for ms in self.m.plans[self.plan].layouts
            if getattr(w.stage_of(ms), "kind", None) != "generate"
        }  # the memory trigger skips generation
        self.weighed_memory = {ms: int(v) for ms, v in peaks.items() if v}
        numbers["weighed_memory"] = dict(self.weighed_memory)

    def _estimate(self, m: Module, plan: str) -> list[Diagnostic]:
        """``estimate{oom=warn}`` of ``plan``: what no longer fits (its warnings, taken off the module)."""
        m.plans[plan].step_time = None
        before = len(m.warnings)
        self._run(m, [Estimate(plan=f"@{plan}", oom="warn")])
        problems = m.warnings[before:]
        del m.warnings[before:]
        return problems

    def _record(self, decision: Decision) -> Decision:
        self.decisions.append(decision)
        if self.log is not None:
            with self.log.open("a") as f:
                f.write(json.dumps(decision.to_json(), sort_keys=True) + "\n")
        return decision


def layout_text(lay) -> str:
    """A layout in a few words: ``TP 2 x PP 1 x DP 2 on 0..3`` (and CP, EP, ZeRO, full
    recomputation and offload where set)."""
    text = f"TP {lay.tp} x PP {lay.pp} x DP {lay.dp}" + (f" x CP {lay.cp}" if lay.cp > 1 else "")
    text += f" on {compress_ints(lay.mesh)}"
    if lay.carves_experts:
        text += f", EP {lay.ep}" + (f" x ETP {lay.expert_tp}" if lay.expert_tp != lay.tp else "")
    if lay.zero:
        text += f", ZeRO-{lay.zero}"
    if lay.recompute:
        text += ", recompute"
    if lay.offload:
        text += f", offload {'+'.join(lay.offload)}"
    return text


SAME_KEYS = (
    "tp", "pp", "dp", "cp", "zero", "layers", "mesh", "micro_batches", "recompute", "sp", "vpp", "fp8", "grad_dtype",
    "offload", "ep", "etp", "pipeline_schedule", "tp_overlap", "pp_overlapped", "dp_overlap", "attention",
)  # fmt: skip


def layout_changes(a: Plan, b: Plan) -> dict[str, dict]:
    """The model-stages whose layout differs between plans ``a`` and ``b``: before and after each
    (where the two read the same in a few words, ``also``: the other attributes that differ,
    ``{"micro_batches": [4, 2]}``)."""
    out: dict[str, dict] = {}
    for ms, lay in sorted(b.layouts.items()):
        if ms in a.layouts and same_layout(a.layouts[ms], lay):
            continue
        change: dict = {"before": layout_text(a.layouts[ms]) if ms in a.layouts else "-", "after": layout_text(lay)}
        if change["before"] == change["after"]:
            old = a.layouts[ms]
            change["also"] = {
                k: [_plain(getattr(old, k)), _plain(getattr(lay, k))]
                for k in SAME_KEYS
                if getattr(old, k) != getattr(lay, k)
            }
        out[ms] = change
    return out


def _plain(v):
    return [list(x) if isinstance(x, tuple) else x for x in v] if isinstance(v, (list, tuple)) else v


def same_layout(x, y) -> bool:
    """Two layouts that run the same way on the same GPUs (their estimates aside)."""
    return all(getattr(x, k) == getattr(y, k) for k in SAME_KEYS)


def placement(b: Plan, usable: set[int], w) -> dict:
    """Where plan B goes: its layouts (TP x PP x DP on which GPUs), the usable GPUs it leaves
    idle, and why, where a reason is known (a DP that would take them all does not divide the
    mini-batch, as the verifier requires), else that no faster plan uses them."""
    used = {g for lay in b.layouts.values() for g in lay.mesh}
    idle = sorted(usable - used)
    out: dict = {
        "layouts": {ms: layout_text(lay) for ms, lay in b.layouts.items()},
        "gpus_used": sorted(used),
        "gpus_idle": idle,
    }
    if idle:
        reasons = []
        for ms, lay in b.layouts.items():
            stage = w.stage_of(ms)
            dp_all = len(usable) // (lay.tp * lay.pp * lay.cp)
            if stage is not None and dp_all > lay.dp and not replicas_share_steps(w, stage.kind, dp_all):
                reasons.append(
                    f"{ms} at DP {dp_all} over all {len(usable)} GPUs: micro_batch {w.micro_batch} x {dp_all} "
                    f"does not divide mini_batch {w.mini_batch or w.samples}"
                )
        out["idle_reason"] = "; ".join(reasons) or "plan-search found no faster plan that uses them"
    return out


def where_text(where: dict) -> str:
    text = "plan B: " + ", ".join(f"{ms} {lay}" for ms, lay in where["layouts"].items())
    if where["gpus_idle"]:
        text += f"; GPUs {compress_ints(where['gpus_idle'])} left idle ({where['idle_reason']})"
    return text


def measured_lengths(w, window: list[StepRecord]) -> None:
    """Set workload ``w``'s response lengths (mean, max, distribution) to those ``window``'s
    steps generated: the mean over the window, the distribution share by share."""
    count = sum(r.responses[0] for r in window)
    if not count:
        return
    w.response_len_mean = max(1, round(sum(r.responses[1] for r in window) / count))
    w.response_len_max = max(w.response_len_max, max(r.responses[2] for r in window))
    shares = [r.length_shares for r in window if r.length_shares]
    if shares:
        dist = [max(1, round(sum(s[i] for s in shares) / len(shares))) for i in range(len(shares[0]))]
        w.response_len_dist = sorted(dist)
        w.response_len_mean = max(1, round(sum(dist) / len(dist)))
        w.response_len_max = max(w.response_len_max, max(dist))


def _host_bound(why: str, b) -> bool:
    """Whether plan-transition failed because plan B's state, offloaded parts included, does not
    fit on a GPU (``transition.memory``: it lands on the GPUs and is offloaded at commit) where
    plan B offloads some of it: a plan without offload may be movable to."""
    offloads = any(lay.offload for lay in b.layouts.values())
    return offloads and why.startswith("no order fits") and "plan B's state" in why


def both(first: Callable | None, second: Callable | None) -> Callable | None:
    """plan-search's ``keep`` filters applied one after the other."""
    if first is None or second is None:
        return first or second
    return lambda ms, options, n: second(ms, first(ms, options, n), n)


def generation_kept(m: Module, a) -> Callable:
    """plan-search's ``keep`` that holds every generation model-stage of plan ``a`` to its TP, PP
    and DP (its engines need no restart; the GPUs may still change) and leaves the others free."""
    w = m.workloads[a.workload]
    shapes = {
        ms: (lay.tp, lay.pp, lay.dp) for ms, lay in a.layouts.items() if cast(Stage, w.stage_of(ms)).kind == "generate"
    }

    def keep(ms, options, n):
        if ms not in shapes:
            return options
        c = columns(options)
        tp, pp, dp = shapes[ms]
        return [options[i] for i in np.flatnonzero((c["tp"] == tp) & (c["pp"] == pp) & (c["dp"] == dp)).tolist()]

    return keep
