"""Functions that run on every rank of a local process group (``run_local``) for the runtime tests.

They live in an importable module so that spawned processes can find them. Each receives IR
text (modules are rebuilt from their printed form on every rank, as a real job would read a
file) and returns plain data for the test to check.
"""

from __future__ import annotations

import torch

import nereus
from nereus.backend.lower import lower
from nereus.passes.transition.plan_transition import plan_transition
from nereus.runtime.execute import Fault, Stats, TransitionError, execute
from nereus.runtime.launch import init_from_env
from nereus.runtime.state import cut, full_tensor, synthetic_state, torch_dtype
from nereus.testing.cases import case_module


def check(prog, rank: int, new) -> list[str]:
    """Destination shards that are missing, extra or not bit-identical to the full tensor's slice."""
    want = {s.key: s for s in prog.dst.get(rank, [])}
    bad = [f"extra {k}" for k in new if k not in want]
    for k, spec in want.items():
        t = new.get(k)
        if t is None:
            bad.append(f"missing {k}")
        elif t.dtype != torch_dtype(spec.dtype) or not torch.equal(t, cut(full_tensor(spec), spec.box)):
            bad.append(f"wrong {k} {list(spec.box)}")
    return bad


def run_cases(rank: int, world: int, cases: list[str], hidden: int, modes: list[str]) -> dict:
    """Every reshard case under every broadcast mode: (problems, bytes sent, bytes the program says)."""
    init_from_env(timeout=30)
    out = {}
    for case in cases:
        m = case_module(case, world, hidden=hidden, layers=4)
        m.transitions["t"] = plan_transition(m, "a", "b", "t")
        for mode in modes:
            prog = lower(m, "t", broadcast=mode, direct_bytes=4096, bucket_bytes=64 * 1024, chunk_bytes=256 * 1024)
            stats = Stats()
            new = execute(prog, synthetic_state(prog.src.get(rank, [])), timeout=30, stats=stats)
            out[(case, mode)] = (
                check(prog, rank, new),
                stats.sent,
                prog.sent_bytes(rank),
                m.transitions["t"].bytes_moved,
            )
    return out


def run_waves(rank: int, world: int, cases: list[str], hidden: int, modes: list[str]) -> dict:
    """Every reshard case lowered in 3 waves, run with a ``ready`` consumer: (problems, the
    destination shards handed more than once or never, those that changed after they were handed,
    the rounds in which shards were handed, whether running the program again hands the same)."""
    init_from_env(timeout=30)
    out = {}
    for case in cases:
        m = case_module(case, world, hidden=hidden, layers=4)
        m.transitions["t"] = plan_transition(m, "a", "b", "t")
        for mode in modes:
            prog = lower(m, "t", broadcast=mode, direct_bytes=4096, bucket_bytes=64 * 1024, chunk_bytes=8192, waves=3)
            handed: list = []

            def ready(shards, handed=handed):  # a copy as handed: it must be what commits
                handed.append({k: t.clone() for k, t in shards.items()})

            new = execute(prog, synthetic_state(prog.src.get(rank, [])), timeout=30, ready=ready)
            # the same program again (a push runs one every RL step): the same shards handed
            again: list = []
            execute(prog, synthetic_state(prog.src.get(rank, [])), timeout=30, ready=lambda s, a=again: a.extend(s))
            keys = [k for h in handed for k in h]
            want = {s.key for s in prog.dst.get(rank, [])}
            twice_or_never = sorted(map(str, set(k for k in keys if keys.count(k) > 1) | (want - set(keys))))
            changed = sorted(str(k) for h in handed for k, t in h.items() if not torch.equal(t, new[k]))
            same_again = sorted(map(str, again)) == sorted(map(str, keys))
            out[(case, mode)] = (check(prog, rank, new), twice_or_never, changed, len(handed), same_again)
    return out


