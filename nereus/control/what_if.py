"""What if the job changed: the decision the live controller would make, asked from a file.

``what_if(module, plan, change)`` states the change (GPUs lost, announced to leave or joining;
workload and cluster fields set to new values) and runs the decision core's own re-plan on it
(``DecisionCore.what_if``): plan-search for plan B on the GPUs left, remap, plan-transition,
schedule-transfers and admit. ``nereus replan`` prints its answer.

A file whose running plan no longer checks is taken as the change it states: GPUs of the plan
that its cluster lists as ``unavailable`` are gone (or leaving, when named in ``leave``), and a
plan that no longer fits is forced to move.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, field

from ..ir import Diagnostic, DiagnosticError, Loc, Module, parse
from ..ir.printer import print_ir
from .decide import Decision, DecisionCore
from .options import ControlOptions

SETTABLE = ("workload", "cluster")


@dataclass(frozen=True)
class Change:
    """``lose``: GPUs gone without notice (their state with them); ``leave``: GPUs announced to
    leave (they still send their state); ``join``: GPUs that join (first the cluster's unavailable
    ones the plan does not use, then new nodes); ``sets``: ``workload.FIELD=VALUE`` or
    ``cluster.FIELD=VALUE`` in IR syntax (``response_len_max=16384``, ``gpu_memory=40GiB``), of the
    plan's workload and cluster; ``step``: the steps done (the rest of the workload's ``steps`` is
    the horizon a move must pay back in)."""

    lose: tuple[int, ...] = ()
    leave: tuple[int, ...] = ()
    join: int = 0
    sets: tuple[str, ...] = ()
    step: int = 0
    notes: list[str] = field(default_factory=list, compare=False)


def what_if(
    module: Module, plan: str, change: Change, options: ControlOptions | None = None
) -> tuple[Decision, DecisionCore]:
    """The decision for ``plan`` of ``module`` after ``change``, and the core that made it."""
    plan = plan.removeprefix("@")
    if plan not in module.plans:
        names = ", ".join("@" + n for n in module.plans) or "none"
        raise DiagnosticError([Diagnostic(Loc(0, 0, module.filename), f"no plan @{plan}; the plans: {names}")])
    m = with_settings(module, plan, change.sets) if change.sets else copy.deepcopy(module)
    p = m.plans[plan]
    cluster = m.clusters[p.cluster]
    used = {g for lay in p.layouts.values() for g in lay.mesh}
    leave = set(change.leave)
    # GPUs the file already lists as unavailable but the running plan uses: gone (or leaving)
    down = used & set(cluster.unavailable)
    if down:
        cluster.unavailable = sorted(set(cluster.unavailable) - down)
        change.notes.append(f"GPUs {sorted(down)} of @{plan} are unavailable in @{cluster.name}: taken as gone")
    total = cluster.nodes * cluster.gpus_per_node
    for g in [*change.lose, *change.leave]:
        if not 0 <= g < total:
            raise DiagnosticError(
                [Diagnostic(cluster.loc, f"GPU {g} is not a GPU of @{cluster.name} (GPUs 0..{total - 1})")]
            )
    core = DecisionCore(m, plan, options)
    lost = (down - leave) | set(change.lose)
    gpus = (set(core.gpus_now) | (down & leave)) - lost
    if change.join:
        gpus |= _join(core.m, p.cluster, change.join, change.notes)
    return core.what_if(gpus=gpus, leaving=leave, step=change.step), core


def _join(m: Module, name: str, n: int, notes: list[str]) -> set[int]:
    """``n`` GPUs join cluster ``name`` of ``m`` (the core's copy): its unavailable GPUs first, then
    whole new nodes (the GPUs of the last one past ``n`` stay unavailable). Returns their ids."""
    c = m.clusters[name]
    back = sorted(c.unavailable)[:n]
    extra = n - len(back)
    total = c.nodes * c.gpus_per_node
    nodes = math.ceil(extra / c.gpus_per_node)
    new = list(range(total, total + extra))
    c.nodes += nodes
    c.unavailable = sorted((set(c.unavailable) - set(back)) | set(range(total + extra, c.nodes * c.gpus_per_node)))
    if new:
        notes.append(f"{extra} GPUs join on {nodes} new node{'s' if nodes > 1 else ''} (GPUs {new[0]}..{new[-1]})")
    if back:
        notes.append(f"GPUs {back} of @{name} come back")
    return set(back) | set(new)


def with_settings(module: Module, plan: str, sets: tuple[str, ...]) -> Module:
    """``module`` with each ``BLOCK.FIELD=VALUE`` set in the plan's workload or cluster: written
    into the module's canonical text and parsed again, so that a value is read (and a mistake
    reported) exactly as in a file."""
    p = module.plans[plan]
    lines = print_ir(module).splitlines()
    for item in sets:
        key, eq, value = item.partition("=")
        block, dot, attr = key.strip().partition(".")
        if not eq or not dot or block not in SETTABLE or not re.fullmatch(r"[a-z_]+", attr):
            raise DiagnosticError(
                [
                    Diagnostic(
                        Loc(0, 0, module.filename),
                        f"--set {item}: write workload.FIELD=VALUE or cluster.FIELD=VALUE",
                        "e.g. --set workload.response_len_max=16384",
                    )
                ]
            )
        header = f"{block} @{p.workload if block == 'workload' else p.cluster} {{"
        start = lines.index(header)
        end = next(i for i in range(start, len(lines)) if lines[i] == "}")
        line = f"  {attr} = {value.strip()}"
        at = next((i for i in range(start + 1, end) if lines[i].startswith(f"  {attr} = ")), None)
        if at is None:
            lines.insert(start + 1, line)
        else:
            lines[at] = line
    return parse("\n".join(lines) + "\n", module.filename)
