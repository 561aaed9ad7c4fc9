"""plan-search is optimal in truth: on random small jobs, the plan it finds is never slower than the
best plan of an independent enumerator (its own loops over layouts, placements and colocation,
costed by ``estimate``), and it never says "no plan fits" when the enumerator found one that fits.

The enumerator stays inside plan-search's exact regime (at most 16 available GPUs, at most 4
model-stages) and inside its search space; to stay fast it draws, per job, a random subset of the
knob values (ZeRO levels, offload sets, micro-batch counts, recomputation) and enumerates TP, PP,
DP, set partitions of each stage's model-stages and their placements exhaustively within it
(about a third of the jobs on up to 8 GPUs get every ZeRO level, recomputation and micro-batch
count, so that the enumerator often reaches the optimum and the comparison has teeth).
It imports nothing from ``search_space`` or ``plan_search``; it costs layouts with the cost model
(``Candidates``/``CostModel``, what ``estimate`` uses) and checks its best plan with ``estimate_plan``:
the plan must fit and its step time must equal the enumerator's arithmetic.
Jobs run on two worker processes; counts (feasible, infeasible, memory-bound, colocated, tied with
plan-search) are printed (``-rA``) and asserted not to be vacuous.
"""

from __future__ import annotations

import copy
import itertools
import math
import multiprocessing
import os
import time

import numpy as np
import pytest

import nereus
from nereus.ir import Cluster, Layout, Link, Model, Module, Plan, Stage, Workload
from nereus.ir.model import even_split
from nereus.ir.verifier import flush_samples, replicas_share_steps
from nereus.passes.cost.cost_model import C_PCIE, Candidates, CostModel
from nereus.passes.cost.estimate import estimate_plan

GIB = 2**30
JOBS = 208
TIME_LIMIT = 120  # seconds per plan-search; small jobs are proven in well under a second


# ---------------------------------------------------------------------------- random jobs


def random_job(rng: np.random.Generator) -> Module:
    # mostly up to 8 GPUs (CP-SAT proves those in well under a second), some 12 to 16
    sizes = [(1, 4), (1, 6), (1, 8), (2, 2), (2, 3), (2, 4), (2, 6), (2, 8)]
    nodes, per_node = sizes[rng.choice(8, p=[0.2, 0.15, 0.15, 0.17, 0.17, 0.12, 0.02, 0.02])]
    total = nodes * per_node
    down = []
    if rng.random() < 0.3:
        down = sorted(int(g) for g in rng.choice(total, size=int(rng.integers(1, 3)), replace=False))
    if total - len(down) < 3:
        down = []
    cluster = Cluster(
        name="c",
        nodes=nodes,
        gpus_per_node=per_node,
        gpu_memory=int(rng.choice([0.5, 1, 2, 4, 8, 24], p=[0.15, 0.2, 0.2, 0.15, 0.1, 0.2]) * GIB),
        peak_flops=float(rng.choice([312e12, 989e12])),
        hbm_bandwidth=2e12,
        intra_node=Link(300e9, 2e-6),
        inter_node=Link(25e9, 5e-6),
        host_link=Link(25e9, 10e-6),
        host_memory=1024 * GIB,
        unavailable=down,
    )
    heads = int(rng.choice([4, 8]))
    hidden = heads * int(rng.choice([64, 128]))
    layers = int(rng.integers(2, 7))
    kv = int(rng.choice([2, 4, heads]))
    actor = Model(
        name="actor", layers=layers, hidden=hidden, heads=heads, kv_heads=kv, ffn=3 * hidden, vocab=32000, trained=True
    )
    ref = Model(name="ref", layers=layers, hidden=hidden, heads=heads, kv_heads=kv, ffn=3 * hidden, vocab=32000)
    shape = ["gen-train", "gen-infer-train", "gen-infer2-train"][rng.integers(3)]
    stages = [Stage(name="generate", kind="generate", models=["actor"])]
    if shape == "gen-infer-train":
        stages.append(Stage(name="infer", kind="infer", models=["ref"]))
    elif shape == "gen-infer2-train":
        stages.append(Stage(name="infer", kind="infer", models=["actor", "ref"]))
    stages.append(Stage(name="train", kind="train", models=["actor"]))
    gb, group = int(rng.choice([4, 8, 16])), int(rng.integers(2, 5))
    samples = gb * group
    pmean = int(rng.choice([128, 256, 384]))
    rmean = int(rng.choice([128, 256, 512]))
    w = Workload(
        name="w",
        algorithm="grpo",
        roles=["actor", "ref"] if shape != "gen-train" else ["actor"],
        global_batch=gb,
        group_size=group,
        prompt_len_mean=pmean,
        prompt_len_max=512,
        response_len_mean=rmean,
        response_len_max=2 * rmean,
        micro_batch=int(rng.choice([1, 2])),
        mini_batch=None if rng.random() < 0.5 else samples // 2,
        stages=stages,
    )
    models = {"actor": actor, "ref": ref} if shape != "gen-train" else {"actor": actor}
    return Module(clusters={"c": cluster}, models=models, workloads={"w": w})


