"""``admit{horizon=STEPS,margin=X}``: move to plan B only when it pays.

cost = the scheduled makespan of the transition + fixed overheads: re-initialising the process
groups of every model-stage whose layout changes, and restarting the generation engine when
the generation layout changes (``pg_init`` and ``engine_restart``, seconds; defaults are
conservative figures for NCCL communicator set-up at scale and a vLLM engine start with its
KV cache allocation, to be calibrated per job). benefit = (step time under A - step time under
B) x the remaining steps (``horizon``; default: the workload's ``steps``). The transition is
admitted when benefit > cost x (1 + margin). The decision, both numbers, the per-step saving and
the break-even step count are attributes of the transition; a rejected transition stays in the
IR, marked rejected, and is reported, never applied.

Both plans are estimated again against the module's cluster and workload as they are now, never
read from stored figures. A plan A that no longer fits (responses grew) or that uses GPUs plan
B's cluster does not have makes the move ``forced``, with ``forced_by`` saying which: a forced
move is never rejected, and has no saving (plan A cannot run to save against).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from ...ir import Diagnostic, DiagnosticError, Loc, Module, Stage
from ...ir.attributes import compress_ints
from ...ir.diagnostics import plural
from ...ir.printer import printed_precision
from ...ir.transition import FORCED_BY, Admission
from ...ir.units import Dim, format_quantity
from ..cost.estimate import estimate_plan
from ..infra.pass_manager import ModulePass, Ref, register


def admission(
    m: Module, name: str, horizon: int, margin: float, pg_init: float, engine_restart: float, forced: str = ""
) -> Admission:
    """Admit transition ``name`` against the job as the module states it now. Both plans are
    re-estimated first: plan A's stored figures were made for the job as it was (responses grown
    since, GPUs gone), and comparing them with plan B's fresh ones once rejected a move that
    plan A's own memory made mandatory. ``forced`` (``memory`` or ``gpus``): the caller measured
    that plan A cannot go on."""
    t = m.transitions[name]
    if t.makespan is None:
        raise DiagnosticError(
            [Diagnostic(t.loc, f"admit: transition @{name} has no schedule", "run schedule-transfers before admit")]
        )
    a, b = m.plans[t.source], m.plans[t.target]
    problems = estimate_plan(m, b)
    if problems:
        raise DiagnosticError(problems)
    a_problems = estimate_plan(m, a)
    forced_by, why = forced or None, ""
    gone = sorted({g for lay in a.layouts.values() for g in lay.mesh} - set(m.clusters[b.cluster].available_gpus()))
    if gone:
        forced_by, why = "gpus", f"plan @{a.name} uses GPUs {compress_ints(gone)}, which @{b.cluster} does not have"
    elif a_problems or a.step_time is None:
        forced_by, why = "memory", a_problems[0].message if a_problems else f"plan @{a.name} has no step time"
    elif forced_by:
        why = f"the caller measured that plan @{a.name} cannot go on ({forced_by})"
    assert b.step_time is not None  # estimate_plan leaves None only with a problem
    pg, restart = fixed_costs(m, a, b, pg_init, engine_restart)
    cost = t.makespan + pg + restart
    common: dict[str, Any] = dict(
        cost=printed_precision(cost), makespan=t.makespan, pg_init=pg, engine_restart=restart, horizon=horizon
    )
    if forced_by:
        m.warnings.append(Diagnostic(t.loc, f"transition @{name} forced: {why}", severity="note"))
        return Admission(decision="forced", forced_by=forced_by, **common)
    assert a.step_time is not None
    saving = a.step_time - b.step_time
    benefit = saving * horizon
    return Admission(
        decision="accept" if benefit > cost * (1 + margin) else "reject",
        benefit=printed_precision(benefit),
        saving=printed_precision(saving),
        break_even=printed_precision(cost / saving) if saving > 0 else None,
        **common,
    )


def fixed_costs(m: Module, a, b, pg_init: float, engine_restart: float, placement: bool = True) -> tuple[float, float]:
    """(process groups, engine restart) seconds of moving from plan ``a`` to plan ``b``: the
    part of admission's cost that does not depend on the transfers (the makespan adds to it).
    With ``placement=False`` the GPUs a layout sits on are not compared: a lower bound that holds
    before ``remap`` renames plan B's GPUs (a different placement only adds cost), so a move whose
    saving cannot pay even these is rejected before its transition is planned."""
    shape = _shape if placement else _shape_unplaced
    changed = [ms for ms, lay in b.layouts.items() if ms not in a.layouts or shape(a.layouts[ms]) != shape(lay)]
    w = m.workloads[b.workload]
    gen_changed = any(
        cast(Stage, w.stage_of(ms)).kind == "generate" and _new_engines(a.layouts.get(ms), b.layouts[ms], placement)
        for ms in changed
    )
    return (pg_init if changed else 0.0), (engine_restart if gen_changed else 0.0)


def _new_engines(a, b, placement: bool) -> bool:
    """Whether generation layout ``b`` needs an engine that ``a`` does not run: an engine is one
    TP x PP group of GPUs (a set: the engine's TP ranks cut their shards from whole weights), so
    replicas added on new GPUs or dropped, or an engine's GPUs listed in another order, cost no
    restart, while another TP, PP or layer split restarts them all."""
    if a is None or (a.tp, a.pp, a.cp, a.layers) != (b.tp, b.pp, b.cp, b.layers):
        return True
    if not placement:
        return False
    size = a.tp * a.pp * a.cp  # an engine is a set of GPUs: it cuts its own shards from the weights pushed
    engines = lambda lay: {frozenset(lay.mesh[i : i + size]) for i in range(0, len(lay.mesh), size)}  # noqa: E731
    return not engines(b) <= engines(a)


def _shape(lay) -> tuple:
    return _shape_unplaced(lay) + (tuple(lay.mesh),)


def _shape_unplaced(lay) -> tuple:
    return (lay.tp, lay.pp, lay.dp, lay.cp, tuple(map(tuple, lay.layers)))


@register
@dataclass(frozen=True)
class Admit(ModulePass):
    """Options: ``horizon`` (remaining steps; default the workload's ``steps``), ``margin``,
    ``pg_init`` and ``engine_restart`` (seconds), ``transition`` (``@name``; default: every one),
    ``forced`` (``memory`` or ``gpus``: the caller measured that plan A cannot go on; admit also
    finds it forced by itself when plan A no longer fits or uses GPUs plan B's cluster lacks)."""

    name = "admit"
    horizon: int = 0
    margin: float = 0.1
    pg_init: float = 2.0
    engine_restart: float = 30.0
    transition: Ref = ""
    forced: str = ""

    def apply(self, module: Module) -> None:
        names = [self.transition] if self.transition else list(module.transitions)
        if not names:
            raise DiagnosticError([Diagnostic(Loc(0, 0, module.filename), "admit: the module has no transition")])
        for name in names:
            t = module.transitions[name]
            horizon = self.horizon or module.workloads[module.plans[t.target].workload].steps or 0
            if horizon <= 0:
                raise DiagnosticError([Diagnostic(t.loc, "admit needs horizon=STEPS (the workload sets no steps)")])
            if self.forced not in ("",) + FORCED_BY:
                raise DiagnosticError(
                    [Diagnostic(t.loc, f"admit: forced is one of {', '.join(FORCED_BY)}, got '{self.forced}'")]
                )
            t.admit = admission(
                module, name, horizon, self.margin, self.pg_init, self.engine_restart, forced=self.forced
            )
            if t.admit.decision == "reject":
                module.warnings.append(
                    Diagnostic(
                        t.loc,
                        f"transition @{name} rejected: {describe(t.admit)} (margin {self.margin:g})",
                        severity="note",
                    )
                )


def describe(a: Admission) -> str:
    """One line: the cost broken down, the saving and the benefit with units, the horizon."""
    s = lambda x: format_quantity(Dim.TIME, x)
    parts = [
        f"makespan {s(a.makespan)}" if a.makespan is not None else None,
        f"process groups {s(a.pg_init)}" if a.pg_init else None,
        f"engine restart {s(a.engine_restart)}" if a.engine_restart else None,
    ]
    cost = f"costs {s(a.cost)}" + (f" ({' + '.join(p for p in parts if p)})" if any(parts) else "")
    if a.decision == "forced":
        why = {
            "memory": "plan A does not fit the job as it is now",
            "gpus": "plan A uses GPUs that are gone or leaving",
        }
        return f"{cost}; {why.get(a.forced_by or '', 'plan A cannot go on')}"
    assert a.saving is not None and a.benefit is not None
    steps = f" over {plural(a.horizon, 'step')}" if a.horizon is not None else ""
    even = f"; breaks even after {plural(a.break_even, 'step')}" if a.break_even is not None else "; never breaks even"
    return f"{cost}, saves {s(a.saving)} per step, {s(a.benefit)}{steps}{even}"
