"""``derive-emus``: add the EMUs of a plan's model-stages, derived from their layouts.

Weights for every model-stage; fp32 master and Adam moments for trained models in train
stages (sharded over DP under ZeRO); and for generation, the KV-cache budget of each shard:
what the cost model lets the engine allocate on that GPU next to the weights and the state
other model-stages keep there (``estimate``'s memory breakdown).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from ...ir import Diagnostic, DiagnosticError, Module, Stage
from ...ir.diagnostics import did_you_mean, plural
from ...ir.gc_pause import gc_paused
from ...ir.sharding import derive_emus, states_of
from ..cost.layout_costs import layout_costs
from ..infra.pass_manager import ModulePass, Ref, register


@register
@dataclass(frozen=True)
class DeriveEmus(ModulePass):
    """Options: ``plan`` (``@name``; default: the only plan), ``model_stage`` (default: all),
    ``only_missing`` (true: keep the EMUs the module has and derive only the model-stages that
    have none; what ``plan-transition`` and ``remap`` declare they need)."""

    name = "derive-emus"
    plan: Ref = ""
    model_stage: str = ""
    only_missing: bool = False

    def apply(self, module: Module) -> None:
        plan_name = self.plan
        if not plan_name:
            if len(module.plans) != 1:
                raise _error(
                    module, f"derive-emus needs plan=@name: the module has {plural(len(module.plans), 'plan')}"
                )
            plan_name = next(iter(module.plans))
        plan = module.plans.get(plan_name)
        if plan is None:
            raise _error(module, f"derive-emus: no plan @{plan_name}", did_you_mean(plan_name, module.plans))
        stages = [self.model_stage] if self.model_stage else list(plan.layouts)
        for ms in stages:
            if plan.layouts.get(ms) is None:
                raise _error(
                    module, f"derive-emus: plan @{plan_name} has no layout {ms}", did_you_mean(ms, plan.layouts)
                )
        with gc_paused():  # thousands of EMU shards, nothing cyclic (gc_pause.py)
            for ms in stages:
                if self.only_missing and module.emus_of(plan_name, ms):
                    continue
                for emu in model_stage_emus(module, plan_name, ms):
                    module.emus[emu.key] = emu


def emus_required(module: Module, *plans: str) -> list[ModulePass]:
    """``derive-emus{plan=@p,only_missing=true}`` for each plan whose EMUs are not all in the
    module: what a pass that reads those EMUs declares in ``requires``."""
    return [DeriveEmus(plan=f"@{p}", only_missing=True) for p in dict.fromkeys(plans) if module.missing_emus(p)]


def derive_missing_emus(module: Module, plan: str) -> None:
    """Derive the EMUs of every model-stage of ``plan`` that has none (``derive-emus{plan=@plan,
    only_missing=true}``), for callers of the passes' Python functions."""
    DeriveEmus(plan=f"@{plan}", only_missing=True).apply(module)


def model_stage_emus(m: Module, plan_name: str, model_stage: str, weights_only: bool = False):
    """Every EMU of one model-stage: its states (or only its weights), and the KV-cache budget when it generates."""
    plan = m.plans[plan_name]
    layout = plan.layouts[model_stage]
    model = m.models[layout.model]
    kind = cast(Stage, m.workloads[plan.workload].stage_of(model_stage)).kind
    kv = None
    if kind == "generate":
        cost = layout_costs(m, plan)[model_stage].cost
        # whole MiB, rounded down: the cost model sizes the cache to fit beside the weights, and
        # rounding up could push a reservation past a small GPU's memory
        kv = int(float(cost.kv_cache[0]) // 2**20) * 2**20
    states = ("weight",) if weights_only else states_of(model, kind)
    return derive_emus(plan_name, model, layout, states, kv_cache=kv)


def _error(module: Module, message: str, hint: str | None = None) -> DiagnosticError:
    from ...ir import Loc

    return DiagnosticError([Diagnostic(Loc(0, 0, module.filename), message, hint)])
