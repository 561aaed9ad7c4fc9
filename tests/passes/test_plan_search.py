"""plan-search: the CP-SAT optimum equals brute force, plans verify and fit, infeasible is a diagnostic."""

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

import nereus
from nereus.ir import Cluster, Link, Model, Module, Stage, Workload
from nereus.passes.search.plan_search import solve, to_plan
from nereus.passes.search.space import Option, build_problem, prune, set_partitions

from ..support import EXAMPLES
from ..support.brute_force import brute_force

GIB = 2**30


def test_set_partitions_are_bell_many_and_distinct():
    for k, bell in [(1, 1), (2, 2), (3, 5), (4, 15)]:
        parts = set_partitions([f"m{i}" for i in range(k)])
        assert len(parts) == bell
        assert len({tuple(sorted(tuple(sorted(g)) for g in p)) for p in parts}) == bell


@st.composite
def instances(draw):
    """Small jobs: up to 16 GPUs, 2 to 4 model-stages, memory tight enough to bind."""
    nodes = draw(st.integers(1, 2))
    per_node = draw(st.sampled_from([2, 4, 8]))
    assume(nodes * per_node <= 16)
    down = draw(st.lists(st.integers(0, nodes * per_node - 1), max_size=2, unique=True))
    cluster = Cluster(
        name="c",
        nodes=nodes,
        gpus_per_node=per_node,
        gpu_memory=draw(st.sampled_from([4, 8, 16, 24])) * GIB,
        peak_flops=draw(st.sampled_from([312e12, 989e12])),
        hbm_bandwidth=2e12,
        intra_node=Link(300e9, 2e-6),
        inter_node=Link(25e9, 5e-6),
        host_link=Link(25e9, 10e-6),
        unavailable=sorted(down),
    )
    heads = draw(st.sampled_from([8, 16]))
    hidden = heads * 128
    layers = draw(st.sampled_from([4, 8, 16]))
    actor = Model(
        name="actor",
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=draw(st.sampled_from([2, heads])),
        ffn=hidden * 3,
        vocab=32000,
        trained=True,
    )
    ref = Model(
        name="ref", layers=layers, hidden=hidden, heads=heads, kv_heads=actor.kv_heads, ffn=hidden * 3, vocab=32000
    )
    if draw(st.booleans()):  # mixtures of experts: the search also tries expert parallelism
        experts = draw(st.sampled_from([4, 8]))
        actor, ref = (replace(md, experts=experts, experts_per_token=2, expert_ffn=hidden) for md in (actor, ref))
    shape = draw(st.sampled_from(["gen-train", "gen-infer2-train", "gen-infer-train"]))
    stages = [Stage(name="generate", kind="generate", models=["actor"])]
    if shape == "gen-infer2-train":
        stages.append(Stage(name="infer", kind="infer", models=["actor", "ref"]))
    elif shape == "gen-infer-train":
        stages.append(Stage(name="infer", kind="infer", models=["ref"]))
    stages.append(Stage(name="train", kind="train", models=["actor"]))
    # a mini-batch smaller than the step bounds a training pipeline's flush (the verifier checks it)
    w = Workload(
        name="w",
        algorithm="grpo",
        roles=["actor", "ref"],
        global_batch=draw(st.sampled_from([8, 16, 32])),
        group_size=4,
        prompt_len_mean=256,
        prompt_len_max=512,
        response_len_mean=draw(st.sampled_from([256, 1024])),
        response_len_max=2048,
        micro_batch=2,
        mini_batch=draw(st.sampled_from([None, 8, 16])),
        stages=stages,
    )
    return cluster, w, {"actor": actor, "ref": ref}


def _module(cluster, w, models) -> Module:
    return Module(clusters={cluster.name: cluster}, models=dict(models), workloads={w.name: w})


