"""``simulate(module, trace)``: every policy on the same trace, step by step, side by side.

Per step and policy: ``react`` (a move decided before the step: paid now), the step in truth
(``SimCluster.evaluate``) times the step's noise, the weight push of the policy's kind, and, when
the plan cannot run (out of memory, GPUs gone), the failed attempt (a restart) plus a forced
move (``recover``) and the step again; if that fails too the step is lost (counted as
infeasible time). A policy that restarts from a checkpoint (the restarting ones) also redoes the
steps since its last save when a step fails (the job crashed). Every ``CHECKPOINT_EVERY`` steps
each policy saves a checkpoint. Then ``observe`` (the Nereus policy's decision core decides
here). Every policy sees the same noise at the same step. Latency per step = step + push + moves
+ lost + checkpoint save.
"""

from __future__ import annotations

import gc
import math
import multiprocessing
import os
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

from rich.progress import Progress

from ..ir import Diagnostic, DiagnosticError, Loc, Module
from ..ir.diagnostics import plural
from .policies import POLICIES, NoPlan, Policy
from .simulated_cluster import CHECKPOINT_EVERY, ENGINE_RESTART, PG_INIT, SimCluster
from .trace import Trace

FAILED_ATTEMPT = PG_INIT + ENGINE_RESTART  # an out-of-memory or a lost GPU: the attempt, then a restart


@dataclass
class PolicyRun:
    name: str
    latency: list[float] = field(default_factory=list)
    step: list[float] = field(default_factory=list)
    sync: list[float] = field(default_factory=list)
    moves: list[int] = field(default_factory=list)  # steps before which the policy moved
    move_s: float = 0.0
    lost_s: float = 0.0  # failed attempts, steps redone after a crash, and steps that could not run
    save_s: float = 0.0  # checkpoint saves
    failures: int = 0
    decide_s: float = 0.0
    samples_per_step: int = 0
    cpu_s: float | None = None  # this machine's CPU seconds for the whole run, truth included (in a pool's worker)

    def summary(self) -> dict:
        """Per completed step: a step the policy could not run produced no samples, and its time
        counts against the steps that did run."""
        done = [lat for lat, s in zip(self.latency, self.step) if s > 0]
        n = len(done)
        total = sum(self.latency)
        ordered = sorted(done)
        p99 = ordered[min(n - 1, math.ceil(0.99 * n) - 1)] if n else 0.0
        return {
            "policy": self.name,
            "steps": len(self.latency),
            "completed": n,
            "mean_s": total / n if n else math.inf,
            "p99_s": p99,
            "throughput_samples_per_s": self.samples_per_step * n / total if total else 0.0,
            "transitions": len(self.moves),
            "transition_s": self.move_s,
            "transition_share": self.move_s / total if total else 0.0,
            "lost_s": self.lost_s,
            "checkpoint_s": self.save_s,
            "failures": self.failures,
            "decide_s": self.decide_s,
            "cpu_s": self.cpu_s,
            "run_s": total,
        }


def check_fits(module: Module, trace: Trace, policies: list[str]) -> None:
    """Before the run: the trace's GPUs exist in the job's cluster, the policies are known."""
    (c,) = module.clusters.values()
    where = Loc(1, 1, str(trace.path) if trace.path else None)
    problems = []
    if trace.gpus > c.num_gpus:
        problems.append(
            Diagnostic(
                where,
                f"trace {trace.name} ranges over {plural(trace.gpus, 'GPU')}, but cluster @{c.name} of job "
                f"{trace.job} has {c.num_gpus}",
                "use a job with a larger cluster",
            )
        )
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        problems.append(Diagnostic(where, f"unknown policies {unknown}", "policies: " + ", ".join(POLICIES)))
    if problems:
        raise DiagnosticError(problems)


def simulate(
    module: Module,
    trace: Trace,
    policies: list[str] | None = None,
    steps: int | None = None,
    seed: int = 0,
    progress: bool = True,
    jobs: int = 1,
    truth: str = "event",
) -> dict:
    """Run the policies over the trace (its first ``steps`` steps); a dict of per-policy runs.
    ``truth``: ``event`` (the step played out), a misspecified event truth (``hidden``,
    ``long-gen``, ``slow-inter``, ``oversubscribed``) or ``formula`` (``SimCluster``'s truths).

    The policies are independent given the step noise (drawn here, once, for all of them), so
    with ``jobs > 1`` they run in that many worker processes, the slowest first; the runs are
    the same as one process gives, up to the search's time limits on a loaded machine."""
    return simulate_traces([(module, trace)], policies, steps, seed, progress, jobs, truth)[0]


