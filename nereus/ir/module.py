"""A module: everything one .nir file declares."""

from __future__ import annotations

from dataclasses import dataclass, field

from .cluster import Cluster
from .emu import Emu
from .model import Model
from .plan import Plan
from .transition import Transition
from .workload import Workload


@dataclass(kw_only=True)
class Module:
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

    def emus_of(self, plan: str, model_stage: str) -> list[Emu]:
        return sorted((e for e in self.emus.values() if e.plan == plan and e.model_stage == model_stage),
                      key=lambda e: e.replica)