def random_knobs(rng: np.random.Generator, gpus: int) -> dict:
    """A random subset of the knob values; TP, PP, DP and placements are enumerated in full."""
    subsets = [list(s) for r in range(4) for s in itertools.combinations(["weights", "grads", "optimizer"], r)]
    train_offload = [subsets[i] for i in sorted(rng.choice(len(subsets), size=int(rng.integers(1, 3)), replace=False))]
    if [] not in train_offload and rng.random() < 0.6:  # often the fastest choice is within reach, so ties are common
        train_offload = [[]] + train_offload[:1]
    if rng.random() < 0.35 and gpus <= 8:  # every value but offload sets: the enumerator then reaches the optimum
        return {
            "zero": [0, 1, 2, 3],
            "recompute": [False, True],
            "train_offload": [[]] + train_offload[-1:],
            "fwd_offload": [[], ["weights"]],
            "mb": [1, 2, 3, 4, 6, 8, 16, 64],
        }
    return {
        "zero": sorted(int(z) for z in rng.choice(4, size=int(rng.integers(1, 3)), replace=False)),
        "recompute": [[False], [True], [False, True]][rng.integers(3)],
        "train_offload": train_offload,
        "fwd_offload": [[[]], [["weights"]], [[], ["weights"]]][rng.choice(3, p=[0.4, 0.2, 0.4])],
        "mb": sorted(
            int(v) for v in rng.choice([1, 2, 3, 4, 6, 8, 16, 64], size=int(rng.integers(2, 4)), replace=False)
        ),
    }


# ---------------------------------------------------------------------------- the enumerator


def gpu_line(cluster: Cluster) -> list[int]:
    """Available GPUs in a line: whole nodes first, then nodes with failed GPUs, ids in order."""
    down, g = set(cluster.unavailable), cluster.gpus_per_node
    whole, broken = [], []
    for node in range(cluster.nodes):
        free = [x for x in range(node * g, (node + 1) * g) if x not in down]
        (whole if len(free) == g else broken).extend(free)
    return whole + broken


