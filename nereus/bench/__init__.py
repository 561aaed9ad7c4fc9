"""Benchmarks behind ``nereus bench NAME``; ``benchmarks/`` runs the same workloads under pytest-benchmark.

``BENCHMARKS``: name -> the module of this package whose ``run(quick, json_output)`` it is,
imported when the benchmark runs (the command line lists the names without importing torch).
Baselines the benchmarks hold Nereus against are in ``baselines/``.
"""

from importlib import import_module

BENCHMARKS = {
    "parse": "parse_bench",
    "estimate": "estimate_bench",
    "plan-search": "plan_search_bench",
    "transition": "transition_bench",
    "reshard": "reshard_bench",
    "ep": "ep_bench",
    "calibrate": "calibrate_bench",
    "controller": "controller_bench",
    "push": "push_bench",
    "elastic": "elastic_bench",
    "validate": "validate_bench",
    "truth": "truth_bench",
    "verl": "verl_bench",
}


def run(name: str, quick: bool = False, json_output: bool = False):
    """Run benchmark ``name`` (a key of ``BENCHMARKS``): its table, or with ``json_output`` its figures."""
    return import_module(f".{BENCHMARKS[name]}", __name__).run(quick=quick, json_output=json_output)
