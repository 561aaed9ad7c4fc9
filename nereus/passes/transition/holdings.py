"""The state a plan holds, read from its EMUs: the analyses that ``remap``, ``plan-transition``,
``lower_bound`` and the benchmarks share.

- ``plan_holdings``: (model, state, family) -> the pieces every GPU holds, kept in the module's
  ``analyses`` while its EMUs are the same objects;
- ``state_bytes``: bytes of state per GPU;
- ``plan_pair``: plans A and B from a pass's ``source`` and ``to`` options; ``lost_gpus``: the
  GPUs whose state is gone, from its ``drain`` and ``lost``.
"""

from __future__ import annotations

from collections import defaultdict

from ...ir import Diagnostic, DiagnosticError, Loc, Module, ShardRef
from ...ir.emu import volume
from ...ir.model import state_dtype_bytes
from ..infra.pass_manager import no_such
from .grid import Holding

__all__ = ["Holding", "lost_gpus", "plan_holdings", "plan_pair", "read_holdings", "state_bytes"]


def state_bytes(m: Module, plan_name: str, offloaded: bool = True) -> dict[int, int]:
    """Bytes of state (weights, fp32 master, Adam moments) each GPU holds under a plan; with
    ``offloaded=False`` only what stays on the GPU between steps. Needs the plan's EMUs."""
    m.require_emus(plan_name, "state_bytes")
    plan = m.plans[plan_name]
    out: dict[int, int] = defaultdict(int)
    for key, pieces in plan_holdings(m, plan_name).items():
        model_name, state, _ = key
        itemsize = state_dtype_bytes(m.models[model_name], state)
        for p in pieces:
            if (
                not offloaded
                and ("weights" if state == "weight" else "optimizer") in plan.layouts[p.ref.model_stage].offload
            ):
                continue
            out[p.gpu] += itemsize * volume(p.region)
    return dict(out)


def plan_holdings(m: Module, plan_name: str) -> dict[tuple[str, str, str], list[Holding]]:
    """(model, state, family) -> pieces, from the plan's EMUs (read only: shared with later calls).

    A move reads each plan's holdings in ``remap`` and again in ``plan-transition`` (0.3-0.4 s
    each at 1,024 GPUs; where remap keeps plan B's GPUs, plan B's are the same too; the next
    move's plan A is this one's plan B). They are kept in ``m.analyses`` for the EMU objects they
    were read from (frozen: a pass that changes a plan's state puts new ones in the module).
    """
    return dict(m.analyses.get(m, "holdings", plan_name, read_holdings))


def read_holdings(emus) -> dict[tuple[str, str, str], list[Holding]]:
    out: dict[tuple[str, str, str], list[Holding]] = defaultdict(list)
    slices: dict[tuple[str, int], list[tuple]] = {}  # replicas share entry tuples: read each once (alive in ``emus``)
    rid = 0
    for (_, ms, dp), emu in emus:
        model = ms.rpartition(".")[0]
        for s in emu.shards:
            ref = ShardRef(ms, dp, s.pp, s.tp)
            held = slices.get((model, id(s.entries)))
            if held is None:
                held = slices[(model, id(s.entries))] = [((model, e.state, e.family), e.region) for e in s.entries]
            for key, region in held:
                out[key].append(Holding(ref, s.gpu, region, rid))
            rid += 1
    return out


def plan_pair(module: Module, pass_name: str, source: str, to: str) -> tuple[str, str]:
    """(plan A, plan B) from a pass's ``source`` and ``to`` options; plan A defaults to the
    only other plan of plan B's job."""
    target = to
    if target not in module.plans:
        raise no_such(module, pass_name, "plan", target)
    if source and source not in module.plans:
        raise no_such(module, pass_name, "plan", source)
    if not source:
        others = [p for p in module.plans if p != target and module.plans[p].workload == module.plans[target].workload]
        if len(others) != 1:
            raise DiagnosticError(
                [
                    Diagnostic(
                        Loc(0, 0, module.filename),
                        f"{pass_name} needs source=@plan_a: {len(others)} other plans of the job"
                        + (f" ({', '.join('@' + p for p in others)})" if others else ""),
                        f"{pass_name}{{to=@{target},source=@{others[0]}}}" if others else None,
                    )
                ]
            )
        source = others[0]
    return source, target


def lost_gpus(module: Module, pass_name: str, target: str, drain: bool, lost) -> set[int]:
    """The GPUs whose state is gone for a move to ``target``: ``lost`` where given (GPUs that
    failed without notice; the others plan B cannot use leave with notice and still send), none
    with ``drain``, otherwise every GPU plan B's cluster marks unavailable."""
    if drain and lost is not None:
        raise DiagnosticError(
            [
                Diagnostic(
                    Loc(0, 0, module.filename),
                    f"{pass_name}: drain and lost contradict each other",
                    "drain=true: no GPU's state is lost; lost=[...]: these GPUs' is",
                )
            ]
        )
    if lost is not None:
        return set(lost)
    return set() if drain else set(module.clusters[module.plans[target].cluster].unavailable)
