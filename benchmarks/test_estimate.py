"""pytest-benchmark: the cost model (run: make bench)."""

from nereus.bench.estimate_bench import candidates
from nereus.ir import parse
from nereus.passes import CostModel
from nereus.passes.cost.estimate import estimate_plan
from nereus.testing.jobs import ppo_70b

M = parse(ppo_70b(1024, with_emus=False))
PLAN = next(iter(M.plans.values()))


def test_estimate_pass_1024_gpus(benchmark):
    assert benchmark(estimate_plan, M, PLAN) == []


def test_estimate_10000_candidates(benchmark):
    cluster, workload, model = M.clusters[PLAN.cluster], M.workloads[PLAN.workload], M.models["actor"]
    cm = CostModel(cluster)
    cand = candidates(cluster, model, 10_000)
    times = benchmark(lambda: cm.stage(model, workload, "train", cand).time(cm.coeffs))
    assert len(times) == 10_000