def simulate_traces(
    cases: list[tuple],
    policies: list[str] | None = None,
    steps: int | None = None,
    seed: int = 0,
    progress: bool = True,
    jobs: int = 1,
    truth: str = "event",
) -> list[dict]:
    """``simulate`` for each (job, trace) or (job, trace, truth) of ``cases`` (``truth`` where a
    case names none), every (case, policy) run in one pool of ``jobs`` worker processes, the
    costliest first (``_cost``): one long run then overlaps the other cases' runs instead of
    waiting alone at the end of its case. One result per case, as ``simulate`` gives; ``wall_s``
    is the whole pool's."""
    names = policies or list(POLICIES)
    cases = [(c[0], c[1], c[2] if len(c) > 2 else truth) for c in cases]
    for module, trace, _ in cases:
        check_fits(module, trace, names)
    if steps is not None:
        cases = [(module, replace(trace, steps=trace.steps[:steps]), t) for module, trace, t in cases]
    sims = [SimCluster(module, trace, seed=seed, model=t) for module, trace, t in cases]
    factors = [
        [sim.noise() for _ in trace.steps] for sim, (_, trace, _) in zip(sims, cases)
    ]  # the same for every policy
    t_start = time.perf_counter()
    total = sum(len(trace.steps) for _, trace, _ in cases) * len(names)
    what = cases[0][1].name if len(cases) == 1 else plural(len(cases), "trace")
    with Progress(transient=True, disable=not progress) as bar:
        task = bar.add_task(f"simulate {what}: {len(names)} policies", total=total)
        if min(jobs, len(names) * len(cases)) <= 1:  # one process (or one run): no pool
            out = []
            for sim, (_, trace, _), fs in zip(sims, cases, factors):
                with collecting_rarely():
                    pols = {name: _start(sim, name) for name in names}
                    runs = {
                        name: PolicyRun(name, decide_s=p.start_s, samples_per_step=sim.workload.samples)
                        for name, p in pols.items()
                    }
                    for i in range(len(trace.steps)):
                        for name, p in pols.items():
                            _step(sim, p, runs[name], i, fs[i])
                        bar.advance(task, len(pols))
                out.append((runs, pols))
        else:
            tasks = [(k, n) for k in range(len(cases)) for n in names]
            done = _in_processes(cases, tasks, seed, factors, jobs, lambda n: bar.update(task, completed=n))
            out = [
                ({n: done[(k, n)][0] for n in names}, {n: done[(k, n)][1] for n in names}) for k in range(len(cases))
            ]
    wall = time.perf_counter() - t_start
    return [
        {
            "truth": t,
            "trace": trace.name,
            "job": trace.job,
            "steps": len(trace.steps),
            "seed": seed,
            "wall_s": wall,
            "runs": {n: runs[n] for n in names},
            "policies": {n: pols[n] for n in names},
        }
        for (_, trace, t), (runs, pols) in zip(cases, out)
    ]


COLLECT_EVERY = (10_000, 20, 100)
"""The cyclic collector's thresholds while policies run (CPython's are (700, 10, 10)). A move at
1,024 GPUs leaves millions of small acyclic objects alive for a while (the job, the transition
and its schedule), and each collection of the oldest generation walks all of them: 23-31 such
collections, 11 s of a 140-150 s Nereus run of the combined trace. Objects die by reference
count as before; only cycles wait longer to be collected."""


@contextmanager
def collecting_rarely():
    """Run the block with the collector's thresholds at ``COLLECT_EVERY``; restore them after."""
    before = gc.get_threshold()
    gc.set_threshold(*COLLECT_EVERY)
    try:
        yield
    finally:
        gc.set_threshold(*before)


def _start(sim: SimCluster, name: str) -> Policy:
    p = POLICIES[name]()
    t0 = time.perf_counter()
    try:
        p.start(sim)
    except NoPlan as e:
        raise DiagnosticError(
            [
                Diagnostic(
                    Loc(1, 1, str(sim.trace.path) if sim.trace.path else None),
                    f"policy {name} cannot run on the trace's first step: {e}",
                )
            ]
        ) from e
    p.start_s = time.perf_counter() - t0
    return p


# what a policy's run costs, in seconds of this machine per change of the trace's GPUs and per
# change of its lengths, read off the 70B job's runs (docs/RESULTS.md): Nereus moves at most GPU
# changes and re-plans at some length changes, the oracle searches at each change, the restarting
# policies only at their restarts; and per step, the truth (about 5 ms)
_CHANGE_SECONDS = {"nereus": (6.0, 1.0), "oracle": (1.0, 1.0)}
_OTHER_SECONDS = (0.3, 0.02)
_STEP_SECONDS = 0.005
_done = None  # in a worker process: the shared per-task step counters
_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def _cost(trace: Trace, name: str) -> float:
    """A policy's run on the trace, in rough seconds: the order the pool hands runs out in."""
    pairs = list(zip(trace.steps, trace.steps[1:]))
    gpus = sum(a.unavailable != b.unavailable for a, b in pairs)
    lengths = sum(a.response_len_dist != b.response_len_dist for a, b in pairs)
    per_gpus, per_lengths = _CHANGE_SECONDS.get(name, _OTHER_SECONDS)
    return per_gpus * gpus + per_lengths * lengths + _STEP_SECONDS * len(trace.steps)


