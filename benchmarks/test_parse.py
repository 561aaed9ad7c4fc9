"""pytest-benchmark: parse + verify + print of the 70B job (run: make bench, or
.venv/bin/python -m pytest benchmarks --benchmark-only)."""

import pytest

from nereus.bench.parse_bench import SIZES, roundtrip
from nereus.ir import parse, print_ir
from nereus.testing.jobs import ppo_70b


@pytest.mark.parametrize("gpus", SIZES)
def test_parse_canonical(benchmark, gpus):
    text = ppo_70b(gpus)
    assert benchmark(roundtrip, text) == text


@pytest.mark.parametrize("gpus", SIZES)
def test_parse_expanded(benchmark, gpus):
    text = ppo_70b(gpus)
    expanded = print_ir(parse(text), group_replicas=False)
    assert benchmark(roundtrip, expanded) == text
