"""``plan-transition{to=@plan_b}``: the global transition graph from the module's plan to plan B.

For every model, every state it carries across a step (weights; fp32 master and Adam moments of
trained models) and every tensor family:

1. the source pieces (EMU slices of plan A, on their GPUs) and the destination pieces (EMU
   slices of plan B) are cut along every boundary of either, per dimension (the layer axis
   included), into cells;
2. a destination GPU that already holds a cell keeps it: nothing to do when the same
   model-stage keeps the same slice on the same GPU, a local ``copy`` otherwise;
3. every other cell a GPU needs is received once. The GPUs that need a cell are split into parts
   that need the same slice (the replicas of an inference layout; one ZeRO-3 slice of a training
   layout), joined where two share a GPU; each part gets the cell from a GPU that holds it (any
   replica of any model-stage of the same model): the one that sent the part its previous cell
   while that GPU's load stays within the part's fair share (its slice's bytes times its GPUs)
   of the least-loaded holder's, otherwise the least loaded, so senders are balanced and a
   replicas' slice goes out in long runs rather than a broadcast per cell; a part of several
   GPUs gets one ``broadcast``;
4. cells with the same sender and receivers are merged back into boxes, and every source slice
   that plan B does not keep in place is freed after the operations that read it;
5. where the plans differ in what they keep in host memory, plan A's offloaded slices are
   loaded before they are read and plan B's are offloaded once they arrived.

A trained model's fp32 master copy and Adam moments are sliced alike under every layout, so
where both plans hold the three alike, they are planned once, as one ``optimizer`` state whose
operations move the slice of all three (``group_optimizer_states``): a third of the operations
that per-state planning makes for them, the same bytes (lowering still moves each state's tensor).

Source slices on GPUs that plan B's cluster marks unavailable are lost: their data comes from
other replicas, and the pass reports what no surviving GPU holds.

Bytes moved (each received byte counted once per receiving GPU) and the lower bound
``sum over GPUs of |destination slices \\ slices already there|`` are recorded on the
transition. The bound is computed by ``lower_bound.lower_bound`` from the EMU boxes alone,
independently of the planner, so that ``bytes_moved == lower_bound`` (every missing byte
received exactly once, nothing else) is a property the tests check, not an identity.
Memory: where a GPU would exceed its memory holding plan A's state plus what its copies and
receives write, those wait for the frees of the GPU's slices that no one reads; where that is
not enough, the ones that do not fit are staged in the host memory beside the GPU (a copy or
send into ``host[g]``) and moved onto it by an ``unstage`` once every plan-A slice it gives up
is freed (``transition.memory.Memory``). That fits whenever plans A and B each fit; otherwise
the pass reports the GPU and the shortfall, and staging beyond a node's ``host_memory``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...ir import DiagnosticError, Module, Transition
from ...ir.emu import STATE_GROUPS
from ...ir.gc_pause import gc_paused
from ..infra.pass_manager import Gpus, ModulePass, Ref, register
from .derive_emus import emus_required
from .holdings import lost_gpus, plan_holdings, plan_pair
from .lower_bound import lower_bound
from .planner import Planner

__all__ = ["group_optimizer_states", "plan_transition"]


def group_optimizer_states(src_all: dict, dst_all: dict) -> tuple[dict, dict]:
    """``src_all`` and ``dst_all`` with the states of each group (``optimizer``: master, exp_avg,
    exp_avg_sq) of each (model, family) as one key, where each plan holds every member alike
    (the same pieces: shard, GPU and slice, in order); other families keep their single states."""
    src, dst = dict(src_all), dict(dst_all)
    for group, members in STATE_GROUPS.items():
        for model_name, _, family in [k for k in dst_all if k[1] == members[0]]:
            keys = [(model_name, st, family) for st in members]
            alike = True
            for holdings in (src_all, dst_all):
                first = holdings.get(keys[0])
                if first is None or any(holdings.get(k) != first for k in keys[1:]):
                    alike = False
                    break
            if not alike:
                continue
            for holdings, out in ((src_all, src), (dst_all, dst)):
                out[(model_name, group, family)] = holdings[keys[0]]
                for k in keys:
                    del out[k]
    return src, dst


def plan_transition(
    m: Module,
    source: str,
    target: str,
    name: str,
    lost: set[int] | None = None,
    bound: int | None = None,
    restore: bool = False,
) -> Transition:
    """Build the transition graph; see the module docstring. Needs both plans' EMUs
    (``derive-emus``; the pass declares it and the pass manager runs it).

    ``lost``: GPUs whose state is gone (default: those plan B's cluster marks unavailable). Pass
    an empty set for GPUs that leave with notice (a planned scale-in): they still send.
    ``bound``: the lower bound, where the caller has it for the same plans and ``lost`` (remap's
    ``after``: the same sum, from its reuse matrix); otherwise ``lower_bound`` computes it.
    ``restore``: slices of plan B that no surviving GPU holds (they were only on lost GPUs: a ZeRO
    shard, a pipeline stage without a replica) are not an error but left to a read from the last
    checkpoint, their bytes recorded as ``restored`` (``bytes_moved + restored == lower_bound``).
    """
    cluster = m.clusters[m.plans[target].cluster]
    # GPUs that failed since plan A (unavailable in plan B's cluster) hold nothing any more
    lost = set(cluster.unavailable) if lost is None else set(lost)
    with gc_paused():
        # the planner's look-ups (millions of small containers at 1,024 GPUs) are gone when
        # ``_plan`` returns, before the collector resumes: its first collection then walks the
        # operations only (1.6 s of collection after the step-933 move of combined, not 2.9 s)
        ops, bytes_moved, restored = _plan(m, source, target, cluster, lost, restore)
        # inside the pause too: with the collector back on, the sets it builds would have it
        # traverse every operation just made, again and again (8.6 of 10.5 s at 961,320 operations)
        if bound is None:
            bound = lower_bound(m, source, target, lost)
    return Transition(
        name=name,
        source=source,
        target=target,
        ops=ops,
        bytes_moved=bytes_moved,
        lower_bound=bound,
        restored=restored if restore else None,
    )


def _plan(m: Module, source: str, target: str, cluster, lost: set[int], restore: bool = False):
    """The operations and the bytes they move (``plan_transition``'s work, in the collector's pause)."""
    for p in (source, target):
        m.require_emus(p, "plan-transition")
    src_all, dst_all = plan_holdings(m, source), plan_holdings(m, target)
    src_all = {k: [p for p in v if p.gpu not in lost] for k, v in src_all.items()}
    src_all, dst_all = group_optimizer_states(src_all, dst_all)
    planner = Planner(m, source, target, cluster, src_all, dst_all, restore)
    planner.expect({key: (src_all.get(key, []), dst_all[key]) for key in sorted(dst_all)})
    for key in sorted(dst_all):
        planner.family(key, src_all.get(key, []), dst_all[key])
    planner.residency()
    problems = planner.frees_and_memory()
    if problems:
        raise DiagnosticError(problems)
    return planner.ops, planner.bytes_moved, planner.restored


@register
@dataclass(frozen=True)
class PlanTransition(ModulePass):
    """Options: ``to`` (``@plan_b``), ``source`` (``@plan_a``; default: the other plan of the job),
    ``into`` (name of the transition), ``drain`` (true: GPUs plan B cannot use leave with notice
    and still send; default false: they failed and their state is lost), ``lost`` (``[GPUs]``:
    exactly these failed; the others plan B cannot use still send), ``restore`` (true: what only
    lost GPUs held is read from the last checkpoint instead of failing the pass). The lower bound is the one
    ``remap`` left in the module's analyses for the same plans, EMUs and lost GPUs, where it ran."""

    name = "plan-transition"
    to: Ref = ""
    source: Ref = ""
    into: Ref = ""
    drain: bool = False
    lost: Gpus = None
    restore: bool = False

    def requires(self, module: Module) -> list[ModulePass]:
        return emus_required(module, *plan_pair(module, self.name, self.source, self.to))

    def apply(self, module: Module) -> None:
        source, target = plan_pair(module, self.name, self.source, self.to)
        name = self.into or f"{source}_to_{target}"
        lost = lost_gpus(module, self.name, target, self.drain, self.lost)
        bound = module.analyses.find(module, "lower-bound", (source, target), frozenset(lost))
        module.transitions[name] = plan_transition(
            module, source, target, name, lost=lost, bound=bound, restore=self.restore
        )
