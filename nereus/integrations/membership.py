"""Who is in a running job: the Controller's part that re-forms its process group when ranks
leave, die or join, and moves the live state to a plan on the ranks it has then.

- **Leave** (announced, ``ctl.leave()``): the decision moves the leaver's state off it; the
  ranks that remain re-form the default group over themselves (``_regroup``) and go on moving.
- **Die** (no notice: SIGKILL, a lost node): the others' next collective breaks (at once where
  the dead rank was their peer, otherwise at the default group's timeout). Every survivor ends
  in ``_recover``: they agree who is alive through the job's store (``runtime.liveness``),
  re-form the default group over themselves, and the decision core plans from what they hold
  (``DecisionCore.failed``: the dead GPUs' state comes from DP replicas). The step in flight is
  not counted (``ctl.redo``): the loop runs it again on plan A's state, which no rank updated.
  A failure inside a move rolls the move back first (``execute`` leaves plan A intact).
- **Join**: a new process calls ``Controller.join`` (started by ``nereus launch --join`` or any
  launcher that gives it the job's ``MASTER_ADDR``/``MASTER_PORT``). The job's leader sees its
  request at the next step's end (``runtime.regroup.waiting``, in the step's gather), every rank
  agrees on its GPU id (the lowest of the cluster's GPUs that the plan does not have), and all
  of them, old and new, re-form the default group (``_admit``). The leader sends the joiners the
  decision core's state and the step's record; from there every rank, joiners included, takes
  the same decision: with the new GPUs available (``gpus_joined``) it plans a layout that uses
  them, and the joiners receive their state through the transition, from the others' memory.

Each of these is a re-formation of the default group (``runtime.regroup.reform``) of a new
``generation``; the adapter's models, whose process groups went with the old group, are
rebuilt by the move that follows, or in place (``adapter.regroup``, a transition from the plan
to itself) where no move follows.
"""

from __future__ import annotations

import datetime
import pickle
import time
import traceback
from dataclasses import replace

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ..control import Decision, DecisionCore, StepRecord
from ..ir import DiagnosticError, Module
from ..runtime.liveness import survivors
from ..runtime.regroup import admit, job_store, reform, request_join


class PeersLost(RuntimeError):
    """Ranks of the job died: ``alive`` are the GPUs that remain (``liveness.survivors``)."""

    def __init__(self, alive: list[int], cause: BaseException):
        super().__init__(f"GPUs that remain: {alive} ({cause})")
        self.alive, self.cause = alive, cause


def peer_failure(e: BaseException) -> bool:
    """Whether ``e`` may come of a rank that died: what torch.distributed raises (gloo's
    ``RuntimeError``, ``DistError``s, timeouts, broken connections), not a caller's mistake."""
    return isinstance(e, (RuntimeError, TimeoutError, ConnectionError)) and not isinstance(e, DiagnosticError)


def close_groups() -> None:
    """Every process group of this process shut down and the default group destroyed: their
    connections close at once, so that a rank still waiting in a collective on this one (not on
    the dead rank) fails now instead of at its group's timeout. The groups the live models still
    hold close when those let go of them (``JobAdapter.detach``); the move to the survivors
    rebuilds the models."""
    if not dist.is_initialized():
        return
    for pg in list(c10d._world.pg_map):
        try:
            pg.shutdown()
        except Exception:  # noqa: BLE001 - a group broken beyond shutting down: destroyed below
            pass
    dist.destroy_process_group()


def release_frames(error: BaseException) -> None:
    """Let the frames of a failed step go: ``error``'s and its causes' and contexts' tracebacks
    cleared of their locals and dropped (their text kept as a note, for a re-raise). A cleared
    frame that is still referenced keeps its function, and a hook's closure keeps its module:
    FSDP2's pre-forward hook (``Module._call_impl.<locals>.inner``) kept the model and its
    groups alive until the traceback itself went."""
    todo, seen = [error], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if e.__traceback__ is not None:
            e.add_note("".join(traceback.format_tb(e.__traceback__)).rstrip())
            traceback.clear_frames(e.__traceback__)
            e.__traceback__ = None
        todo += [e.__cause__, e.__context__]


# the decision core's fields a joiner takes from the leader (all but the search filter and the log)
_CORE_OWN = ("keep", "log")