def run_modules(rank: int, world: int, texts: list[str]) -> list[list[str]]:
    """Each module's transition @a_to_b (planned and scheduled), on ranks = GPUs 0..world-1;
    broadcasts as p2p, chains or subgroup broadcasts in turn; every other pair with a 1-byte
    memory limit, so that destination shards are allocated lazily."""
    init_from_env(timeout=30)
    out = []
    for i, text in enumerate(texts):
        m = nereus.parse(text)
        nereus.run_pipeline(m, "plan-transition{to=@b},schedule-transfers")
        mode = ("p2p", "chain", "collective")[i % 3]
        prog = lower(
            m, "a_to_b", gpus=list(range(world)), direct_bytes=256, bucket_bytes=4096, broadcast=mode, chunk_bytes=2048
        )
        stats = Stats()
        limit = 1 if i % 2 else None
        new = execute(prog, synthetic_state(prog.src.get(rank, [])), timeout=30, stats=stats, memory_limit=limit)
        problems = check(prog, rank, new)
        if limit is not None and prog.dst.get(rank) and not stats.lazy:
            problems.append("allocated up front despite the memory limit")
        out.append(problems)
    return out


def run_fault(rank: int, world: int, case: str, fault: Fault) -> dict:
    """Inject ``fault``; report what this rank saw and whether its plan-A state is intact."""
    init_from_env(timeout=30)
    m = case_module(case, world, hidden=64, layers=4)
    m.transitions["t"] = plan_transition(m, "a", "b", "t")
    prog = lower(m, "t", direct_bytes=4096, bucket_bytes=64 * 1024)
    state = synthetic_state(prog.src.get(rank, []))
    before = {k: (id(v), v.clone()) for k, v in state.items()}
    try:
        execute(prog, state, timeout=4, faults=(fault,))
        raised = None
    except TransitionError as e:
        raised = str(e)
    intact = set(state) == set(before) and all(
        id(state[k]) == i and torch.equal(state[k], c) for k, (i, c) in before.items()
    )
    full = all(torch.equal(v, cut(full_tensor(s), s.box)) for s in prog.src.get(rank, []) for v in [state[s.key]])
    return {"raised": raised, "intact": intact and full, "held": len(state)}


def run_out(rank: int, world: int, case: str) -> dict:
    """Plan B written into buffers the caller already has (``out``); then a buffer of the wrong
    shape on rank 1 only: every rank must fail the same way, with plan A intact."""
    init_from_env(timeout=30)
    m = case_module(case, world, hidden=64, layers=4)
    m.transitions["t"] = plan_transition(m, "a", "b", "t")
    prog = lower(m, "t", direct_bytes=4096, bucket_bytes=64 * 1024)
    state = synthetic_state(prog.src.get(rank, []))
    out = {s.key: torch.full(s.local_shape, 7, dtype=torch_dtype(s.dtype)) for s in prog.dst.get(rank, [])}
    new = execute(prog, state, timeout=30, out=out)
    in_place = all(new[k] is t for k, t in out.items())
    problems = check(prog, rank, new)
    bad = dict(out)
    if rank == 1 and bad:
        k = next(iter(bad))
        bad[k] = torch.empty(1, dtype=bad[k].dtype)
    try:
        execute(prog, state, timeout=4, out=bad)  # the others wait for rank 1 until the timeout
        raised = None
    except TransitionError as e:
        raised = str(e)
    intact = all(torch.equal(state[s.key], cut(full_tensor(s), s.box)) for s in prog.src.get(rank, []))
    return {"problems": problems, "in_place": in_place, "raised": raised, "intact": intact}


def run_travelled(rank: int, world: int, prog) -> list[str]:
    """A program lowered in the parent, received pickled as a spawn argument: executed here."""
    init_from_env(timeout=30)
    new = execute(prog, synthetic_state(prog.src.get(rank, [])), timeout=30)
    return check(prog, rank, new)


RESHARD_MODEL = {"layers": 4, "hidden": 64, "heads": 8, "kv_heads": 4, "ffn": 176, "vocab": 1000}


def run_plain_reshard(rank: int, world: int, pairs: list[tuple[dict, dict]], trained: bool) -> list[list[str]]:
    """``nereus.reshard`` on each (source, destination) layout pair: this rank's shards cut from
    the full tensors, moved, compared with the destination cut. Returns the problems per pair."""
    init_from_env(timeout=30)
    model = dict(RESHARD_MODEL, trained=trained)
    out = []
    for src, dst in pairs:
        state = {n: cut(full_tensor(s), s.box).clone() for n, s in nereus.reshard_shards(model, src, rank).items()}
        before = {n: t.clone() for n, t in state.items()}
        new = nereus.reshard(state, model, src, dst, timeout=30)
        want = nereus.reshard_shards(model, dst, rank)
        bad = [f"keys {sorted(set(new) ^ set(want))[:3]}"] if set(new) != set(want) else []
        bad += [
            f"wrong {n}" for n, s in want.items() if n in new and not torch.equal(new[n], cut(full_tensor(s), s.box))
        ]
        bad += [f"source changed {n}" for n, t in state.items() if not torch.equal(t, before[n])]
        out.append(bad)
    return out


