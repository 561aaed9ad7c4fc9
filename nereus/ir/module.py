"""A module: everything one .nir file declares."""

from __future__ import annotations

from dataclasses import dataclass, field

from .analyses import Analyses
from .cluster import Cluster
from .diagnostics import Diagnostic, DiagnosticError, Loc
from .emu import Emu
from .model import Model
from .plan import Plan
from .transition import Transition
from .workload import Workload


def bare_name(name: str) -> str:
    """A plan's or transition's name as a caller from Python may give it, ``"@b"`` or ``"b"``, as
    the module keys it (``"b"``): one ``@`` taken off, once, where the name enters the API (so
    that messages, which write ``@{name}``, do not print ``@@b``)."""
    return name[1:] if name.startswith("@") else name


@dataclass(kw_only=True)
class Module:
    """Everything one .nir file declares, by name (without the @): clusters, models,
    workloads, plans, EMUs (keyed (plan, model-stage, replica)) and transitions. ``parse``
    builds one, ``verify`` checks it, passes change it in place, ``print_ir`` prints it."""

    clusters: dict[str, Cluster] = field(default_factory=dict)
    models: dict[str, Model] = field(default_factory=dict)
    workloads: dict[str, Workload] = field(default_factory=dict)
    plans: dict[str, Plan] = field(default_factory=dict)
    emus: dict[tuple[str, str, int], Emu] = field(default_factory=dict)
    transitions: dict[str, Transition] = field(default_factory=dict)
    filename: str | None = field(default=None, compare=False, repr=False)
    source: str | None = field(default=None, compare=False, repr=False)
    trailing_comments: list[str] = field(default_factory=list, compare=False, repr=False)
    # notes passes leave for the user (e.g. a search stopped by its time limit); not part of the IR
    warnings: list = field(default_factory=list, compare=False, repr=False)
    # lines passes that explain themselves leave for the user (plan-search{explain=true})
    explanations: list[str] = field(default_factory=list, compare=False, repr=False)
    # results computed from the EMUs, valid while the module holds the same (frozen) EMU objects
    analyses: Analyses = field(default_factory=Analyses, compare=False, repr=False)

    def emus_of(self, plan: str, model_stage: str) -> list[Emu]:
        return sorted(
            (e for e in self.emus.values() if e.plan == plan and e.model_stage == model_stage), key=lambda e: e.replica
        )

    def missing_emus(self, plan: str) -> list[str]:
        """The model-stages of ``plan`` whose EMUs the module does not hold."""
        return [ms for ms in self.plans[plan].layouts if not self.emus_of(plan, ms)]

    def require_emus(self, plan: str, who: str) -> None:
        """Raise a diagnostic naming the pass to run when ``plan``'s EMUs are not all here.

        Passes and the backend read EMUs; only ``derive-emus`` derives them (it runs the cost
        model to size KV caches). The pass manager runs it for the passes that declare it.
        """
        missing = self.missing_emus(plan)
        if missing:
            raise DiagnosticError(
                [
                    Diagnostic(
                        Loc(0, 0, self.filename),
                        f"{who}: plan @{plan} has no EMUs for {', '.join(missing)}",
                        f"run derive-emus{{plan=@{plan},only_missing=true}} first",
                    )
                ]
            )