def shapes(model: Model, kind: str, w: Workload, cluster: Cluster, n: int, knobs: dict):
    """(tp, pp, dp, micro_batches, recompute, zero) of one model-stage, offload aside."""
    gpn = cluster.gpus_per_node
    for tp in range(1, min(gpn, n) + 1):
        if model.heads % tp or (tp % model.kv_heads and model.kv_heads % tp):
            continue
        for pp in range(1, min(model.layers, n) + 1):
            if tp * pp > n:
                break
            for dp in range(1, n // (tp * pp) + 1):
                g = tp * pp * dp
                if dp > w.samples:
                    break
                if not replicas_share_steps(w, kind, dp):  # the job's rule (Megatron-LM, verl), not the search's
                    continue
                if not (g <= 2 * gpn or g % gpn == 0 or dp & (dp - 1) == 0 or dp == n // (tp * pp)):
                    continue
                if kind == "generate" or pp == 1:
                    mbs = [1]
                else:
                    most = flush_samples(w, kind) // dp // w.micro_batch
                    if most < 1:
                        continue
                    mbs = sorted({min(v, most) for v in knobs["mb"]})
                for mb in mbs:
                    for rc in knobs["recompute"] if kind == "train" else [False]:
                        for z in knobs["zero"] if kind == "train" and dp > 1 else [0]:
                            yield tp, pp, dp, mb, rc, z


class Enumerator:
    def __init__(self, m: Module, knobs: dict):
        self.m, self.knobs = m, knobs
        self.cluster, self.w = m.clusters["c"], m.workloads["w"]
        self.cost = CostModel(self.cluster)
        self.coeffs = self.cost.coeffs
        self.line = gpu_line(self.cluster)
        self.n = len(self.line)
        self.kinds = {ms: st.kind for st in self.w.stages for ms in st.model_stages()}
        self._cands: dict = {}
        self._gen: dict = {}

    def layout(self, ms: str, start: int, tp, pp, dp, mb, rc, z, off) -> Layout:
        model = self.m.models[ms.rpartition(".")[0]]
        ranges = [(lo, hi - 1) for lo, hi in (even_split(model.layers, pp, r) for r in range(pp))]
        return Layout(
            model_stage=ms,
            tp=tp,
            pp=pp,
            dp=dp,
            layers=ranges,
            mesh=self.line[start : start + tp * pp * dp],
            micro_batches=mb,
            zero=z,
            recompute=rc,
            offload=list(off),
        )

    def candidates(self, ms: str, start: int) -> list[dict]:
        """Every layout of ``ms`` whose run begins at line position ``start``, costed alone
        (no resident state of others). Generation's time is recomputed per resident amount."""
        key = (ms, start)
        if key in self._cands:
            return self._cands[key]
        kind = self.kinds[ms]
        model = self.m.models[ms.rpartition(".")[0]]
        base = [s for s in shapes(model, kind, self.w, self.cluster, self.n - start, self.knobs)]
        out = []
        if base:
            lays = [self.layout(ms, start, *s, ()) for s in base]
            cs = [Candidates.of_layout(self.cluster, lay) for lay in lays]
            c = Candidates(**{f: np.concatenate([getattr(x, f) for x in cs]) for f in Candidates.__dataclass_fields__})
            sc = self.cost.stage(model, self.w, kind, c)
            times = sc.time(self.coeffs)
            own = sc.memory()
            offsets = self.knobs["train_offload"] if kind == "train" else self.knobs["fwd_offload"]
            for i, s in enumerate(base):
                parts = {"weights": sc.weights[i], "grads": sc.grads[i], "optimizer": sc.optimizer[i]}
                for off in offsets:
                    off_bytes = float(sum(parts[k] for k in off))
                    extra = 0.0
                    if off_bytes:
                        feat, lat = self.cost.offload_time(off_bytes)
                        extra = feat * self.coeffs[C_PCIE] + lat
                    out.append(
                        dict(
                            ms=ms,
                            start=start,
                            shape=s,
                            off=tuple(off),
                            g=s[0] * s[1] * s[2],
                            time=float(times[i]) + extra,
                            own=float(own[i]),
                            offx=extra,
                            kept=float(sc.resident_state[i]) - off_bytes,
                        )
                    )
        if kind != "generate":
            out = [o for o in out if o["own"] <= self.cluster.gpu_memory and np.isfinite(o["time"])]
            out = self.pareto(out)
        out.sort(key=lambda o: o["time"])
        self._cands[key] = out
        return out

    def all_starts(self, ms: str) -> list[dict]:
        return sorted((o for start in range(self.n) for o in self.candidates(ms, start)), key=lambda o: o["time"])

    @staticmethod
    def pareto(cands: list[dict]) -> list[dict]:
        """Same GPUs, no more time, no more own peak, no more resident state: enough to keep one.
        (Not used for generation, whose time depends on what others keep on its GPUs.)"""
        keep = []
        by_run: dict = {}
        for o in cands:
            by_run.setdefault((o["start"], o["g"]), []).append(o)
        for group in by_run.values():
            group.sort(key=lambda o: (o["time"], o["own"], o["kept"]))
            kept: list[dict] = []
            for o in group:
                if not any(k["time"] <= o["time"] and k["own"] <= o["own"] and k["kept"] <= o["kept"] for k in kept):
                    kept.append(o)
            keep += kept
        return keep

    def gen_cost(self, o: dict, resident: float) -> tuple[float, float]:
        """(time, own peak) of a generation candidate with ``resident`` bytes of others on its fullest GPU."""
        key = (o["ms"], o["start"], o["shape"], resident)
        if key not in self._gen:
            lay = self.layout(o["ms"], o["start"], *o["shape"], ())
            c = Candidates.of_layout(self.cluster, lay, resident=resident)
            sc = self.cost.stage(self.m.models[lay.model], self.w, "generate", c)
            self._gen[key] = (float(sc.time(self.coeffs)[0]), float(sc.memory()[0]))
        t, own = self._gen[key]
        return t + o["offx"], own

    def stage_configs(self, st: Stage) -> list[tuple[float, list[dict], list[list[str]]]]:
        """(time, members, colocate) of every placement of a non-generate stage: set partitions of
        its model-stages into groups, groups packed from position 0 in every order (a stage of one
        model-stage: every start)."""
        mss = st.model_stages()
        if len(mss) == 1:  # one group: every start of its run
            return sorted(((o["time"], [o], []) for o in self.all_starts(mss[0])), key=lambda c: c[0])
        assert len(mss) == 2
        a, b = mss
        out = []
        M = self.cluster.gpu_memory
        # one group: both start at 0 and run one after another
        for oa in self.candidates(a, 0):
            for ob in self.candidates(b, 0):
                if oa["own"] + ob["kept"] <= M and ob["own"] + oa["kept"] <= M:
                    out.append((oa["time"] + ob["time"], [oa, ob], [[a, b]]))
        # two groups, disjoint runs, in either order
        for x, y in ((a, b), (b, a)):
            for ox in self.candidates(x, 0):
                for oy in self.candidates(y, ox["g"]):
                    out.append((max(ox["time"], oy["time"]), [ox, oy], []))
        out.sort(key=lambda c: c[0])
        return out

    @staticmethod
    def covers(o: dict, pos: int) -> bool:
        return o["start"] <= pos < o["start"] + o["g"]

    def resident_of(self, o: dict, others: list[dict]) -> float:
        """Most bytes the others keep on one GPU of ``o``'s run."""
        return max(sum(x["kept"] for x in others if self.covers(x, p)) for p in range(o["start"], o["start"] + o["g"]))

    def fits(self, chosen: list[dict]) -> bool:
        M = self.cluster.gpu_memory
        for i, o in enumerate(chosen):
            if self.kinds[o["ms"]] == "generate":
                continue  # its peak depends on the resident state: checked in ``leaf``
            if o["own"] + self.resident_of(o, chosen[:i] + chosen[i + 1 :]) > M:
                return False
        return True

    def search(self):
        """Branch and bound over stage configurations; returns (step time, members, colocate) or None."""
        stages = self.w.stages
        gen = [st for st in stages if st.kind == "generate"]
        assert len(gen) == 1 and len(gen[0].models) == 1
        gen_ms = gen[0].model_stages()[0]
        gens = self.all_starts(gen_ms)
        rest = [self.stage_configs(st) for st in stages if st.kind != "generate"]
        self.fastest = (gens[:1], [r[:1] for r in rest])
        if not gens or not all(rest):
            return None
        gen_free = [(self.gen_cost(o, 0.0)[0], o) for o in gens]  # resident 0: a lower bound on time
        gen_free.sort(key=lambda x: x[0])
        lb_gen = gen_free[0][0]
        mins = [r[0][0] for r in rest]
        best = [math.inf, None, None]
        M = self.cluster.gpu_memory

        def leaf(members: list[dict], colocate, t_rest: float):
            for t0, og in gen_free:
                if t0 + t_rest >= best[0]:
                    return
                r = self.resident_of(og, members)
                t, own = self.gen_cost(og, r)
                if not np.isfinite(t) or own + r > M or t + t_rest >= best[0]:
                    continue
                chosen = members + [og]
                if self.fits(chosen):
                    best[:] = [t + t_rest, chosen, colocate]

        def dfs(level: int, members: list[dict], colocate, t_acc: float):
            if level == len(rest):
                leaf(members, colocate, t_acc)
                return
            tail = sum(mins[level + 1 :])
            for t, mem, col in rest[level]:
                if t_acc + t + tail + lb_gen >= best[0]:
                    return
                chosen = members + mem
                if self.fits(chosen):
                    dfs(level + 1, chosen, colocate + col, t_acc + t)

        dfs(0, [], [], 0.0)
        return None if best[1] is None else tuple(best)

    def plan(self, name: str, members: list[dict], colocate) -> Plan:
        p = Plan(name=name, workload="w", cluster="c", colocate=[list(g) for g in colocate])
        for o in sorted(members, key=lambda o: self.w.model_stages().index(o["ms"])):
            p.layouts[o["ms"]] = self.layout(o["ms"], o["start"], *o["shape"], o["off"])
        return p


# ---------------------------------------------------------------------------- the property


def job_text(m: Module, *plans: Plan) -> str:
    shown = copy.deepcopy(m)
    for p in plans:
        if p is not None:
            shown.plans[p.name] = copy.deepcopy(p)
    return nereus.print_ir(shown)


def check_job(job: int) -> tuple[dict, str | None]:
    """One random job: (counts, failure text or None)."""
    rng = np.random.default_rng([20261130, job])
    counts = dict.fromkeys(("jobs", "feasible", "infeasible", "memory_bound", "colocated", "tied"), 0)
    m = random_job(rng)
    knobs = random_knobs(rng, len(m.clusters["c"].available_gpus()))
    counts["jobs"] = 1
    t0 = time.perf_counter()
    try:
        _check(m, knobs, counts)
    except AssertionError as err:
        return counts, f"job {job}: {err}"
    finally:
        counts["seconds"] = time.perf_counter() - t0
    return counts, None


def _check(m: Module, knobs: dict, counts: dict) -> None:
    assert len(m.workloads["w"].model_stages()) <= 4 and len(m.clusters["c"].available_gpus()) <= 16
    nereus.verify(m)
    e = Enumerator(m, knobs)
    found = e.search()
    enum_plan = None
    if found is not None:
        t_enum, members, colocate = found
        enum_plan = e.plan("w_enumerated", members, colocate)
        probe = copy.deepcopy(m)
        probe.plans[enum_plan.name] = enum_plan
        nereus.verify(probe)
        assert estimate_plan(probe, enum_plan) == [], "enumerator's plan does not fit:\n" + job_text(m, enum_plan)
        assert enum_plan.step_time == pytest.approx(t_enum, rel=1e-4), (
            "enumerator's arithmetic differs from estimate:\n" + job_text(m, enum_plan)
        )
        counts["feasible"] += 1
        counts["colocated"] += bool(enum_plan.colocate)
        # memory-bound: the fastest choice stage by stage, memory aside, does not fit
        gens, rests = e.fastest
        fast = e.plan("w_fastest", gens + [o for r in rests for o in r[0][1]], [g for r in rests for g in r[0][2]])
        probe.plans[fast.name] = fast
        counts["memory_bound"] += bool(estimate_plan(probe, fast))
    else:
        counts["infeasible"] += 1
    searched = copy.deepcopy(m)
    try:
        # a generous time limit: the property is about the optimum, not about the solver's speed
        # (a loaded machine must not turn a proof into a time-out)
        nereus.run_pipeline(
            searched, f"plan-search{{time_limit={TIME_LIMIT},headroom=0}}"
        )  # the enumerator fills GPUs to 100%
    except nereus.DiagnosticError as err:
        text = str(err) + " " + " ".join(d.message for d in getattr(err, "diagnostics", []))
        assert "no plan fits" in text, f"plan-search failed otherwise: {text}\n" + job_text(m, enum_plan)
        assert enum_plan is None, (
            f"plan-search says no plan fits, but the enumerator found one with step_time "
            f"{enum_plan.step_time}:\n{job_text(m, enum_plan)}\nknobs: {knobs}\n{text}"
        )
        return
    s = searched.plans["w_searched"]
    assert s.search is not None
    if enum_plan is not None:
        # the solver's bound is a lower bound on every plan's step time, the enumerator's included
        assert s.search.bound <= enum_plan.step_time * (1 + 1e-4), (
            f"plan-search's bound ({s.search.bound} s) exceeds the enumerator's plan ({enum_plan.step_time} s):\n"
            f"{job_text(searched, enum_plan)}\nknobs: {knobs}"
        )
        assert s.step_time <= enum_plan.step_time * (1 + 1e-4), (
            f"plan-search's plan ({s.step_time} s) is slower than the enumerator's ({enum_plan.step_time} s):\n"
            f"{job_text(searched, enum_plan)}\nknobs: {knobs}"
        )
        counts["tied"] += s.step_time >= enum_plan.step_time * (1 - 1e-4)  # the enumerator reached the optimum
    assert estimate_plan(searched, s) == [], job_text(searched, enum_plan)
    nereus.verify(searched)
    assert s.search.estimate_gap is not None and abs(s.search.estimate_gap) < 1e-3, (
        f"estimate_gap {s.search and s.search.estimate_gap}:\n" + job_text(searched, enum_plan)
    )


def test_plan_search_is_never_beaten_by_an_independent_enumerator():
    """208 random jobs, on two worker processes (CP-SAT runs one worker per solve)."""
    workers = max(1, min(2, os.cpu_count() or 1))
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers) as pool:
        results = pool.map(check_job, range(JOBS), chunksize=4)
    total = {k: sum(c[k] for c, _ in results) for k in results[0][0] if k != "seconds"}
    failures = [f for _, f in results if f]
    slowest = sorted(((c["seconds"], j) for j, (c, _) in enumerate(results)), reverse=True)[:5]
    print(f"totals: {total}; slowest jobs (s, job): " + ", ".join(f"({t:.1f}, {j})" for t, j in slowest))
    assert not failures, f"{len(failures)} of {JOBS} jobs failed; first ones:\n" + "\n\n".join(failures[:3])
    assert total["jobs"] >= 200
    assert total["feasible"] >= 150, total  # not vacuous: most jobs have a plan that fits
    assert total["memory_bound"] >= 5, total  # and memory binds in some
