"""pytest-benchmark: plan-search on the 70B job at 1,024 GPUs (run: make bench)."""

from nereus.ir import parse
from nereus.passes.search.plan_search import solve
from nereus.passes.search.space import build_problem
from nereus.testing.jobs import ppo_70b

M = parse(ppo_70b(1024, with_emus=False))
W, C = next(iter(M.workloads.values())), next(iter(M.clusters.values()))


def test_plan_search_1024_gpus(benchmark):
    sol = benchmark.pedantic(
        lambda: solve(build_problem(C, W, M.models, prune=False), time_limit=30), rounds=3, iterations=1
    )
    assert sol.status == "optimal"
