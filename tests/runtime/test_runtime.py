"""The runtime on real processes: transitions lowered to collective programs move live state with
gloo, every destination shard bit-identical to the same slice of the full tensor, and a failure
on any rank leaves every survivor with its plan-A state.

Each test is one launch of 4 or 8 processes (a process starts in about a second here) that runs
many cases; every collective has a timeout, so a hang fails instead of eating CI's time.
"""

from __future__ import annotations

import random

import pytest

import nereus
from nereus.ir import Layout, Plan
from nereus.ir.model import even_split
from nereus.runtime.execute import Fault
from nereus.runtime.launch import LaunchError, run_local
from nereus.testing.cases import CASES

from ..support import runtime_workers as w
from ..support.jobs import job, zero3_gather


@pytest.mark.parametrize("world", [4, 8])
def test_reshard_cases_are_bit_exact_and_send_the_planned_bytes(world):
    modes = ["p2p", "chain", "collective"] if world == 4 else ["p2p", "chain"]
    results = run_local(w.run_cases, world, list(CASES), 64, modes, timeout=240)
    for case in CASES:
        for mode in modes:
            per_rank = [r[(case, mode)] for r in results]
            problems = [p for bad, *_ in per_rank for p in bad]
            assert problems == [], f"{case} ({mode}): {problems[:5]}"
            sent = [s for _, s, _, _ in per_rank]
            assert sent == [planned for _, _, planned, _ in per_rank]
            # every byte a GPU lacks is received once: the planner's bytes moved (= its lower bound)
            assert sum(sent) == per_rank[0][3], f"{case} ({mode})"


def test_a_program_in_waves_hands_each_shard_once_as_it_lands_and_it_is_what_commits():
    results = run_local(w.run_waves, 4, list(CASES), 64, ["p2p", "chain"], timeout=240)
    for key in results[0]:
        for rank, r in enumerate(results):
            problems, twice_or_never, changed, _, same_again = r[key]
            assert problems == [] and twice_or_never == [] and changed == [] and same_again, (key, rank, r[key])
    # shards reach the consumer in more than one handing (the waves), not all at the commit
    assert max(r[key][3] for r in results for key in r) >= 3


def test_ready_is_refused_beside_restore():
    """A shard whose last write lands may still lack what a checkpoint read fills after ``execute``."""
    from nereus.runtime.execute import execute

    with pytest.raises(ValueError, match="restore"):
        execute(None, {}, restore=True, ready=lambda shards: None)  # type: ignore[arg-type]


