"""The ``Controller``: the decision core embedded in a running job.

A few lines around a user's loop::

    ctl = Controller(module, "p0", adapter)        # on every rank, after init_process_group
    for step in range(steps):
        with ctl.step():
            with ctl.stage("actor.generate"):
                responses = generate(...)
            ctl.responses([len(r) for r in responses])
            with ctl.stage("actor.train"):
                train(...)
        if not ctl.active:                         # this rank's GPU left the job
            break

Each rank times its stages (wall clock) and, on CUDA, their peak device memory. At the end of a
step the controller gathers every rank's measurements (one ``all_gather`` of a small fixed-size
tensor) and every rank turns them into the same ``StepRecord`` (a stage's time is its slowest
rank's) and runs ``DecisionCore.check``: recalibration when due and the triggers, deterministic in
the records, so a stay costs no further message. When a trigger fires the leader (the lowest rank
in the job) runs ``DecisionCore.replan`` and the decision goes to every rank (one
``broadcast_object_list``), so all ranks act on the same decision. On ``transition`` every rank
lowers the decision's transition (ranks = GPU ids), runs it
on the live state (``adapter.export()`` -> ``execute`` -> ``adapter.load``), and the core commits
plan B. A transition that fails rolls back: ``execute`` leaves plan A's state intact on every
survivor, the adapter is not touched, and the loop continues under plan A (the decision log says
so) in a fresh group of the same ranks; the next transition needs the default group re-created
(the executor's contract). Ranks that plan B does not use become inactive (``active`` is false: the loop should end
there). Where the adapter can rebuild its models on another group (``regroupable`` and
``regroup(module, plan, gpus)``: ``JobAdapter`` without engines), the remaining ranks re-form the
default group over themselves (``runtime.regroup.reform``; after a failed transition, over the
same ranks), the adapter rebuilds there, and the job goes on moving; GPU ids stay, GPU
``gpus[r]`` being rank ``r``. Otherwise the others go on in a process group of their own
(gathers and the decision broadcast use it) and a further transition needs the default group
re-created; the controller says so instead of running it.

The adapter is what knows the live model: ``export() -> LocalState`` (this rank's shards under
the current plan, keyed as ``plan_layout`` names them) and ``load(module, plan, state)`` (rebuild
the model and optimizer for ``plan`` from this rank's new shards).
An adapter with a ``move(module, source, target, transition=, timeout=, faults=)`` method moves
its live model itself, on every rank (``nereus.integrations.llama_adapter.LlamaAdapter`` calls
``reshard``, which builds plan B's model: a collective), and the controller calls it instead.
An adapter with an ``engine_restart_s`` (seconds, measured: ``JobAdapter`` with generation
engines) replaces the options' ``engine_restart`` prior in every admission.

Decisions are JSON lines (``log``) and, on rank 0, one line of a rich table each.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import time
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from ..control import ControlOptions, Decision, DecisionCore, StepRecord
from ..control.decide import layout_changes
from ..ir import DiagnosticError, Module, bare_name
from ..ir.diagnostics import did_you_mean
from ..runtime.execute import TransitionError, execute
from ..runtime.liveness import Heartbeat
from ..runtime.regroup import job_store, waiting
from ..runtime.state import LocalState
from .membership import Membership, PeersLost, peer_failure
from .move import plan_move


class StateAdapter(Protocol):
    def export(self) -> LocalState: ...

    def load(self, module: Module, plan: str, state: LocalState) -> None: ...


class MovingAdapter(Protocol):
    """An adapter that moves its live model itself (``LlamaAdapter``: ``reshard``). The controller
    calls ``move`` on every rank instead of export -> execute -> load; it raises
    ``TransitionError`` with plan A intact on failure (a rollback) or ``DiagnosticError`` before
    anything moved (plan B is no layout the live model takes)."""

    def move(
        self, module: Module, source: str, target: str, *, transition: str, timeout: float, faults: tuple
    ) -> None: ...


class Controller(Membership):
    def __init__(
        self,
        module: Module,
        plan: str,
        adapter: StateAdapter,
        *,
        options: ControlOptions | None = None,
        total_steps: int | None = None,
        log: str | Path | None = None,
        timeout: float = 120.0,
        show: bool = True,
        faults: tuple = (),
        keep=None,
        detect_timeout: float | None = None,
        gpu: int | None = None,
        core: DecisionCore | None = None,
        checkpoint_dir: str | Path | None = None,
        checkpoint_every: int = 0,
        group: dist.ProcessGroup | None = None,
    ):
        if options is not None and not isinstance(options, ControlOptions):
            raise TypeError(f"options must be a ControlOptions, got {type(options).__name__}")
        if not dist.is_initialized():
            raise RuntimeError("Controller needs an initialised default process group (init_from_env)")
        # ``group``: a process group of the caller's world that the job runs in (the world's other
        # ranks do something else); None: the default group, which Nereus owns and re-forms
        self.shared = group is not None
        # this process's GPU id: its rank (in ``group``), but for a process that joined a running job (``join``)
        self.rank = dist.get_rank(group) if gpu is None else gpu
        self.world = dist.get_world_size(group)
        plan = bare_name(plan)
        self.adapter, self.timeout, self.plan = adapter, timeout, plan
        self.faults = tuple(faults)  # injected into execute (tests of the rollback)
        # the longest a survivor of a failure may take to see it: a collective waiting on a rank
        # that waits on the dead one ends only at the default group's timeout (init_process_group's)
        self.detect_timeout = 2 * timeout if detect_timeout is None else detect_timeout
        # every rank keeps a core and observes the same records; only the leader (the lowest rank
        # still in the job) decides, and logs
        self.log_path = Path(log) if log is not None else None
        # keep: plan-search's option filter, the layouts the live job can take (llama_state.live_keep)
        # (``core``: a core's state taken from the job's leader, by a process that joins the job)
        self.core = core or DecisionCore(
            module, plan, options, total_steps, self.log_path if self.rank == 0 else None, keep
        )
        self.module = self.core.m
        self.step_no = 0
        self.active = True
        self.last: Decision | None = None
        self.end_of_step_s = 0.0  # seconds of the last step's end: gather, decision, broadcast (and a move)
        self._seconds: dict[str, float] = {}
        self._memory: dict[str, int] = {}
        self._lengths: list[int] = []
        self._leaving = False
        self._console = None
        # the group the controller's collectives run in: None, the default group (all ranks); after a
        # shrink, the ranks that remain; a caller's ``group`` (and after a shrink, a group of it)
        self.group = group
        self.members = list(range(self.world))  # GPU ids of the ranks in the job (self.rank: this one's)
        self.degraded = False  # a transition failed: the default group must be re-created before the next
        self.gpus: list[int] | None = None  # after ``reform``: the GPU id of each rank of the default group
        self.generation = 0  # re-formations of the default group so far
        self.redo = False  # the last step failed (ranks died) and was not done: run it again
        self.failures: list[dict] = []  # every recovered failure: the GPUs lost, the seconds it took
        # a DCP checkpoint every ``checkpoint_every`` steps (the adapter's ``save``): what only a
        # dead GPU held (a ZeRO shard, a pipeline stage without replicas) is read back from the last
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.checkpoint_every = checkpoint_every
        self.checkpoints: list[dict] = []  # every checkpoint saved: step, path, seconds, bytes this rank wrote
        self.joins: list[dict] = []  # every admission of processes that joined: their GPUs, the seconds it took
        self._tickets = 0  # join requests answered so far (the same on every rank of the job)
        self._stale = False  # the default group was re-formed and the live models not yet rebuilt on it
        # liveness and joins: a heartbeat and join requests in the job's rendezvous store (not in a
        # caller's group: its ranks' deaths and joins are the caller's to handle)
        self._store = None if self.shared else job_store(self.timeout)
        self._heartbeat = None if self._store is None else Heartbeat(self._store, self.rank)
        self._predicted: tuple | None = (
            None  # plan B's predicted step and stage times, until a step under it is measured
        )
        if show and self.rank == 0:  # the rich summary on rank 0
            from rich.console import Console

            self._console = Console(stderr=True)

    # -- measurements ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def stage(self, model_stage: str):
        """Time one model-stage of this step on this rank (and its peak memory on CUDA).

        ``model_stage`` must be one of the running plan's (``actor.train``): checked here, on entry,
        so that a misspelt or unplanned name fails where it is written and on the rank that wrote
        it, not at the step's end inside the gather every rank must join."""
        stages = self.module.plans[self.plan].layouts
        if model_stage not in stages:
            close = did_you_mean(model_stage, stages)
            raise ValueError(
                f"ctl.stage({model_stage!r}): {model_stage} is not a model-stage of plan @{self.plan}; "
                f"its model-stages: {', '.join(sorted(stages))}" + (f" ({close})" if close else "")
            )
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if cuda:
                torch.cuda.synchronize()
                self._memory[model_stage] = max(self._memory.get(model_stage, 0), torch.cuda.max_memory_allocated())
            self._seconds[model_stage] = self._seconds.get(model_stage, 0.0) + time.perf_counter() - t0

    def responses(self, lengths) -> None:
        """The lengths (tokens) of the responses this rank generated this step."""
        self._lengths.extend(int(n) for n in lengths)

    def leave(self) -> None:
        """Announce that this rank's GPU leaves the job: the next decision moves its state off it."""
        self._leaving = True

    def step(self) -> _Step:
        """One training step: measurements inside, the decision (and a transition) at its end.

        A rank that dies without notice in the step, or in the move at its end, breaks a
        collective of the others: the exception ends here on every survivor, which recovers
        (``_recover``: the survivors agree who is alive, re-form the default group over
        themselves and move the live state to a plan on them) and sets ``redo``: the step was
        not done and the loop runs it again. An exception that no rank's death explains (every
        member is alive) is raised as it was."""
        return _Step(self)

    def _begin(self) -> None:
        self._seconds, self._memory, self._lengths = {}, {}, []
        self.redo = False

    def _end(self, error: BaseException | None) -> bool:
        """The step's end (``_Step.__exit__``): the decision, or the recovery from ``error`` (raised
        in the step) or from one raised in the decision; whether ``error`` is dealt with."""
        failure: BaseException | None = error
        if error is None:
            try:
                t0 = time.perf_counter()
                self.last = self._decide()
                self.end_of_step_s = time.perf_counter() - t0  # what the controller took at this step's end
            except Exception as e:  # noqa: BLE001 - the recovery's, or raised below
                failure = e
        if failure is None:
            self._next_step()
            return True
        if not isinstance(failure, Exception) or self.shared or not peer_failure(failure):
            if failure is error:
                return False  # raised as it was
            raise failure
        self.last = self._recover(failure)
        self.redo = True
        return True

    def _next_step(self) -> None:
        """The step is done: counted, and the checkpoint saved where one is due (a rank that dies
        in the save is recovered from; the step stays done)."""
        self.step_no += 1
        if self.checkpoint_dir is None or not self.checkpoint_every or self.step_no % self.checkpoint_every:
            return
        try:
            self._save()
        except Exception as e:
            if self.shared or not peer_failure(e):
                raise
            self.last = self._recover(e)

    def _save(self) -> None:
        """The job's state after this step into ``checkpoint_dir/step_N`` (DCP, every rank)."""
        t0 = time.perf_counter()
        assert self.checkpoint_dir is not None
        path = str(self.checkpoint_dir / f"step_{self.step_no}")
        wrote = self.adapter.save(self.module, self.plan, path)  # type: ignore[attr-defined]
        self.core.checkpoint = (path, self.step_no)
        self.checkpoints.append(
            {"step": self.step_no, "path": path, "save_s": round(time.perf_counter() - t0, 4), "bytes": wrote}
        )

    # -- the decision and its application ----------------------------------------------------------
    def _decide(self) -> Decision:
        restart = getattr(self.adapter, "engine_restart_s", None)
        if restart is not None:  # measured on this job (the slowest rank's, the same on every rank)
            self.core.options = dataclasses.replace(self.core.options, engine_restart=round(restart, 3))
        # every rank's measurements as one fixed-size tensor, gathered in one collective; every
        # rank turns them into the same StepRecord, so the core's history is the same everywhere
        stages = sorted(self.module.plans[self.plan].layouts)
        unknown = sorted(set(self._seconds) - set(stages))
        if unknown:
            raise ValueError(
                f"stage(s) {', '.join(unknown)} are not model-stages of plan @{self.plan}: {', '.join(stages)}"
            )
        n = self._lengths
        mine = torch.tensor(
            [
                *(self._seconds.get(ms, 0.0) for ms in stages),
                *(self._memory.get(ms, 0) for ms in stages),
                len(n),
                sum(n),
                max(n, default=0),
                1.0 if self._leaving else 0.0,
                # join requests so far
                waiting(self._store) if self._store is not None and self.rank == self.members[0] else 0,
            ],
            dtype=torch.float64,
        )
        every = [torch.empty_like(mine) for _ in self.members]
        dist.all_gather(every, mine, group=self.group, async_op=True).wait(datetime.timedelta(seconds=self.timeout))
        record = self._record(torch.stack(every), stages)
        requests = int(max(float(row[-1]) for row in every))
        if requests > self._tickets:  # processes ask to join: the group is re-formed with them first
            record = self._admit(requests, record)
        return self._conclude(record)

    def _conclude(self, record: StepRecord) -> Decision:
        """The step's decision from its record (every rank of the job, joiners included), and its move."""
        if self._predicted is not None:  # the first step under the plan a move just committed
            self._log_outcome(record)
        self.core.observe(record)
        # every rank holds the same records, so every rank checks the triggers itself: a stay
        # (no trigger) needs no message; a re-plan runs on the leader and is broadcast
        quiet = self.core.check()
        if quiet is not None:
            self._show(quiet)
            return quiet
        leader = self.members[0]
        decision = self._agreed(self.core.replan() if self.rank == leader else None, leader)
        if decision.action == "transition" and not self.shared and (self.group is not None or self.degraded):
            decision.action = "stay"
            decision.message = (
                "not applied: the default process group "
                + ("saw a failed transition" if self.degraded else "includes ranks that left")
                + "; re-create it before the next transition"
            )
        elif decision.action == "transition":
            decision = self._apply(decision)
        if self._stale:  # re-formed for joiners and no move rebuilt the models: rebuilt in place
            self._rebuild()
        self._show(decision)
        return decision

    def _record(self, every: torch.Tensor, stages: list[str]) -> StepRecord:
        """One StepRecord from every rank's row: a stage takes as long as its slowest rank."""
        k = len(stages)
        rows = every.tolist()
        top = [max(col) for col in zip(*rows)]
        seconds = {ms: top[i] for i, ms in enumerate(stages) if top[i] > 0}
        memory = {ms: int(top[k + i]) for i, ms in enumerate(stages) if top[k + i] > 0}
        count, total = (int(sum(r[2 * k + j] for r in rows)) for j in (0, 1))
        leaving = tuple(m for m, r in zip(self.members, rows) if r[2 * k + 3] > 0)
        return StepRecord(
            self.step_no,
            seconds,
            memory,
            responses=(count, total, int(top[2 * k + 2])),
            gpus=tuple(sorted(self.core.gpus_now)),
            leaving=leaving,
        )

    def _apply(self, decision: Decision) -> Decision:
        m = decision.module
        changes = layout_changes(m.plans[decision.source], m.plans[decision.target])
        move = getattr(self.adapter, "move", None)
        t0 = time.perf_counter()
        prog = (
            None
            if move is not None
            else plan_move(
                m,
                decision.source,
                decision.target,
                decision.transition,
                self.world,
                gpus=self.members if self.shared else self.gpus,
                broadcast="chain" if self.shared else "auto",  # no subgroups inside a caller's group
            )
        )
        t1 = time.perf_counter()
        try:
            if move is not None:  # the adapter moves its live model itself (every rank calls it)
                move(
                    m,
                    decision.source,
                    decision.target,
                    transition=decision.transition,
                    timeout=self.timeout,
                    faults=self.faults,
                    **({} if self.gpus is None else {"gpus": self.gpus}),
                    **({"restore": decision.numbers["restored_from"]} if decision.numbers.get("restored") else {}),
                )
                if decision.numbers.get("restored"):  # the decision log says what came from the checkpoint
                    every: list = [None] * dist.get_world_size(self.group)
                    dist.all_gather_object(every, dict(getattr(self.adapter, "restored", {})), group=self.group)
                    read: dict[str, int] = {}
                    for part in every:
                        for name, n in part.items():
                            read[name] = read.get(name, 0) + n
                    decision.numbers["restored_tensors"] = dict(sorted(read.items()))
                new = None
            else:
                if decision.numbers.get("restored"):
                    raise RuntimeError("reading lost state from a checkpoint needs an adapter that moves itself (move)")
                new = execute(prog, self.adapter.export(), timeout=self.timeout, faults=self.faults, group=self.group)
        except DiagnosticError as e:  # plan B is no layout the live model takes: nothing moved, no collective ran
            decision.action = "rolled_back"
            decision.message = f"not applied: the live model cannot take plan @{decision.target}: {e}"
            decision.numbers.update(lower_s=round(t1 - t0, 4), execute_s=round(time.perf_counter() - t1, 4))
            self._log(decision, changes)
            return decision
        except TransitionError as e:
            decision.action, decision.message = "rolled_back", f"transition failed and rolled back: {e.reason}"
            alive = self.members if self.shared else self._survivors()
            if alive != self.members:  # ranks died in it: the step's handler moves to the survivors
                decision.numbers.update(lower_s=round(t1 - t0, 4), execute_s=round(time.perf_counter() - t1, 4))
                self._log(decision, changes)
                raise PeersLost(alive, e) from e
            # a group that saw a failure may hold half-finished messages: the controller goes on
            # in a fresh group (created through the store, not the broken connections); where the
            # adapter can rebuild its models there, the default group itself is re-formed
            if self._can_regroup():
                self._regroup(self.members, m, decision.source, decision)
            elif self.shared:  # a fresh group of the caller's world over the same ranks
                self._reform(self.members)
            else:
                self.group = dist.new_group(self.members, timeout=datetime.timedelta(seconds=self.timeout))
                self.degraded = True
            decision.numbers.update(lower_s=round(t1 - t0, 4), execute_s=round(time.perf_counter() - t1, 4))
            self._log(decision, changes)
            return decision
        t2 = time.perf_counter()
        self._stale = False  # plan B's models are built on the group as it is now
        used = {g for lay in m.plans[decision.target].layouts.values() for g in lay.mesh}
        if self.rank in used:
            if move is None:
                self.adapter.load(m, decision.target, new)
        else:
            self.active = False
        remaining = sorted(g for g in self.members if g in used)
        if remaining != self.members and self._can_regroup():
            # the default group re-formed over the ranks that remain (the others end their loop):
            # the job goes on moving, as from the start
            if self.rank in used:
                self._regroup(remaining, m, decision.target, decision)
            self.members = remaining
        elif remaining != self.members and self.shared:  # a group of the caller's world over the ranks that remain
            self._reform(remaining)
            if self.rank not in used:
                self.group = None
        elif remaining != self.members:  # every rank creates the group, in the same order
            group = dist.new_group(remaining, timeout=datetime.timedelta(seconds=self.timeout))
            self.group, self.members = (group if self.rank in used else None), remaining
        t3 = time.perf_counter()
        self.core.commit(decision)  # every rank: the same decision, the same plan B
        self.core.log = self.log_path if self.rank == self.members[0] else None
        self.module, self.plan = self.core.m, decision.target
        decision.numbers.update(lower_s=round(t1 - t0, 4), execute_s=round(t2 - t1, 4), load_s=round(t3 - t2, 4))
        self._log(decision, changes)
        lays = self.module.plans[self.plan].layouts
        self._predicted = (decision.numbers.get("step_time_new"), {ms: lay.time for ms, lay in lays.items()})
        return decision

    def _rank_of(self, gpu: int) -> int:
        """The rank of GPU ``gpu`` in the default group (after ``reform``, its place in ``gpus``)."""
        return gpu if self.gpus is None else self.gpus.index(gpu)

    def _src(self, gpu: int) -> int:
        """The rank of GPU ``gpu`` in the controller's group (``group_src`` of its broadcasts)."""
        return self._rank_of(gpu) if self.group is None else self.members.index(gpu)

    def _log_outcome(self, record: StepRecord) -> None:
        """The step time the decision predicted for plan B beside the first step measured under
        it (the model-stages the loop timed, one after another), each model-stage's too; logged
        by the leader as ``{"step", "plan", "after_move": {...}}``."""
        predicted, stages = self._predicted
        self._predicted = None
        if self.core.log is None:
            return
        measured = sum(record.seconds.values())
        line = {
            "step": record.step,
            "plan": self.plan,
            "after_move": {
                "predicted_s": predicted,
                "measured_s": round(measured, 6),
                "error": round((predicted - measured) / measured, 4) if predicted and measured else None,
                "stages": {
                    ms: {"predicted_s": stages.get(ms), "measured_s": round(s, 6)} for ms, s in record.seconds.items()
                },
            },
        }
        with self.core.log.open("a") as f:
            f.write(json.dumps(line, sort_keys=True) + "\n")

    def _log(self, decision: Decision, changes: dict) -> None:
        """The outcome of an applied decision, appended to the decision log by the leader, with the
        model-stages the move changes (or would have changed), their layouts before and after."""
        if self.core.log is not None:
            with self.core.log.open("a") as f:
                f.write(
                    json.dumps(
                        {
                            "step": decision.step,
                            "applied": decision.action,
                            "message": decision.message,
                            "numbers": decision.numbers,
                            "changes": changes,
                        },
                        sort_keys=True,
                    )
                    + "\n"
                )

    def _show(self, decision: Decision) -> None:
        if self._console is None or decision.action == "stay" and not decision.triggers:
            return
        n = decision.numbers
        why = ", ".join(t.kind for t in decision.triggers) or "-"
        self._console.print(
            f"[bold]step {decision.step}[/bold] {decision.action} ({why}) "
            f"@{decision.source} -> @{decision.target or decision.source}: "
            f"{n.get('step_time_now', float('nan')):.3g} s -> {n.get('step_time_new', float('nan')):.3g} s "
            f"per step, {n.get('bytes_moved', 0) / 2**20:.1f} MiB, {decision.message}"
        )


class _Step:
    """``ctl.step()``'s context. A class, not a generator: the traceback of a failed step comes
    to ``__exit__`` as an argument, and only a frame that can drop it lets the failed step's
    frames go (``membership.release_frames``): a generator's caller, ``contextlib``, would hold
    it through the recovery, and with it the live models and their process groups."""

    def __init__(self, ctl: Controller):
        self.ctl = ctl

    def __enter__(self) -> None:
        self.ctl._begin()

    def __exit__(self, kind, error, tb) -> bool:
        del kind, tb
        return self.ctl._end(error)