class Membership:
    """The Controller's membership changes (see the module docstring); mixed into ``Controller``."""

    # set by Controller.__init__
    rank: int
    members: list[int]
    gpus: list[int] | None
    group: dist.ProcessGroup | None
    shared: bool
    degraded: bool
    generation: int
    timeout: float
    detect_timeout: float
    step_no: int
    plan: str
    module: Module
    core: DecisionCore
    adapter: object
    failures: list[dict]
    joins: list[dict]
    last: Decision | None
    _tickets: int
    _stale: bool
    _store: dist.Store | None

    # -- re-forming the group --------------------------------------------------------------------
    def _reform(self, gpus: list[int]) -> None:
        """The default group re-formed over ``gpus`` (every one of them calls this); in a caller's
        group, a new group of the caller's world over them (``new_group``: their world ranks; the
        ranks of the job that are not among them need not call it)."""
        if self.shared:
            world = [dist.get_global_rank(self.group, self.members.index(g)) for g in gpus]  # type: ignore[arg-type]
            group = dist.new_group(world, timeout=datetime.timedelta(seconds=self.timeout))
            self.generation += 1
            self.gpus, self.members, self.group = list(gpus), list(gpus), group
            return
        reform(gpus, self.rank, self.generation, timeout=self.timeout, store=self._store)
        self.generation += 1
        self.gpus, self.members, self.group, self.degraded = list(gpus), list(gpus), None, False

    def _can_regroup(self) -> bool:
        return bool(getattr(self.adapter, "regroupable", False)) and hasattr(self.adapter, "regroup")

    def _regroup(self, gpus: list[int], m: Module, plan: str, decision: Decision) -> None:
        """Re-form the group over ``gpus`` (``_reform``; every one of them calls this) and have the
        adapter rebuild its models there under ``plan``. ``members`` are then ``gpus``."""
        t0 = time.perf_counter()
        self._reform(gpus)
        self._rebuild_on(m, plan)
        decision.numbers["regroup_s"] = round(time.perf_counter() - t0, 4)
        decision.numbers["regroup_gpus"] = list(gpus)

    def _rebuild_on(self, m: Module, plan: str) -> None:
        """The adapter's models rebuilt under ``plan`` on the group as re-formed."""
        if self.shared:
            self.adapter.regroup(m, plan, self.gpus, group=self.group)  # type: ignore[attr-defined]
        else:
            self.adapter.regroup(m, plan, self.gpus)  # type: ignore[attr-defined]

    def _rebuild(self) -> None:
        """The live models rebuilt on the re-formed group under the running plan (no move did)."""
        self._rebuild_on(self.module, self.plan)
        self._stale = False

    # -- ranks that die --------------------------------------------------------------------------
    def _survivors(self) -> list[int]:
        """The members alive now (every survivor of a failure calls this once per failure)."""
        return survivors(
            self._store, self.members, self.rank, self.generation, timeout=self.detect_timeout + self.timeout
        )

    def _recover(self, error: Exception) -> Decision:
        """After ranks died without notice: the survivors agree who is alive (``liveness``),
        re-form the default group over themselves, and the decision core plans from what they
        hold (the dead GPUs' state comes from DP replicas); the move runs on the new group. The
        failed step is not counted. Raises ``error`` where every member is alive (it was no
        rank's death), and a ``RuntimeError`` where the survivors cannot go on live."""
        t0 = time.perf_counter()
        if not isinstance(error, PeersLost):
            # the failed step's frames (the training code's locals: models, DDP, their groups)
            # let go, then the groups, then the live models (``detach``)
            release_frames(error)
            close_groups()
            if hasattr(self.adapter, "detach"):  # the live models let go of their groups too
                self.adapter.detach(self.module, self.plan)
        alive = error.alive if isinstance(error, PeersLost) else self._survivors()
        cause = error.cause if isinstance(error, PeersLost) else error
        if alive == self.members:
            raise error
        dead = sorted(set(self.members) - set(alive))
        if not self._can_regroup():
            raise RuntimeError(
                f"GPUs {dead} died; the adapter cannot rebuild its models on a re-formed group "
                "(regroupable): restart the job from its last checkpoint"
            ) from cause
        t1 = time.perf_counter()
        self._reform(alive)
        self._stale = True
        t2 = time.perf_counter()
        self.core.failed(set(dead), self.step_no)
        decision = self._agreed(self.core.replan() if self.rank == alive[0] else None, alive[0])
        decision.numbers.update(
            failed_gpus=dead,
            failure=str(cause).splitlines()[0][:200],
            detect_s=round(t1 - t0, 4),
            regroup_s=round(t2 - t1, 4),
            regroup_gpus=list(alive),
        )
        held = {g for lay in self.module.plans[self.plan].layouts.values() for g in lay.mesh}
        if decision.action != "transition" and held & set(dead):
            raise RuntimeError(
                f"GPUs {dead} died and the job cannot go on live on GPUs {alive}: {decision.message}"
            ) from cause
        if decision.action != "transition":  # the dead held nothing of the plan: it goes on where it was
            self._rebuild()
        else:
            decision = self._apply(decision)  # type: ignore[attr-defined]
        if decision.action not in ("transition", "stay"):
            raise RuntimeError(f"GPUs {dead} died and the move to the survivors failed: {decision.message}") from cause
        self.failures.append(
            {
                "step": self.step_no,
                "gpus": dead,
                "recover_s": round(time.perf_counter() - t0, 4),
                **{k: decision.numbers[k] for k in ("detect_s", "regroup_s")},
            }
        )
        self._show(decision)  # type: ignore[attr-defined]
        return decision

    def _agreed(self, decision: Decision | None, leader: int) -> Decision:
        """The leader's re-plan on every rank (one broadcast); the others follow it in their core."""
        box = [decision]
        dist.broadcast_object_list(box, group_src=self._src(leader), group=self.group)  # type: ignore[attr-defined]
        if self.rank == leader:  # a copy made as the others' is, so that every rank lowers equal objects
            box = pickle.loads(pickle.dumps(box))
        else:
            self.core.follow(box[0])
        return box[0]

    # -- ranks that join -------------------------------------------------------------------------
    def _admit(self, requests: int, record: StepRecord) -> StepRecord:
        """Join requests ``_tickets + 1 .. requests`` at this step's end (every rank of the job):
        each gets the lowest GPU id of the plan's cluster that the job does not have (a request
        beyond them is refused), the group is re-formed with the joiners, the leader sends them the
        core's state and ``record``; the record then counts their GPUs as available."""
        t0 = time.perf_counter()
        m = self.core.m
        cluster = m.clusters[m.plans[self.plan].cluster]
        have = set(self.members) | set(self.core.gpus_planned)
        free = [g for g in range(cluster.nodes * cluster.gpus_per_node) if g not in have]
        tickets = list(range(self._tickets + 1, requests + 1))
        given = dict(zip(tickets, free))
        new = sorted(set(self.members) | set(given.values()))
        leader = self.members[0]
        if self.rank == leader:
            for t in tickets:
                answer = {"gpu": given.get(t), "gpus": new, "generation": self.generation, "leader": leader}
                refused = {"refused": f"no GPU of cluster @{cluster.name} is free"}
                admit(self._store, t, answer if t in given else refused)
        self._tickets = requests
        if not given:
            return record
        self._reform(new)
        self._stale = True
        record = replace(record, gpus=tuple(sorted(set(record.gpus or ()) | set(given.values()))))
        state = None
        if self.rank == leader:
            state = {
                "core": {k: v for k, v in vars(self.core).items() if k not in _CORE_OWN},
                "record": record,
                "step": self.step_no,
                "plan": self.plan,
                "tickets": self._tickets,
                "joins": self.joins,
                "failures": self.failures,
                "given": sorted(given.values()),
            }
        box = [state]
        dist.broadcast_object_list(box, src=self._rank_of(leader))  # type: ignore[attr-defined]
        self.joins.append(
            {"step": self.step_no, "gpus": sorted(given.values()), "admit_s": round(time.perf_counter() - t0, 4)}
        )
        return record

    @classmethod
    def join(cls, adapter_for, *, keep_for=None, wait: float = 600.0, **options):
        """Join a running job from a new process (no process group yet; ``MASTER_ADDR`` and
        ``MASTER_PORT`` name the job's store). Blocks, at most ``wait`` seconds, until the job
        admits it at a step's end; returns the Controller of this rank, which took part in that
        step's decision and move (``last``) like every other rank: the loop goes on at
        ``step_no``. ``adapter_for(module, plan, gpu)``: this rank's adapter under the job's
        running plan (it holds nothing on this GPU: its state comes with the move);
        ``keep_for(module)``: plan-search's filter for the job (``llama_state.live_keep``);
        ``options``: the Controller's keyword arguments, the job's own (its options, total steps
        and log come with the core's state)."""
        timeout = float(options.get("timeout", 120.0))
        for own in ("options", "total_steps", "keep"):
            options.pop(own, None)
        store = job_store(timeout)
        answer = request_join(store, wait)
        t0 = time.perf_counter()
        gpu, gpus = int(answer["gpu"]), [int(g) for g in answer["gpus"]]
        reform(gpus, gpu, int(answer["generation"]), timeout=timeout, store=store)
        box: list = [None]
        dist.broadcast_object_list(box, src=gpus.index(int(answer["leader"])))
        state = box[0]
        core = DecisionCore.__new__(DecisionCore)
        vars(core).update(state["core"], log=None, keep=None)
        if keep_for is not None:
            core.keep = keep_for(core.m)
        ctl = cls(core.m, state["plan"], None, gpu=gpu, core=core, **options)  # type: ignore[call-arg]
        ctl.step_no = state["step"]
        ctl.generation, ctl.gpus, ctl.members = int(answer["generation"]) + 1, gpus, list(gpus)
        ctl._tickets, ctl.failures = state["tickets"], list(state["failures"])
        took = round(time.perf_counter() - t0, 4)
        ctl.joins = [*state["joins"], {"step": ctl.step_no, "gpus": state["given"], "admit_s": took}]
        ctl.adapter = adapter_for(ctl.module, ctl.plan, gpu)
        ctl._stale = True
        ctl.last = ctl._conclude(state["record"])  # type: ignore[attr-defined]
        ctl._next_step()  # type: ignore[attr-defined]
        return ctl
