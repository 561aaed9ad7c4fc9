"""The cost model on published training figures it was not fitted to (``nereus bench validate``).

Three numbers per figure of ``validation/*.nir`` (one source per file, one training stage per plan):

- **in sample**: ``calibrate``'s fit (``passes.cost.calibrate.fit``) to every figure of every
  source, then each figure predicted by it: what a fit to the whole set can do, an optimistic bound;
- **leave one source out**: the fit to the other sources' figures, then each figure of the
  held-out source predicted by it; rotated over the sources. No coefficient is chosen with the
  held-out source in view;
- **calibration transfer**: for each figure of a source, the leave-one-source-out fit
  calibrated further on that figure alone (one measured configuration of the source's hardware
  and software), then the source's other figures predicted by it. This is what a user does:
  measure one configuration, then plan the others.

Every fit starts from ``NEUTRAL``, not from ``Efficiency()``'s defaults: the defaults' compute
(0.6) and overlap (0.9) were set with this set in view (docs/PERFORMANCE.md), and ``fit`` pulls
lightly toward its prior. ``NEUTRAL`` holds the values from before: compute 0.5, the links and
HBM at their vendor-derived 0.7 (unchanged), overlap 0.5 (no information: the middle).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..ir import Module, Plan
from ..ir.cluster import Efficiency
from ..passes.cost.calibrate import Observation, fit
from ..passes.cost.cost_model import CostModel, coefficient_vector
from ..passes.cost.layout_costs import layout_costs

NEUTRAL = Efficiency(compute=0.5, overlap=0.5)


@dataclass
class Figure:
    """One published training figure: its source, plan, the stage it times, and seconds per iteration."""

    source: str
    plan: str
    model_stage: str
    published_s: float
    module: Module
    plan_ir: Plan

    def predict(self, eff: Efficiency) -> float:
        """Seconds per iteration under the coefficients ``eff`` (``estimate``'s arithmetic)."""
        cost = layout_costs(self.module, self.plan_ir, CostModel(self.module.clusters[self.plan_ir.cluster], eff))
        return cost[self.model_stage].time(coefficient_vector(eff))


def figures(directory: Path) -> list[Figure]:
    """Every plan of ``directory/*.nir`` with its ``// published: X s`` figure."""
    from .validate_bench import published_plans

    out = []
    for path, _, m, name, plan, published in published_plans(directory):
        (ms,) = plan.layouts  # one training stage: its time is the iteration's
        out.append(Figure(path.stem, name, ms, published, m, plan))
    return out


def fitted(figs: list[Figure], prior: Efficiency) -> Efficiency:
    """``calibrate``'s fit of the coefficients to the figures' published seconds."""
    obs = []
    for f in figs:
        cost = layout_costs(f.module, f.plan_ir, CostModel(f.module.clusters[f.plan_ir.cluster], prior))
        obs.append(Observation(f.plan, f.model_stage, f.published_s, cost[f.model_stage]))
    return fit(obs, prior).efficiency


def _error(f: Figure, eff: Efficiency) -> float:
    return f.predict(eff) / f.published_s - 1


def holdout(figs: list[Figure], prior: Efficiency = NEUTRAL) -> dict:
    """Signed relative errors (predicted / published - 1) in sample, leaving each source out, and
    after calibrating on one figure of the held-out source; the fits, by source."""
    sources = sorted({f.source for f in figs})
    everything = fitted(figs, prior)
    in_sample = [_error(f, everything) for f in figs]
    loso: dict[int, float] = {}
    transfer: list[dict] = []
    fits: dict[str, Efficiency] = {}
    for s in sources:
        held = [i for i, f in enumerate(figs) if f.source == s]
        eff = fits[s] = fitted([f for f in figs if f.source != s], prior)
        for i in held:
            loso[i] = _error(figs[i], eff)
        for a in held if len(held) > 1 else ():
            one = fitted([figs[a]], eff)
            for i in held:
                if i != a:
                    transfer.append(
                        {"source": s, "from": figs[a].plan, "to": figs[i].plan, "error": _error(figs[i], one)}
                    )
    return {
        "in_sample": np.array(in_sample),
        "in_sample_fit": everything,
        "loso": np.array([loso[i] for i in range(len(figs))]),
        "loso_fits": fits,
        "transfer": transfer,
    }


def summary(errors) -> dict:
    """Median and worst |error|, and the mean signed error."""
    e = np.asarray(errors, dtype=float)
    return {
        "median": float(np.median(np.abs(e))),
        "worst": float(np.max(np.abs(e))),
        "mean_signed": float(np.mean(e)),
        "n": len(e),
    }