def run_in_group(rank: int, world: int, cases: list[str], gone: int) -> dict:
    """Rank ``gone`` leaves; the others make a group of their own and run each case's transition
    in it (ranks of the program = ranks of the group: global rank 2 is group rank 1 when rank 1
    left), with broadcasts point to point and as chains."""
    import torch.distributed as dist

    init_from_env(timeout=30)
    members = [r for r in range(world) if r != gone]
    group = dist.new_group(members)  # every rank of the default group makes it, as the Controller does
    if rank == gone:
        return {}
    me = members.index(rank)
    out = {}
    for case in cases:
        m = case_module(case, len(members), hidden=64, layers=4)
        m.transitions["t"] = plan_transition(m, "a", "b", "t")
        for mode in ("p2p", "chain"):
            prog = lower(
                m, "t", broadcast=mode, direct_bytes=4096, bucket_bytes=64 * 1024, gpus=list(range(len(members)))
            )
            new = execute(prog, synthetic_state(prog.src.get(me, [])), timeout=30, group=group)
            out[(case, mode)] = (check(prog, me, new), prog.sent_bytes(me))
    return out


def shrink_twice(rank: int, world: int) -> dict:
    """Ranks 3, then 2, leave; the others re-form the default group each time
    (``regroup.reform``) and run an all-reduce over it and a new subgroup of its ranks 0 and 1."""
    import datetime

    import torch
    import torch.distributed as dist

    from nereus.runtime.launch import init_from_env
    from nereus.runtime.regroup import reform

    init_from_env(timeout=30)
    out: dict = {"rank": rank, "after": []}
    gpus = list(range(world))
    for generation, leaver in enumerate((3, 2)):
        if rank == leaver:
            return out
        gpus = [g for g in gpus if g != leaver]
        new = reform(gpus, rank, generation, timeout=20)
        total = torch.tensor([float(rank)])
        dist.all_reduce(total)
        pair = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=20))
        ones = torch.ones(1)
        if dist.get_rank() in (0, 1):
            dist.all_reduce(ones, group=pair)
        out["after"].append((new, dist.get_world_size(), float(total), float(ones)))
    return out


def run_reshard_in_subgroup(rank: int, world: int, src: dict, dst: dict) -> dict:
    """``nereus.reshard(group=)`` on ranks 1..world-1 (their group's ranks 0..world-2) while rank 0
    runs all-reduces of its own on another group with rank 1 before and after: the move never
    touches the default world. Returns the problems and what rank 0 summed."""
    import datetime

    import torch.distributed as dist

    init_from_env(timeout=30)
    bound = datetime.timedelta(seconds=30)
    movers = dist.new_group(list(range(1, world)), timeout=bound)
    pair = dist.new_group([0, 1], timeout=bound)
    model = dict(RESHARD_MODEL, trained=False)
    out: dict = {"rank": rank, "bad": [], "sums": []}
    if rank in (0, 1):  # something else the world does, next to the move
        ones = torch.ones(4)
        dist.all_reduce(ones, group=pair)
        out["sums"].append(float(ones[0]))
    if rank == 0:
        ones = torch.ones(4)
        dist.all_reduce(ones, group=pair)  # waits for rank 1, which moves first
        out["sums"].append(float(ones[0]))
        return out
    me = rank - 1  # this rank in the movers' group
    n = world - 1
    state = {k: cut(full_tensor(s), s.box).clone() for k, s in nereus.reshard_shards(model, src, me, world=n).items()}
    new = nereus.reshard(state, model, src, dst, timeout=30, group=movers)
    want = nereus.reshard_shards(model, dst, me, world=n)
    out["bad"] = [f"keys {sorted(set(new) ^ set(want))[:3]}"] if set(new) != set(want) else []
    out["bad"] += [f"wrong {k}" for k, s in want.items() if not torch.equal(new[k], cut(full_tensor(s), s.box))]
    if rank == 1:
        ones = torch.ones(4)
        dist.all_reduce(ones, group=pair)
        out["sums"].append(float(ones[0]))
    return out
