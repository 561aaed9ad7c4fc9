"""``derive-emus``: add the EMUs of a plan's model-stages, derived from their layouts."""

from __future__ import annotations

from dataclasses import dataclass

from ..ir import Diagnostic, DiagnosticError, Module
from ..ir.diagnostics import did_you_mean
from ..ir.sharding import derive_emus
from .pass_manager import ModulePass, register


@register
@dataclass(frozen=True)
class DeriveEmus(ModulePass):
    """Options: ``plan`` (``@name``; default: the only plan), ``model_stage`` (default: all)."""

    name = "derive-emus"
    plan: str = ""
    model_stage: str = ""

    def apply(self, module: Module) -> None:
        plan_name = self.plan.lstrip("@")
        if not plan_name:
            if len(module.plans) != 1:
                raise _error(module, f"derive-emus needs plan=@name: the module has {len(module.plans)} plans")
            plan_name = next(iter(module.plans))
        plan = module.plans.get(plan_name)
        if plan is None:
            raise _error(module, f"derive-emus: no plan @{plan_name}", did_you_mean(plan_name, module.plans))
        stages = [self.model_stage] if self.model_stage else list(plan.layouts)
        for ms in stages:
            layout = plan.layouts.get(ms)
            if layout is None:
                raise _error(module, f"derive-emus: plan @{plan_name} has no layout {ms}", did_you_mean(ms, plan.layouts))
            for emu in derive_emus(plan_name, module.models[layout.model], layout):
                module.emus[emu.key] = emu


def _error(module: Module, message: str, hint: str | None = None) -> DiagnosticError:
    from ..ir import Loc

    return DiagnosticError([Diagnostic(Loc(0, 0, module.filename), message, hint)])