def test_expert_parallelism_is_costed_on_the_mesh_the_search_places_it_on():
    """Found by the property below: GPUs 1 and 3 of two 2-GPU nodes are all that is left, so an
    EP 2 layout's all-to-all crosses the NIC. The search must cost it there, as ``estimate`` does
    for the placed plan (it once took the canonical, one-node mesh and was 6% optimistic)."""
    cluster = Cluster(
        name="c",
        nodes=2,
        gpus_per_node=2,
        gpu_memory=4 * GIB,
        peak_flops=312e12,
        hbm_bandwidth=2e12,
        intra_node=Link(300e9, 2e-6),
        inter_node=Link(25e9, 5e-6),
        host_link=Link(25e9, 10e-6),
        unavailable=[0, 2],
    )
    shape = dict(layers=4, hidden=1024, heads=8, kv_heads=2, ffn=3072, vocab=32000)
    moe = dict(experts=4, experts_per_token=2, expert_ffn=1024)
    models = {
        "actor": Model(name="actor", trained=True, **shape, **moe),
        "ref": Model(name="ref", **shape, **moe),
    }
    w = Workload(
        name="w",
        algorithm="grpo",
        roles=["actor", "ref"],
        global_batch=8,
        group_size=4,
        prompt_len_mean=256,
        prompt_len_max=512,
        response_len_mean=1024,
        response_len_max=2048,
        micro_batch=2,
        stages=[
            Stage(name="generate", kind="generate", models=["actor"]),
            Stage(name="train", kind="train", models=["actor"]),
        ],
    )
    # without PP: two pipeline stages over the NIC with full recomputation take no more time, peak or
    # resident state than EP 2 here, and prune it away
    problem = build_problem(cluster, w, models, max_tp=2, max_pp=1, max_zero=2, offload=False)
    exact, _, _, _ = brute_force(problem, limit=300_000)
    sol = solve(problem, time_limit=30)
    assert sol.status == "optimal" and sol.objective == exact
    m = _module(cluster, w, models)
    plan = m.plans["p"] = to_plan(problem, sol, "p", w.name, cluster.name)
    nereus.verify(m)
    from nereus.passes.cost.estimate import estimate_plan

    assert estimate_plan(m, plan) == []
    assert abs(sol.objective * problem.unit_s - plan.step_time) <= 2 * problem.unit_s + 1e-4 * plan.step_time
    # and the search did weigh expert parallelism over the NIC here
    carved = [o for sp in problem.spaces.values() for o in sp.options if o.ep > 1]
    assert carved