def random_pairs(n: int, seed: int = 0) -> list[str]:
    """Plan pairs of a tiny job with uneven shapes (TP, PP, DP, CP changes; GPUs added and
    removed; ZeRO, over DP x CP; what is offloaded between stages), as IR text."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        m = job(layers=rng.choice([3, 5]))
        for name in ("a", "b"):
            avail = sorted(rng.sample(range(8), rng.randint(2, 8)))
            lays = {}
            for ms in ("actor.generate", "ref.infer", "actor.train"):
                train = ms == "actor.train"
                tp, pp = rng.choice([1, 2, 4]), rng.randint(1, 3)
                cp = 1 if ms == "actor.generate" else rng.choice([1, 1, 2])  # CP ranks hold their replica's state
                dp = rng.randint(1, max(1, len(avail) // (tp * pp * cp)))
                if tp * pp * dp * cp > len(avail):
                    tp, pp, dp, cp = 1, 1, 1, 1
                mesh = rng.sample(avail, tp * pp * dp * cp)
                layers = m.models["actor"].layers
                ranges = [(lo, hi - 1) for lo, hi in (even_split(layers, pp, r) for r in range(pp))]
                zero = rng.randint(0, 3) if train and dp * cp > 1 else 0
                offload = rng.choice([[], ["weights"]] + ([["optimizer"], ["weights", "optimizer"]] if train else []))
                lays[ms] = Layout(
                    model_stage=ms, tp=tp, pp=pp, dp=dp, cp=cp, layers=ranges, mesh=mesh, zero=zero, offload=offload
                )
            m.plans[name] = Plan(name=name, workload="w", cluster="c", layouts=lays)
        try:
            nereus.verify(m)
        except nereus.DiagnosticError:
            continue
        out.append(nereus.print_ir(m))
    return out


def staging_pairs(n: int, seed: int = 1) -> list[str]:
    """Random plan pairs on GPUs with just the memory that plan A or plan B needs on the fullest
    GPU, kept where the transition stages slices through host memory."""
    from nereus.passes.transition.derive_emus import derive_missing_emus
    from nereus.passes.transition.holdings import state_bytes
    from nereus.passes.transition.plan_transition import plan_transition

    out = []
    for text in random_pairs(4 * n, seed):
        m = nereus.parse(text)
        for plan in ("a", "b"):
            derive_missing_emus(m, plan)
        a, b = state_bytes(m, "a"), state_bytes(m, "b")
        m.clusters["c"].gpu_memory = max(max(a.get(g, 0), b.get(g, 0)) for g in set(a) | set(b))
        if any(op.kind == "unstage" for op in plan_transition(m, "a", "b", "t").ops):
            out.append(nereus.print_ir(m))  # with the EMUs the planner derived
        if len(out) == n:
            break
    assert len(out) == n, "too few random pairs stage"
    return out


def test_random_plan_pairs_run_for_real_on_8_processes():
    texts = random_pairs(8) + staging_pairs(3) + [nereus.print_ir(zero3_gather())]  # the last: merged unstages
    results = run_local(w.run_modules, 8, texts, timeout=240)
    for i in range(len(texts)):
        problems = [p for r in results for p in r[i]]
        assert problems == [], f"pair {i}: {problems[:5]}\n{texts[i]}"


@pytest.mark.parametrize(
    "fault", [Fault("raise", rank=1), Fault("corrupt", rank=2), Fault("exit", rank=3)], ids=lambda f: f.kind
)
def test_a_failure_on_one_rank_leaves_every_survivor_with_plan_a_state(fault):
    try:
        results = run_local(w.run_fault, 4, "tp4-tp2x2", fault, timeout=120)
        errors = {}
    except LaunchError as e:
        results, errors = [e.results.get(r) for r in range(4)], e.errors
    if fault.kind == "exit":
        assert set(errors) == {fault.rank}  # only the rank that died
    else:
        assert errors == {}
    for rank, res in enumerate(results):
        if rank == fault.rank and fault.kind == "exit":
            continue
        assert res["raised"] is not None, f"rank {rank} committed a failed transition"
        assert "is intact" in res["raised"]
        assert res["intact"] and res["held"] > 0, f"rank {rank} lost plan-A state"
    if fault.kind == "corrupt":  # the receiver of the corrupted message names it
        assert any("corrupted" in r["raised"] for r in results)


def test_plan_b_lands_in_buffers_the_caller_already_has():
    """As a generation engine's weights: filled in place, bit-exact; a wrong buffer on one rank
    fails every rank (not a hang) and leaves plan A intact."""
    results = run_local(w.run_out, 4, "train-gen", timeout=120)
    for rank, r in enumerate(results):
        assert r["problems"] == [] and r["in_place"], f"rank {rank}: {r['problems'][:3]}"
        assert r["raised"] is not None and "is intact" in r["raised"], f"rank {rank} did not fail"
        assert r["intact"]
    assert "out[" in results[1]["raised"]


def test_a_transition_runs_in_the_group_of_the_ranks_that_remain():
    """After rank 1 of 5 left, ranks 0, 2, 3 and 4 run transitions in a group of their own (the
    Controller's after a shrink): bit-exact, broadcasts point to point and in chains."""
    results = run_local(w.run_in_group, 5, list(CASES), 1, timeout=240)
    assert results[1] == {}
    for rank in (0, 2, 3, 4):
        assert results[rank], rank
        for key, (problems, _) in results[rank].items():
            assert problems == [], (rank, key, problems[:3])
    assert all(sum(results[r][key][1] for r in (0, 2, 3, 4)) > 0 for key in results[0])  # bytes crossed ranks


def test_the_default_group_is_re_formed_over_the_ranks_that_remain_twice():
    """4 -> 3 -> 2 ranks in the same processes: after each re-formation the survivors are ranks
    0.. of a default group of their number (GPU ids kept in order), its collectives sum over
    them alone, and a new subgroup can be made without the ranks that left."""
    out = {r["rank"]: r["after"] for r in run_local(w.shrink_twice, 4, timeout=120)}
    # (new rank, world, the sum of the GPU ids that remain, the pair's sum)
    assert out == {
        0: [(0, 3, 3.0, 2.0), (0, 2, 1.0, 2.0)],
        1: [(1, 3, 3.0, 2.0), (1, 2, 1.0, 2.0)],
        2: [(2, 3, 3.0, 1.0)],
        3: [],
    }
