"""``calibrate{profile=FILE}``: fit the cost model's coefficients to measured step records.

A profile is JSON lines, one measurement per line::

    {"plan": "ppo_p0", "model_stage": "actor.train", "seconds": 16.2, "memory": 38654705664}

or one line per step with every model-stage: ``{"plan": "ppo_p0", "step": 7, "stages":
{"actor.train": {"seconds": 16.2, "memory": 38654705664}, ...}}``. Plans named in the profile
must be in the module (the layouts the job ran with).

Each predicted time is linear in the coefficients (``cost_model``), so the fit is a
least-squares problem on relative errors (every measurement counts the same, whatever its
size), bounded (no achieved fraction above 1: nothing runs faster than its peak; overhead
non-negative) and pulled toward the prior, so that a coefficient the measurements cannot
separate from the others stays near its prior. The pull is a Gaussian prior's: each coefficient's
deviation from its prior, relative, over its stated uncertainty (``PRIOR_UNCERTAINTY``), weighs as
a measurement's relative error over ``model_error``, the error one measurement is expected to
have against the model. Published figures from other stacks are not trusted to the bit
(``bench.holdout`` chooses their ``model_error`` by leaving sources out). A job's own steps (the
pass's default, ``model_error = 0``) keep the fixed pull the decision core was built and measured
with: ``RIDGE`` on every coefficient. Generation's decode is compute- or HBM-bound
depending on the
coefficients, and data-parallel communication is hidden up to a share or up to the compute
beside it, so the fit re-assigns both and solves again until the assignment is stable; the
hidden share itself (``overlap``) is chosen from a grid of 0.05 by the error after the fit, and
so is the busiest EP rank's load (``expert_imbalance``) where measurements ran experts over EP
ranks.
Coefficients that no measurement exercises keep their prior. Measured memory peaks set
``memory_slack`` (``memory_slack``, below); without peaks it keeps its prior. The cluster gets
the fitted ``efficiency`` and a ``calibration`` record with the mean absolute percentage error before and
after.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import numpy as np

from ...ir import Diagnostic, DiagnosticError, Loc, Module
from ...ir.cluster import PRIOR_UNCERTAINTY, Calibration, Efficiency
from ...ir.printer import printed_precision
from ..infra.pass_manager import ModulePass, api_option, register
from .cost_model import C_OVERHEAD, COEFFS, CostModel, coefficient_vector, efficiency_from_vector, hidden
from .layout_costs import LayoutCost, layout_costs


@dataclass
class Observation:
    plan: str
    model_stage: str
    seconds: float
    cost: LayoutCost
    memory: int | None = None  # the measured peak on the stage's fullest GPU (bytes), if measured


@dataclass
class FitResult:
    efficiency: Efficiency
    error_before: float  # mean absolute relative error of the prior
    error_after: float
    used: tuple[str, ...]  # coefficients the data determined
    iterations: int


def _mape(obs: list[Observation], coeffs: np.ndarray) -> float:
    times = _per_cost(obs, lambda cost: cost.time(coeffs))
    return float(np.mean([abs(times[id(o.cost)] - o.seconds) / o.seconds for o in obs]))


def _per_cost(obs: list[Observation], f) -> dict[int, Any]:
    """``f`` of each distinct cost the observations read, by identity: the steps of one plan
    measure the same model-stages, and ``observations`` gives them one cost each (a window of
    steps is tens of measurements of a few costs)."""
    out: dict[int, Any] = {}
    for o in obs:
        if id(o.cost) not in out:
            out[id(o.cost)] = f(o.cost)
    return out


OVERLAP_GRID = np.linspace(0.0, 1.0, 21)
IMBALANCE_GRID = np.linspace(1.0, 2.0, 21)
# GEMM knees (``Efficiency.gemm_knee``, in units of the GPU's FLOPs per HBM byte): a GEMM whose size
# (cube root of m n k) is the knee times that balance runs at half the largest GEMMs' efficiency
KNEE_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)


# A job's own steps (``model_error = 0``): every coefficient 10% off its prior costs as much as a
# 0.03% error on one measurement. Weighing the same steps by the stated uncertainties at a
# model_error of 0.0005 (0.003 for compute, 0.0035 for the links, 0.0005 for the overhead) moved
# the simulator's Nereus by +4.3%, -4.4% and +1.2% a step on the three traces (2026-12-07), so the
# live loop keeps this weight and RESULTS stand.
RIDGE = 0.003


def fit(
    obs: list[Observation], prior: Efficiency, max_iter: int = 10, model_error: float = 0.0, knees=None
) -> FitResult:
    """``_fit_imbalance`` at every GEMM knee of ``knees`` (``Efficiency.gemm_knee``), the one
    with the least error after the fit; with ``knees`` None, at the prior's knee. The knee moves
    the time of small GEMMs against large ones, so the records must span GEMM shapes to fix it:
    published figures of models from 1.7B to 1T do (``bench.holdout``); one job's few layouts
    do not, and the calibrate pass fits it only when asked (``fit_knee``)."""
    shaped = [o for o in obs if o.cost.cost.shape is not None]
    if knees is None or not shaped:
        return _fit_imbalance(obs, prior, max_iter, model_error)
    return _best_on_grid(
        obs,
        shaped,
        "shape",
        knees,
        lambda t, v: (t[0], v, t[2]),
        prior,
        "gemm_knee",
        _fit_imbalance,
        max_iter,
        model_error,
    )


def _fit_imbalance(obs: list[Observation], prior: Efficiency, max_iter: int, model_error: float) -> FitResult:
    """``_fit_overlap``, and where some measurement ran experts over EP ranks, the busiest rank's
    load (``expert_imbalance``) chosen from a grid of 0.05 between 1 and 2 by the error after
    the fit, as the overlap is. ``model_error``: the relative error expected of one measurement
    against the model, which sets how far the measurements may pull a coefficient from its prior
    (module docstring)."""
    uneven = [o for o in obs if o.cost.cost.imbalance is not None]
    if not uneven:
        return _fit_overlap(obs, prior, max_iter, model_error)
    return _best_on_grid(
        obs,
        uneven,
        "imbalance",
        IMBALANCE_GRID,
        lambda t, v: (t[0], v),
        prior,
        "expert_imbalance",
        _fit_overlap,
        max_iter,
        model_error,
    )


def _best_on_grid(obs, chosen, attr, grid, rebuild, prior, field, inner, max_iter, model_error) -> FitResult:
    """``inner``'s fit at every value of ``grid`` of the cost attribute ``attr`` of the ``chosen``
    observations (``rebuild(saved tuple, value)``) and of the prior's ``field``; the one with the
    least error after the fit. The costs get their own attribute back afterwards."""
    saved = [cast(tuple, getattr(o.cost.cost, attr)) for o in chosen]
    best = None
    try:
        for value in grid:
            for o, t in zip(chosen, saved):
                setattr(o.cost.cost, attr, rebuild(t, float(value)))
            r = inner(obs, replace(prior, **{field: float(value)}), max_iter, model_error)
            if best is None or r.error_after < best.error_after - 1e-12:
                best = r
    finally:
        for o, t in zip(chosen, saved):
            setattr(o.cost.cost, attr, t)
    assert best is not None  # the grids are not empty
    return FitResult(
        best.efficiency, _mape(obs, coefficient_vector(prior)), best.error_after, best.used + (field,), best.iterations
    )


def _fit_overlap(obs: list[Observation], prior: Efficiency, max_iter: int, model_error: float) -> FitResult:
    """Bounded least squares on relative error, pulled toward the prior (``_bounded_fit``); see the
    module docstring. The share of
    data-parallel communication that compute hides (``overlap``) enters the time through a
    max, not linearly: when some measurement has such communication, every share of a grid of
    0.05 is tried and the one with the least error after the fit is kept."""
    if not obs:
        raise ValueError("no observations to fit")
    with_overlap = [o for o in obs if o.cost.cost.overlap is not None and np.any(o.cost.cost.overlap[0])]
    if not with_overlap:
        return _fit_linear(obs, prior, max_iter, model_error)
    return _best_on_grid(
        obs,
        with_overlap,
        "overlap",
        OVERLAP_GRID,
        lambda t, v: (t[0], t[1], v),
        prior,
        "overlap",
        _fit_linear,
        max_iter,
        model_error,
    )


def prior_weights(prior: Efficiency, model_error: float) -> np.ndarray:
    """Per coefficient (``COEFFS``), the weight of its relative deviation from ``prior`` against a
    measurement's relative error: ``model_error`` over the prior's relative uncertainty; with
    ``model_error`` 0 (a job's own steps), ``RIDGE`` on every coefficient."""
    values = [getattr(prior, c) for c in COEFFS]
    if model_error <= 0:
        return np.array([RIDGE if v > 0 else 0.0 for v in values])
    return np.array([model_error * v / PRIOR_UNCERTAINTY[c] if v > 0 else 0.0 for c, v in zip(COEFFS, values)])


def _bounded_fit(
    A: np.ndarray,
    b: np.ndarray,
    cols: np.ndarray,
    scale: np.ndarray,
    prior: np.ndarray,
    weights: np.ndarray,
    lsq_linear,
) -> np.ndarray:
    """Least squares on the scaled columns with every achieved fraction at most 1 (a coefficient
    1 / efficiency of at least 1: nothing beats its peak) and the overhead non-negative, pulled
    toward the prior with ``weights`` (``prior_weights``) so that what the measurements cannot
    tell apart (one plan's steps repeat the same mix of compute, HBM and links) stays at the
    prior instead of drifting to any value that fits (an HBM 138x its peak, seen when a job
    measured one plan)."""
    lo = np.where(cols < C_OVERHEAD, 1.0, 0.0) * scale
    rows, rhs = [A], [b]
    for k, (p, w) in enumerate(zip(prior, weights)):
        if p > 0 and w > 0:
            r = np.zeros(len(cols))
            r[k] = w / (scale[k] * p)
            rows.append(r[None, :])
            rhs.append(np.array([w]))
    # BVLS: exact active-set least squares, 3-8x faster than the default trust-region solver at
    # these sizes (a few columns, tens to thousands of rows), the same solution (the ridge makes it unique)
    y = lsq_linear(np.vstack(rows), np.concatenate(rhs), bounds=(lo, np.full(len(cols), np.inf)), method="bvls").x
    return y / scale


def _fit_linear(obs: list[Observation], prior: Efficiency, max_iter: int, model_error: float) -> FitResult:
    """The fit with ``prior.overlap`` fixed (the observations' costs carry it)."""
    from scipy.optimize import lsq_linear  # imported here: scipy costs 0.3 s at start-up, and only calibrate needs it

    x = coefficient_vector(prior)
    weights = prior_weights(prior, model_error)
    before = _mape(obs, x)
    used = np.zeros(len(COEFFS), dtype=bool)
    assignment = None
    it = 0
    for it in range(1, max_iter + 1):
        rows, rhs = [], []
        features = _per_cost(obs, lambda cost: cost.features(x))
        for o in obs:
            f, lat = features[id(o.cost)]
            rows.append(f / o.seconds)
            rhs.append((o.seconds - lat) / o.seconds)
        A, b = np.array(rows), np.array(rhs)
        used = np.abs(A).sum(axis=0) > 0
        fixed = ~used
        b_free = b - A[:, fixed] @ x[fixed]
        scale = np.linalg.norm(A[:, used], axis=0)
        x = x.copy()
        x[used] = _bounded_fit(
            A[:, used] / scale,
            b_free,
            np.flatnonzero(used),
            scale,
            coefficient_vector(prior)[used],
            weights[used],
            lsq_linear,
        )
        assigned = _per_cost(
            obs,
            lambda cost: (
                bool(cost.cost.decode is not None and cost.cost.decode[0][0] * x[0] >= cost.cost.decode[1][0] * x[1]),
                *(
                    tuple(np.round(hidden(comm, window, share, x)[0], 12))
                    for _, (comm, window, share) in cost.cost.hides()
                ),
            ),
        )
        new_assignment = tuple(assigned[id(o.cost)] for o in obs)
        if new_assignment == assignment:
            break
        assignment = new_assignment
    x[:5] = np.where(used[:5] & (x[:5] > 0), x[:5], coefficient_vector(prior)[:5])
    eff = efficiency_from_vector(x, prior)
    return FitResult(eff, before, _mape(obs, coefficient_vector(eff)), tuple(c for c, u in zip(COEFFS, used) if u), it)


def read_profile(path: str | Path) -> list[tuple[str, str, float, int | None, int]]:
    """(plan, model_stage, seconds, memory, line) per measurement; raises DiagnosticError on bad lines."""
    out, problems = [], []
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise DiagnosticError([Diagnostic(Loc(0, 0, str(path)), f"cannot read profile: {e.strerror}")]) from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            stages = rec["stages"] if "stages" in rec else {rec["model_stage"]: rec}
            for ms, v in stages.items():
                seconds = float(v["seconds"])
                if not seconds > 0:
                    raise ValueError("seconds must be positive")
                out.append((str(rec["plan"]).lstrip("@"), ms, seconds, v.get("memory"), n))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            problems.append(
                Diagnostic(
                    Loc(n, 1, str(path)),
                    f"bad profile record: {e}",
                    'expected {"plan": ..., "model_stage": ..., "seconds": ...}',
                )
            )
    if problems:
        raise DiagnosticError(problems)
    return out


def observations(m: Module, records, model_for=None) -> list[Observation]:
    costs: dict[str, dict[str, LayoutCost]] = {}
    obs, problems = [], []
    for plan, ms, seconds, _memory, line in records:
        if plan not in m.plans:
            problems.append(Diagnostic(Loc(line, 1, None), f"profile names plan @{plan}, which is not in the module"))
            continue
        if plan not in costs:
            p = m.plans[plan]
            costs[plan] = layout_costs(m, p, model_for(p) if model_for else None)
        if ms not in costs[plan]:
            problems.append(Diagnostic(Loc(line, 1, None), f"plan @{plan} has no model-stage {ms}"))
            continue
        obs.append(Observation(plan, ms, seconds, costs[plan][ms], _memory))
    if problems:
        raise DiagnosticError(problems)
    return obs


@register
@dataclass(frozen=True)
class Calibrate(ModulePass):
    """Options: ``profile`` (path of the JSON-lines profile); from Python, ``records`` instead:
    measured stage times as ``read_profile`` gives them (plan, model-stage, seconds, memory,
    line), as the decision core passes the steps it observed; ``model_error``, the relative
    error expected of one measurement against the model (0, the default: the job's own steps,
    ``RIDGE``; larger where the records come from another stack, which lets the priors hold
    more); ``fit_knee``, whether the GEMM knee (``Efficiency.gemm_knee``) is fitted too, on
    ``KNEE_GRID`` (records of several model sizes and layouts; off: the prior's). The fit
    of each cluster is recorded on it (``efficiency``, ``calibration``)."""

    name = "calibrate"
    profile: str = ""
    model_error: float = 0.0
    fit_knee: bool = False
    records: list | None = api_option()

    def apply(self, module: Module) -> None:
        knees = KNEE_GRID if self.fit_knee else None
        if self.records is not None:
            calibrate_records(module, self.records, self.model_error, knees)
            return
        if not self.profile:
            raise DiagnosticError([Diagnostic(Loc(0, 0, module.filename), "calibrate needs profile=FILE")])
        calibrate_records(module, read_profile(self.profile), self.model_error, knees)


def memory_slack(obs: list[Observation]) -> float | None:
    """The largest ratio of a measured peak to the bytes the cost model counts, over the training
    and inference observations with a peak (None when there are none): the peak less what other
    model-stages keep on that GPU, against the stage's own count. Not below 1: a peak under the
    count says the model overcounts what it does count (activations, most often), and a plan
    packed tighter than counted risks an out-of-memory whose restart costs more than the memory
    saved. The largest, not a mean: a peak is a peak, and an underestimate fails a step."""
    ratios = [
        (o.memory - max(o.cost.others.values(), default=0.0)) / float(o.cost.cost.counted()[0])
        for o in obs
        if o.memory and o.cost.cost.decode is None and o.cost.cost.counted()[0] > 0  # decode: generation
    ]
    return printed_precision(max(1.0, max(ratios)), 4) if ratios else None


def calibrate_records(module: Module, records, model_error: float = 0.0, knees=None) -> dict[str, FitResult]:
    """Fit every cluster named by ``records`` (``read_profile``'s tuples: plan, model-stage,
    seconds, memory, line) and record the result on it; the fit per cluster name."""
    by_cluster: dict[str, list] = {}
    for r in records:
        plan = module.plans.get(r[0])
        by_cluster.setdefault(plan.cluster if plan else "", []).append(r)
    results = {}
    for cluster_name, recs in by_cluster.items():
        obs = observations(module, recs)
        cluster = module.clusters[cluster_name]
        result = results[cluster_name] = fit(
            obs, cluster.efficiency or Efficiency(), model_error=model_error, knees=knees
        )
        slack = memory_slack(obs)
        if slack is not None:
            result.efficiency = replace(result.efficiency, memory_slack=slack)
        cluster.efficiency = Efficiency(**{k: printed_precision(v, 4) for k, v in vars(result.efficiency).items()})
        cluster.calibration = Calibration(
            len(obs), printed_precision(result.error_before, 4), printed_precision(result.error_after, 4)
        )
    return results


def synthetic_profile(m: Module, hidden: Efficiency, noise: float = 0.0, seed: int = 0, steps: int = 1) -> list[dict]:
    """Records a job would measure if the cluster's true coefficients were ``hidden``.

    For testing a calibration loop without a cluster: for ``steps`` steps of every plan, each
    model-stage's time under ``hidden`` times a log-normal factor of relative spread ``noise``.
    """
    rng = np.random.default_rng(seed)
    truth = coefficient_vector(hidden)
    out = []
    for plan in m.plans.values():
        costs = layout_costs(m, plan, CostModel(m.clusters[plan.cluster], hidden))
        for step in range(steps):
            for ms, lc in costs.items():
                t = lc.time(truth) * (float(np.exp(rng.normal(0.0, noise))) if noise else 1.0)
                out.append({"plan": plan.name, "step": step, "model_stage": ms, "seconds": t})
    return out
