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