def _init_worker(done) -> None:
    global _done
    _done = done


def _run_one(module: Module, trace: Trace, name: str, slot: int, seed: int, factors: list[float], truth: str):
    """One policy over the whole trace, in a worker process: (its run, the policy, less what a
    decision kept of the job at each move)."""
    cpu = time.process_time()
    sim = SimCluster(module, trace, seed=seed, model=truth)
    with collecting_rarely():
        p = _start(sim, name)
        run = PolicyRun(name, decide_s=p.start_s, samples_per_step=sim.workload.samples)
        for i in range(len(trace.steps)):
            _step(sim, p, run, i, factors[i])
            _done[slot] = i + 1
    run.cpu_s = time.process_time() - cpu
    for d in getattr(getattr(p, "core", None), "decisions", ()):
        d.module = None  # each move's whole job at 1,024 GPUs: not needed back, and large to send
    return run, p


def _in_processes(cases, tasks, seed, factors, jobs, advance) -> dict:
    """The (case, policy) ``tasks`` in ``jobs`` worker processes, the costliest first; their
    (run, policy) by task. A task is handed to a worker only when one is free: a call queued
    behind busy workers (the job and the trace, pickled, 150 KB at 1,024 GPUs: more than a pipe
    holds) would block the queue's feeder thread once those workers are terminated on a
    failure, and the exit waits for that thread."""
    ctx = multiprocessing.get_context("spawn")
    done = ctx.Array("i", len(tasks), lock=False)
    queue = sorted(range(len(tasks)), key=lambda t: -_cost(cases[tasks[t][0]][1], tasks[t][1]))
    # one thread of BLAS/OpenMP per worker (read when the worker loads them): the workers already
    # fill the CPUs, and more threads than cores only contend
    threads = {k: os.environ.get(k) for k in _THREAD_VARS}
    os.environ.update({k: "1" for k in _THREAD_VARS})
    futures = {}
    jobs = max(1, min(jobs, len(tasks)))

    def hand_out(pool) -> set:
        t = queue.pop(0)
        k, n = tasks[t]
        module, trace, truth = cases[k]
        f = pool.submit(_run_one, module, trace, n, t, seed, factors[k], truth)
        futures[f] = tasks[t]
        return {f}

    try:
        with ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_init_worker, initargs=(done,)) as pool:
            pending = set()
            while queue and len(pending) < jobs:
                pending |= hand_out(pool)
            while pending:
                finished, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
                advance(sum(done))
                failed = next((f for f in finished if f.exception() is not None), None)
                if failed is not None:  # a policy that cannot run: say so now, not after the others' whole runs
                    for proc in list(getattr(pool, "_processes", {}).values()):
                        proc.terminate()
                    raise failed.exception()  # a DiagnosticError pickles
                for _ in finished:
                    if queue:
                        pending |= hand_out(pool)
    finally:
        for k, v in threads.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return {futures[f]: f.result() for f in futures}


def _account(run: PolicyRun, move, i: int) -> float:
    """Book a policy's move before step ``i``; the seconds it adds to the step."""
    run.decide_s += move.decide_s
    if not move.moved:
        return 0.0
    run.moves.append(i)
    run.move_s += move.seconds
    return move.seconds


def _step(sim: SimCluster, p: Policy, run: PolicyRun, i: int, factor: float) -> None:
    lost = save = 0.0
    extra = _account(run, p.react(sim, i), i)
    out = sim.evaluate(p.plan, i)
    if out.failure:
        run.failures += 1
        lost += FAILED_ATTEMPT
        if p.restarts_from_checkpoint:  # the job crashed: the steps since the last save are redone
            last = i - i % CHECKPOINT_EVERY
            lost += sum(run.step[last:i]) + sum(run.sync[last:i])
        extra += _account(run, p.recover(sim, i, out), i)
        out = sim.evaluate(p.plan, i)
    if out.failure:  # still cannot run: the step is lost
        lost += FAILED_ATTEMPT
        step = sync = 0.0
    else:
        step = out.step_time * factor
        sync = sim.sync_seconds(p.plan, p.sync) * factor
        if (i + 1) % CHECKPOINT_EVERY == 0:
            save = sim.save_seconds(p.plan)
    run.lost_s += lost
    run.save_s += save
    run.step.append(step)
    run.sync.append(sync)
    run.latency.append(step + sync + extra + lost + save)
    run.decide_s += p.observe(sim, i, out, factor).decide_s
