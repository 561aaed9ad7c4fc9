"""Expert-parallel state moved for real: random pairs of EP layouts of a mixture of experts (EP,
ETP, TP, PP, DP and ZeRO all changing) lowered to collective programs and run by 8 gloo
processes, every destination shard bit-identical to the same slice of the full tensor."""

from __future__ import annotations

from nereus.runtime.launch import run_local

from ..passes.test_expert_parallel import random_ep_pairs
from ..support import runtime_workers as w


def test_random_ep_pairs_run_for_real_on_8_processes():
    texts = random_ep_pairs(6, seed=3)
    results = run_local(w.run_modules, 8, texts, timeout=240)
    for i in range(len(texts)):
        problems = [p for r in results for p in r[i]]
        assert problems == [], f"pair {i}: {problems[:5]}\n{texts[i]}"


def test_the_benchmarks_ep_cases_are_bit_exact_and_send_the_planned_bytes():
    """``nereus bench ep``'s cases (EP 4 -> EP 2 of training state; EP 4 -> TP 2 x EP 2 engines),
    under every broadcast mode, on 4 processes: every destination shard bit-exact, every rank
    sending what its program says, and all of them together the planner's bytes (its bound)."""
    from nereus.testing.cases import EP_CASES

    modes = ["p2p", "chain", "collective"]
    results = run_local(w.run_cases, 4, list(EP_CASES), 64, modes, timeout=240)
    for case in EP_CASES:
        for mode in modes:
            per_rank = [r[(case, mode)] for r in results]
            assert [p for bad, *_ in per_rank for p in bad] == [], (case, mode)
            sent = [s for _, s, _, _ in per_rank]
            assert sent == [planned for _, _, planned, _ in per_rank]
            assert sum(sent) == per_rank[0][3] > 0, (case, mode)