@st.composite
def small_instances(draw):
    """Jobs small enough for brute force over every option, start and grouping: up to 8 GPUs,
    2-3 model-stages, one layer pair."""
    cluster, w, models = draw(instances())
    assume(len(cluster.available_gpus()) <= 6 and len(w.model_stages()) <= 3)
    return cluster, w, models


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(small_instances())
def test_solver_optimum_equals_brute_force_and_plans_fit(inst):
    cluster, w, models = inst
    problem = build_problem(cluster, w, models, max_tp=2, max_pp=2, max_zero=2, offload=False)
    try:
        exact, _, _, _ = brute_force(problem, limit=300_000)
    except ValueError:
        assume(False)
    sol = solve(problem, time_limit=30)
    event("feasible" if exact is not None else "infeasible")
    if exact is None:
        assert sol.status == "infeasible"
        return
    assert sol.status == "optimal"
    assert sol.objective == exact
    assert problem.evaluate(sol.choice, sol.start, sol.partition) == exact
    m = _module(cluster, w, models)
    plan = to_plan(problem, sol, "p", w.name, cluster.name)
    m.plans["p"] = plan
    nereus.verify(m)  # a valid plan: meshes on available GPUs, colocation declared, layers covered, flushes
    # that a pipeline can run (no more micro-batches than a mini-batch holds)
    from nereus.passes.cost.estimate import estimate_plan

    assert estimate_plan(m, plan) == []  # and it fits in memory on every GPU
    # the solver's objective is estimate's step time of the placed plan, up to integer rounding
    assert (
        abs(sol.objective * problem.unit_s - plan.step_time)
        <= len(problem.spaces) * problem.unit_s + 1e-4 * plan.step_time
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(small_instances())
def test_pruning_keeps_the_optimum(inst):
    """Brute force over every candidate and over the pruned ones finds the same optimum."""
    cluster, w, models = inst
    from nereus.passes.search import space as search_space

    kw = dict(max_tp=2, max_pp=2, max_zero=2, offload=False)
    pruned = build_problem(cluster, w, models, **kw)
    original = search_space.prune_rows
    try:
        search_space.prune_rows = lambda gpus, *rest: np.arange(len(gpus))
        unpruned = build_problem(cluster, w, models, **kw)
    finally:
        search_space.prune_rows = original
    assert unpruned.unit_s == pruned.unit_s  # the time unit is fixed before pruning
    try:
        assert brute_force(unpruned, limit=300_000)[0] == brute_force(pruned, limit=300_000)[0]
    except ValueError:
        assume(False)


def test_prune_drops_only_dominated():
    def o(gpus, time, peak, res, rho=1 << 40, classes=(0,)):
        return Option(
            1,
            1,
            gpus,
            1,
            False,
            0,
            (),
            rho,
            gpus,
            {k: float(time) for k in classes},
            {k: time for k in classes},
            peak,
            res,
        )

    a, b, c, d = o(4, 10, 20, 5), o(4, 12, 20, 5), o(8, 8, 20, 5), o(2, 30, 30, 2)
    assert prune([a, b, c, d]) == [a, c, d]  # b: same GPUs, slower, no smaller
    e = o(2, 5, 20, 5, classes=(0,))  # fewer GPUs and faster, but it cannot start where f can
    f = o(4, 10, 20, 5, classes=(0, 9))
    assert prune([e, f]) == [e, f]
    g = o(2, 5, 20, 5, classes=(0, 9))
    assert prune([g, f]) == [g]


def test_same_input_and_seed_give_identical_plan():
    text = next(p for p in EXAMPLES if p.name == "ppo_8b_16gpu.nir").read_text()
    outs = []
    for _ in range(2):
        m = nereus.parse(text)
        nereus.run_pipeline(m, "plan-search{seed=3}")
        outs.append(nereus.print_ir(m))
    assert outs[0] == outs[1]
    m = nereus.run_pipeline(nereus.parse(outs[0]), "estimate")  # the hand-written plan gets its step time too
    s, hand = m.plans["ppo_searched"], m.plans["ppo_p0"]
    assert s.search.status == "optimal" and s.search.gap == 0.0 and s.step_time > 0
    assert hand.step_time is not None and s.step_time < hand.step_time


def test_infeasible_names_the_tightest_model_stage():
    text = next(p for p in EXAMPLES if p.name == "ppo_70b_1024gpu.nir").read_text()
    text = text.replace("nodes = 128", "nodes = 1")  # 70B models on 8 GPUs
    text = text[: text.index("plan @")]  # no plan: only the job
    m = nereus.parse(text, "tiny.nir")
    with pytest.raises(nereus.DiagnosticError) as e:
        nereus.run_pipeline(m, "plan-search")
    (d,) = e.value.diagnostics
    assert d.message.startswith("no plan fits: ")
    assert "needs at least" in d.message or "would need" in d.message
    assert any(ms in d.message for ms in ("actor.train", "critic.train", "actor.generate"))
    assert "GiB" in d.message and d.loc.line > 0


def test_time_limit_without_proof_says_so(capsys):
    from nereus.cli import main

    path = next(p for p in EXAMPLES if p.name == "ppo_70b_1024gpu.nir")
    status = main(["opt", str(path), "-p", "plan-search{time_limit=0.3}"])
    out, err = capsys.readouterr()
    warning = "warning: plan-search stopped at time_limit=0.3 s without proving optimality"
    if status == 0:  # a plan: the warning exactly when the plan is not proven optimal
        (searched,) = [p for p in nereus.parse(out).plans.values() if p.search is not None]
        if searched.search.status == "optimal":
            assert warning not in err
        else:
            assert searched.search.status == "feasible" and warning in err
    else:  # not even a first plan in 0.3 s: a diagnostic, never an 'infeasible' claim
        assert "found no plan within time_limit=0.3 s" in err and "no plan fits" not in err


def test_feasible_but_unproven_plan_is_returned_with_its_gap_and_a_warning(monkeypatch, capsys):
    """Past the time limit CP-SAT returns its best plan and bound; the pass keeps the plan, records
    status feasible and the gap, and the command line prints a warning."""
    from nereus.cli import main
    from nereus.passes.search import plan_search

    real = plan_search.solve

    def stopped_early(problem, time_limit, seed, known=None, deterministic=False):
        sol = real(problem, time_limit, seed, known, deterministic)
        return plan_search.Solution(
            "feasible", sol.objective, int(sol.objective * 0.97), sol.choice, sol.start, sol.partition
        )

    monkeypatch.setattr(plan_search, "solve", stopped_early)
    path = next(p for p in EXAMPLES if p.name == "grpo_7b_8gpu.nir")
    assert main(["opt", str(path), "-p", "plan-search"]) == 0
    out, err = capsys.readouterr()
    assert "search = search(status = feasible" in out and "gap = 0.03" in out
    assert "warning: plan-search stopped at time_limit=10 s without proving optimality: the plan is within 3.00%" in err


@pytest.mark.parametrize("samples", [1, 2, 3, 7.5, 10, 100, 1023, 4096.0, 12345.6])
def test_wave_sizes_are_every_distinct_ceiling(samples):
    from nereus.passes.search.space import wave_sizes

    assert wave_sizes(samples) == {math.ceil(samples / w) for w in range(1, math.ceil(samples) + 1)}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(small_instances())
def test_step_time_bounds_hold_for_every_plan(inst):
    """``search.bounds``: for every plan that fits, each option's bound plus the other stages'
    bounds is at most the plan's step time, so ``restrict`` to a cap keeps every plan under it."""
    import itertools

    from nereus.passes.search.bounds import option_bounds, restrict, stage_bounds

    cluster, w, models = inst
    problem = build_problem(cluster, w, models, max_tp=2, max_pp=2, max_zero=2, offload=False)
    bounds = option_bounds(problem)
    lower = stage_bounds(problem, bounds)
    names = list(problem.spaces)
    per_ms = [
        [
            (c, s)
            for c, o in enumerate(problem.spaces[ms].options)
            for k in o.times
            for s in problem.positions.starts(k, o.gpus)
        ]
        for ms in names
    ]
    assume(
        all(per_ms)
        and math.prod(map(len, per_ms)) * math.prod(len(problem.partitions[s]) for s, _ in problem.stages) < 200_000
    )
    stage_of = {ms: st for st, mss in problem.stages for ms in mss}
    best = None
    for k in itertools.product(*(range(len(problem.partitions[s])) for s, _ in problem.stages)):
        partition = {s: ki for (s, _), ki in zip(problem.stages, k)}
        for combo in itertools.product(*per_ms):
            choice = {ms: c for ms, (c, _) in zip(names, combo)}
            v = problem.evaluate(choice, {ms: s for ms, (_, s) in zip(names, combo)}, partition)
            if v is None:
                continue
            best = v if best is None else min(best, v)
            for ms, c in choice.items():
                assert bounds[ms][c] + sum(lower.values()) - lower[stage_of[ms]] <= v
    event("feasible" if best is not None else "infeasible")
    if best is not None:  # the cap at the optimum keeps an optimal plan: brute force on it agrees
        sub = restrict(problem, bounds, best)
        assert brute_force(sub[0] if sub else problem, limit=300_000)[0] == best


@st.composite
def synthetic_problems(draw):
    """A stage of three or four model-stages side by side (where the GPU-time bound adds to the
    pairs' bounds) and a second stage of one, with drawn candidates: GPU counts, a time per start
    class, peak and resident memory tight enough to bind. Small enough to enumerate every plan."""
    from nereus.passes.search.space import NO_RHO, Positions, SearchProblem, Space

    nodes, per_node = draw(st.sampled_from([(1, 2), (1, 4), (2, 2)]))
    cluster = Cluster(
        name="c",
        nodes=nodes,
        gpus_per_node=per_node,
        gpu_memory=GIB,
        peak_flops=1e15,
        hbm_bandwidth=2e12,
        intra_node=Link(300e9, 2e-6),
        inter_node=Link(25e9, 5e-6),
    )
    pos = Positions.of(cluster)
    members = [f"m{i}.infer" for i in range(draw(st.integers(3, 4)))]
    spaces = {}
    for ms in members + ["t.train"]:
        opts = []
        for _ in range(draw(st.integers(1, 3 if len(members) == 3 else 2))):
            g = draw(st.integers(1, pos.n))
            times = {k: draw(st.integers(1, 40)) for k in pos.classes(g)}
            resident = draw(st.integers(0, 6))
            opts.append(
                Option(
                    1,
                    1,
                    g,
                    1,
                    False,
                    0,
                    (),
                    NO_RHO,
                    g,
                    {k: float(v) for k, v in times.items()},
                    times,
                    resident + draw(st.integers(0, 6)),
                    resident,
                )
            )
        spaces[ms] = Space(ms, ms.rpartition(".")[2], opts, len(opts))
    stages = [("infer", members), ("train", ["t.train"])]
    problem = SearchProblem(cluster, None, {}, pos, 1.0, draw(st.integers(8, 16)), stages, spaces)
    problem.partitions = {name: set_partitions(mss) for name, mss in stages}
    return problem


def _every_plan(problem):
    import itertools

    names = list(problem.spaces)
    per_ms = [
        [
            (c, s)
            for c, o in enumerate(problem.spaces[ms].options)
            for k in o.times
            for s in problem.positions.starts(k, o.gpus)
        ]
        for ms in names
    ]
    for k in itertools.product(*(range(len(problem.partitions[s])) for s, _ in problem.stages)):
        partition = {s: ki for (s, _), ki in zip(problem.stages, k)}
        for combo in itertools.product(*per_ms):
            choice, start = {ms: c for ms, (c, _) in zip(names, combo)}, {ms: s for ms, (_, s) in zip(names, combo)}
            v = problem.evaluate(choice, start, partition)
            if v is not None:
                yield v, choice, start, partition


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(synthetic_problems(), st.randoms(use_true_random=False))
def test_gpu_time_bound_holds_and_a_known_plan_gives_the_same_optimum(problem, rnd):
    """``search.bounds`` on stages of three or four members: every option's bound plus the other
    stages' bounds is at most the step time of every plan that uses it. ``solve`` finds brute
    force's optimum both from scratch and started from any plan of the problem (``known``)."""
    from nereus.passes.search.bounds import option_bounds, stage_bounds
    from nereus.passes.search.plan_search import Solution

    bounds = option_bounds(problem)
    lower = stage_bounds(problem, bounds)
    stage_of = {ms: st for st, mss in problem.stages for ms in mss}
    plans = list(_every_plan(problem))
    for v, choice, _, _ in plans:
        for ms, c in choice.items():
            assert bounds[ms][c] + sum(lower.values()) - lower[stage_of[ms]] <= v
    best = min((p[0] for p in plans), default=None)
    event("feasible" if plans else "infeasible")
    assert solve(problem, time_limit=30).objective == best
    if plans:
        v, choice, start, partition = rnd.choice(plans)
        sol = solve(problem, time_limit=30, known=Solution("feasible", v, None, choice, start, partition))
        assert sol.status == "optimal" and sol.objective == best
        assert problem.evaluate(sol.choice, sol.start, sol.partition) == best


def test_gpu_time_bound_of_four_models_side_by_side():
    """Four inference model-stages that each take least GPU-time on a quarter of the GPUs: the
    pairs alone let each take three quarters of them (a stage bound of 64, the optimum is 100),
    GPU-time does not."""
    from nereus.passes.search.bounds import option_bounds, stage_bounds
    from nereus.passes.search.space import NO_RHO, Positions, SearchProblem, Space

    cluster = Cluster(
        name="c",
        nodes=2,
        gpus_per_node=8,
        gpu_memory=GIB,
        peak_flops=1e15,
        hbm_bandwidth=2e12,
        intra_node=Link(300e9, 2e-6),
        inter_node=Link(25e9, 5e-6),
    )
    pos = Positions.of(cluster)

    def o(g, t):
        return Option(
            1,
            1,
            g,
            1,
            False,
            0,
            (),
            NO_RHO,
            g,
            {k: float(t) for k in pos.classes(g)},
            {k: t for k in pos.classes(g)},
            1,
            0,
        )

    members = [f"m{i}.infer" for i in range(4)]
    spaces = {ms: Space(ms, "infer", [o(4, 100), o(12, 40), o(16, 32)], 3) for ms in members}  # GPU-time 400, 480, 512
    problem = SearchProblem(cluster, None, {}, pos, 1.0, 1 << 20, [("infer", members)], spaces)
    problem.partitions = {"infer": set_partitions(members)}
    assert stage_bounds(problem, option_bounds(problem))["infer"] == 100  # 4 x 400 / 16
    sol = solve(problem, time_limit=30)
    assert sol.objective == 100 and sol.status == "optimal"


def test_search_started_from_the_running_plan_finds_the_same_plan_on_fewer_candidates():
    """``placed`` reads a plan back as a solution of the problem; ``plan-search{incumbent=@p}``
    starts from it. On the 1,024-GPU example, re-searched after the responses grew by a tenth,
    the search from the running plan proves the same optimum on fewer candidates; a plan on other
    GPUs is no solution of the problem; an unknown incumbent is a diagnostic."""
    import copy

    from nereus.passes.search.plan_search import placed

    m = nereus.parse(next(p for p in EXAMPLES if p.name == "ppo_70b_1024gpu.nir").read_text())
    (w,), (c,) = m.workloads.values(), m.clusters.values()
    problem = build_problem(c, w, m.models, prune=False)
    first = solve(problem, time_limit=60)
    plan = to_plan(problem, first, "run", w.name, c.name)
    back = placed(problem, plan)
    assert back is not None and back.objective == first.objective
    assert problem.evaluate(back.choice, back.start, back.partition) == first.objective

    w.response_len_mean = int(w.response_len_mean * 1.1)
    grown = build_problem(c, w, m.models, prune=False)
    cold = solve(grown, time_limit=60)
    warm = solve(grown, time_limit=60, known=placed(grown, plan))
    assert warm.status == cold.status == "optimal" and warm.objective == cold.objective
    assert warm.options < cold.options

    moved = copy.deepcopy(plan)
    lay = next(iter(moved.layouts.values()))
    lay.mesh = [g + 1 for g in lay.mesh]
    assert placed(grown, moved) is None

    m.plans["run"] = plan
    nereus.run_pipeline(m, "plan-search{incumbent=@run,into=@warm},plan-search{into=@cold}")
    warm_plan, cold_plan = m.plans["warm"], m.plans["cold"]
    assert warm_plan.search.status == cold_plan.search.status == "optimal"
    assert warm_plan.search.objective == cold_plan.search.objective and warm_plan.step_time == cold_plan.step_time
    with pytest.raises(nereus.DiagnosticError) as e:
        nereus.run_pipeline(m, "plan-search{incumbent=@rnu}")
    assert "no plan @rnu" in str(e.value) and "did you mean @run?" in str(e.value)


def test_candidates_made_lazily_read_the_same_as_made_options():
    """``OptionRows``: an index makes one ``Option`` (the same object each time, negative indices
    and slices as a list's); ``columns`` of the made options equal the arrays the bounds read."""
    from nereus.passes.search.space import OptionRows, columns

    m = nereus.parse(next(p for p in EXAMPLES if p.name == "ppo_8b_16gpu.nir").read_text())
    (w,), (c,) = m.workloads.values(), m.clusters.values()
    problem = build_problem(c, w, m.models, prune=False)
    for sp in problem.spaces.values():
        rows = sp.options
        assert isinstance(rows, OptionRows) and len(rows) > 1
        assert rows[-1] is rows[len(rows) - 1] and rows[0] is rows[np.int64(0)] and rows[1:3] == [rows[1], rows[2]]
        with pytest.raises(IndexError):
            rows[len(rows)]
        made = columns(list(rows))
        assert made.keys() == rows.columns.keys()
        for k, col in rows.columns.items():
            assert np.array_equal(made[k], col), k


@pytest.mark.parametrize("example", ["ppo_8b_16gpu.nir", "ppo_70b_1024gpu.nir"])
@pytest.mark.parametrize("prune_first", [False, True])
def test_candidates_pruned_by_their_arrays_keep_what_pruning_the_made_options_keeps(example, prune_first):
    """``prune_options`` on ``OptionRows`` (any subset, as ``restrict`` passes the options under
    a cap) reads the arrays and makes no option; it keeps exactly the options that pruning the
    made options keeps."""
    from nereus.passes.search.space import OptionRows, prune_options

    m = nereus.parse(next(p for p in EXAMPLES if p.name == example).read_text())
    (w,), (c,) = m.workloads.values(), m.clusters.values()
    problem = build_problem(c, w, m.models, prune=prune_first)
    rng = np.random.default_rng(0)
    for sp in problem.spaces.values():
        rows = sp.options
        assert isinstance(rows, OptionRows)
        for size in (len(rows), len(rows) // 2, len(rows) // 7):
            among = np.sort(rng.choice(len(rows), size=max(size, 1), replace=False))
            before = len(rows._made)
            got = prune_options(rows, among)
            assert len(rows._made) == before  # nothing made
            assert np.array_equal(got, prune_options([rows[i] for i in among]))


def _wave_points_row_by_row(cost, workload, model, weights, tp, pp, dp, most):
    """``wave_points`` as first written: every row's wave sizes (every concurrency with a
    response-length distribution) and thinning made for it alone."""
    from nereus.passes.cost.cost_model import VLLM_GPU_MEMORY_UTILIZATION
    from nereus.passes.search.space import per_sequence, wave_sizes

    kv_seq, _, samples = per_sequence(workload, model, tp, pp, dp)
    keep, rho = [], []
    for i in range(len(kv_seq)):
        budget = VLLM_GPU_MEMORY_UTILIZATION * cost.cluster.gpu_memory - float(weights[i])
        by_length = range(1, math.ceil(samples[i]) + 1) if workload.response_len_dist else wave_sizes(samples[i])
        need = sorted(by_length, reverse=True)
        points = [budget - c * kv_seq[i] for c in need if budget - c * kv_seq[i] >= 0]
        if len(points) > most:
            idx = sorted({min(len(points) - 1, int(round(x)) - 1) for x in np.geomspace(1, len(points), most)})
            points = [points[j] for j in idx]
        keep += [i] * len(points)
        rho += points
    return np.array(keep, dtype=np.int64), np.array(rho, dtype=float)


@pytest.mark.parametrize(
    "example,response",
    [
        ("ppo_70b_1024gpu.nir", None),
        ("ppo_70b_1024gpu.nir", 9000),
        ("ppo_8b_16gpu.nir", None),
        ("grpo_7b_8gpu.nir", 3000),
    ],
)
def test_wave_points_equal_the_row_by_row_definition(monkeypatch, example, response):
    """The generation candidates (rows and the state others may keep, to the bit) are those of the
    row-by-row ``wave_points``, on a small exhaustive space and the 1,024-GPU one, at two lengths."""
    from nereus.passes.search import space as search_space

    m = nereus.parse(next(p for p in EXAMPLES if p.name == example).read_text())
    (w,) = m.workloads.values()
    (c,) = m.clusters.values()
    if response is not None:
        w.response_len_mean, w.response_len_max = response, max(w.response_len_max, 2 * response)
    fast = build_problem(c, w, m.models, prune=False)
    monkeypatch.setattr(search_space, "wave_points", _wave_points_row_by_row)
    slow = build_problem(c, w, m.models, prune=False)
    generation = [ms for ms, sp in fast.spaces.items() if w.stage_of(ms).kind == "generate"]
    assert generation and any(len(fast.spaces[ms].options) > 1 for ms in generation)
    for ms in fast.spaces:
        a, b = fast.spaces[ms].options, slow.spaces[ms].options
        assert len(a) == len(b)
        assert list(a) == list(b)


def _candidates_row_by_row(cost, pos, workload, model, kind, max_tp, max_pp=0, max_zero=3, offload=True):
    """``candidates`` as first written up to the costing (``costed_rows``, which both share): the grid
    made at every call, each row's offloaded state summed alone, and every row expanded at its
    size's start classes with its links looked up one expansion at a time."""
    from nereus.passes.cost.cost_model import Candidates
    from nereus.passes.search.space import MAX_WAVE_POINTS, costed_rows, layout_grid, sequence_parallel, wave_points

    grid = layout_grid(model, workload, kind, pos.n, pos.per_node, max_tp, max_pp, max_zero, offload, pos.exhaustive)
    cols = list(zip(*grid))
    tp, pp, dp, mb, zero, vpp, ep, etp = (np.array(cols[i], dtype=np.int64) for i in (0, 1, 2, 3, 5, 7, 8, 9))
    rc, off = np.array(cols[4], dtype=bool), list(cols[6])
    weights, grads, optimizer = cost.state(
        model,
        kind,
        Candidates.grid(
            cost.cluster,
            model.layers,
            tp,
            pp,
            dp,
            micro_batches=mb,
            recompute=rc,
            zero=zero,
            sp=sequence_parallel(tp, kind),
            vpp=vpp,
            ep=ep,
            etp=etp,
        ),
    )
    state = {"weights": weights, "grads": grads, "optimizer": optimizer}
    offloaded = np.array([sum(state[k][i] for k in o) for i, o in enumerate(off)], dtype=float)
    rho = np.full(len(tp), np.inf)
    if kind == "generate":
        keep, rho = wave_points(cost, workload, model, weights, tp, pp, dp, MAX_WAVE_POINTS if pos.exhaustive else 8)
        tp, pp, dp, mb, rc, zero, offloaded, vpp, ep, etp = (
            v[keep] for v in (tp, pp, dp, mb, rc, zero, offloaded, vpp, ep, etp)
        )
        off = [off[i] for i in keep]
    gpus = tp * pp * dp
    by_size = {int(g): pos.classes(int(g)) for g in np.unique(gpus)}
    classes = np.array(sorted({k for ks in by_size.values() for k in ks}), dtype=np.int64)
    ex_row = np.array([i for i, g in enumerate(gpus) for _ in by_size[int(g)]], dtype=np.int64)
    ex_cls = [k for g in gpus for k in by_size[int(g)]]
    lk = np.array(
        [pos.links(int(tp[i]), int(pp[i]), int(dp[i]), int(k)) for i, k in zip(ex_row, ex_cls)], dtype=np.int64
    ).reshape(-1, 4)
    col = np.array([list(classes).index(k) for k in ex_cls], dtype=np.int64)
    return costed_rows(
        cost,
        workload,
        model,
        kind,
        (tp, pp, dp, mb, rc, zero, vpp, ep, etp),
        off,
        offloaded,
        rho,
        classes,
        ex_row,
        col,
        lk,
    )


@pytest.mark.parametrize(
    "example,down",
    [
        ("ppo_8b_16gpu.nir", []),
        ("ppo_8b_16gpu.nir", [3, 12]),
        ("ppo_70b_1024gpu.nir", []),
        ("ppo_70b_1024gpu.nir", [5, 17, 18, 700]),
    ],
)
def test_candidates_equal_the_row_by_row_definition_and_remember_their_grids(monkeypatch, example, down):
    """Every candidate array to the bit (times at every start class, memory, offload choices) is
    that of ``candidates`` as first written, on the exhaustive space and the 1,024-GPU one, with
    whole nodes and with nodes missing GPUs (start classes across segments, ``ANYWHERE``), asked
    twice (the second from the remembered grid, which nothing can write) and again after the
    mini-batch changes (a new grid)."""
    from nereus.passes.cost.cost_model import CostModel
    from nereus.passes.search import space as search_space

    m = nereus.parse(next(p for p in EXAMPLES if p.name == example).read_text())
    (w,), (c,) = m.workloads.values(), m.clusters.values()
    c.unavailable = down
    monkeypatch.setattr(search_space, "_GRIDS", {})
    cost = CostModel(c)
    small = (
        len(c.available_gpus()) <= search_space.EXHAUSTIVE_GPUS
        and len(w.model_stages()) <= search_space.FULL_SPACE_MODEL_STAGES
    )
    pos = search_space.Positions.of(c, small)
    offload = c.host_link is not None and c.host_memory is not None
    fields = (
        "tp",
        "pp",
        "dp",
        "mb",
        "rc",
        "zero",
        "offload",
        "rho",
        "gpus",
        "classes",
        "times",
        "peak",
        "resident",
        "vpp",
    )
    trained = {}  # mini-batch -> the micro-batch counts of its first training model-stage
    for mini in (w.mini_batch, w.mini_batch // 2):
        w.mini_batch = mini
        for stage in w.stages:
            for ms in stage.model_stages():
                model = m.models[ms.rpartition(".")[0]]
                want = _candidates_row_by_row(cost, pos, w, model, stage.kind, c.gpus_per_node, offload=offload)
                for _ in range(2):
                    got = search_space.candidates(cost, pos, w, model, stage.kind, c.gpus_per_node, offload=offload)
                    for f in fields:
                        a, b = getattr(got, f), getattr(want, f)
                        assert a == b if f == "offload" else np.array_equal(a, b) and a.dtype == b.dtype, (ms, f)
                if stage.kind == "train":
                    with pytest.raises(ValueError):
                        got.tp[0] = 7
                    trained.setdefault(mini, sorted(set(want.mb.tolist())))
    assert (
        len(trained) == 2 and len({tuple(v) for v in trained.values()}) == 2
    )  # the second mini-batch has a grid of its own


def test_a_deterministic_time_limit_gives_the_same_plan_on_a_loaded_machine():
    """``deterministic=true`` counts CP-SAT's deterministic time: a search stopped by its limit
    (0.3 units: 1,024 GPUs are not proven optimal by then) stops at the same point of its search
    when two processes hog both cores, so it returns the same plan. A wall-clock limit of 0.3 s
    stops earlier under that load (the simulator's replays differed that way)."""
    import subprocess
    import sys

    text = next(p for p in EXAMPLES if p.name == "ppo_70b_1024gpu.nir").read_text()
    text = text[: text.index("plan @")]

    def searched():
        m = nereus.parse(text, "job.nir")
        nereus.run_pipeline(m, "plan-search{time_limit=0.3,deterministic=true}", verify="off")
        (plan,) = [p for p in m.plans.values() if p.search is not None]
        return plan.search.status, nereus.print_ir(m)

    quiet = searched()
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        loaded = searched()
    finally:
        for h in hogs:
            h.kill()
            h.wait(timeout=10)
    assert quiet[0] == "feasible"  # stopped by the limit, not by a proof
    assert loaded == quiet
