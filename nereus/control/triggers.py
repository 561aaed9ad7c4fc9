"""When to re-plan: each trigger compares what was measured with what the plan assumed."""

from __future__ import annotations

from dataclasses import dataclass

from ..ir import Module, Plan
from .measurements import StepRecord
from .options import ControlOptions


@dataclass(frozen=True)
class Trigger:
    """Why the core re-plans: ``kind`` is one of ``gpus_lost``, ``gpus_joined``, ``gpus_leaving``,
    ``response_length``, ``memory``, ``slowdown``, ``what_if`` (asked: ``DecisionCore.what_if``);
    ``forced``: the current plan cannot go on (GPUs it uses are gone or leaving, or it ran out of
    memory)."""

    kind: str
    detail: str
    forced: bool = False

    def to_json(self) -> dict:
        return {"kind": self.kind, "detail": self.detail, "forced": self.forced}


def gpu_triggers(plan: Plan, gpus_now: set[int], gpus_planned: set[int], leaving: set[int]) -> list[Trigger]:
    used = {g for lay in plan.layouts.values() for g in lay.mesh}
    out = []
    lost = gpus_planned - gpus_now
    if lost:
        out.append(Trigger("gpus_lost", f"GPUs {sorted(lost)} are gone", forced=bool(lost & used)))
    joined = gpus_now - gpus_planned
    if joined:
        out.append(Trigger("gpus_joined", f"GPUs {sorted(joined)} joined"))
    if leaving:
        out.append(Trigger("gpus_leaving", f"GPUs {sorted(leaving)} announced to leave", forced=bool(leaving & used)))
    return out


def measured_triggers(
    m: Module,
    plan: Plan,
    window: list[StepRecord],
    planned_response: float,
    opts: ControlOptions,
    weighed_memory: dict[str, int] | None = None,
) -> list[Trigger]:
    """Response length drift, memory headroom and slowdown against the plan's estimates.

    ``weighed_memory``: per model-stage, the peak a re-plan last weighed and kept the plan at.
    Short of the GPU's memory, such a model-stage's trigger fires again only past half the way
    from that peak to the GPU's memory: a plan that runs close to full and that a re-plan found
    still best is weighed again as it closes in, not at every check (over the GPU always fires)."""
    out = []
    count = sum(r.responses[0] for r in window)
    if count and planned_response > 0:
        mean = sum(r.responses[1] for r in window) / count
        drift = mean / planned_response - 1
        if abs(drift) > opts.response_drift:
            out.append(
                Trigger(
                    "response_length",
                    f"mean response length {mean:.0f} tokens, planned for {planned_response:.0f} ({drift:+.0%})",
                )
            )
    cap = m.clusters[plan.cluster].gpu_memory
    w = m.workloads[plan.workload]
    for ms in plan.layouts:
        stage = w.stage_of(ms)
        if stage is not None and stage.kind == "generate":
            continue  # the engine fills its memory with KV cache by design; a short cache shows as time
        peak = max((r.memory.get(ms, 0) for r in window), default=0)
        weighed = (weighed_memory or {}).get(ms, 0)
        if peak > max(cap * (1 - opts.memory_headroom), weighed + (cap - weighed) / 2) or peak > cap:
            since = f"; a re-plan weighed {weighed / 2**30:.2f} GiB" if weighed else ""
            out.append(
                Trigger(
                    "memory",
                    f"{ms} peaked at {peak / 2**30:.2f} GiB of {cap / 2**30:.2f} GiB "
                    f"(headroom under {opts.memory_headroom:.0%}{since})",
                    forced=peak > cap,
                )
            )
    for ms, lay in plan.layouts.items():
        times = [r.seconds[ms] for r in window if ms in r.seconds]
        if times and lay.time:
            measured = sorted(times)[len(times) // 2]
            if measured > lay.time * (1 + opts.slowdown):
                out.append(Trigger("slowdown", f"{ms} takes {measured:.3g} s, the plan expected {lay.time:.3g} s"))
    return out
