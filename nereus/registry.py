"""Every pass of every layer, by pipeline name, as xDSL's ``get_all_passes`` gathers them.

The registry sits above the layers so that no layer imports a higher one to learn its passes:
``nereus.passes`` registers the optimizer passes, ``nereus.backend`` its ``lower-collectives``.
``run_pipeline`` here (and ``nereus.run_pipeline``, the public entry point) accepts them all.
"""

from __future__ import annotations

from collections.abc import Callable

from .ir import Module
from .passes.infra import pass_manager
from .passes.infra.pass_manager import ModulePass


def get_all_passes() -> dict[str, type[ModulePass]]:
    """Pass name -> pass class, for every layer's passes (sorted by name)."""
    from .backend.lower_collectives import PASSES as backend
    from .passes import PASSES as optimizer

    clash = set(optimizer) & set(backend)
    assert not clash, f"pass names registered twice: {sorted(clash)}"
    return dict(sorted({**optimizer, **backend}.items()))


def parse_pipeline(spec: str) -> list[ModulePass]:
    """A pipeline string over every layer's passes; raises ``PipelineError``."""
    return pass_manager.parse_pipeline(spec, get_all_passes())


def run_pipeline(
    module: Module,
    spec: str | list[ModulePass],
    after_each: Callable[[ModulePass, Module], None] | None = None,
    verify_input: bool = True,
    verify: str = "each",
) -> Module:
    """Run a pipeline of any layer's passes on ``module`` in place (see ``passes.run_pipeline``;
    ``verify``: after each pass, at the end, or off)."""
    return pass_manager.run_pipeline(
        module, spec, after_each, registry=get_all_passes(), verify_input=verify_input, verify=verify
    )
