"""plan-transition: random plan pairs executed on numpy arrays reconstruct every destination
tensor exactly, with bytes moved equal to the lower bound."""

import copy
import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nereus
from nereus.ir import Layout, Plan
from nereus.ir.model import even_split
from nereus.passes.transition import holdings
from nereus.passes.transition.derive_emus import derive_missing_emus
from nereus.runtime.reference_executor import simulate

from ..support.jobs import job, zero3_gather

GIB = 2**30


def state_bytes(m, plan: str, offloaded: bool = True) -> dict[int, int]:
    """Bytes of state per GPU under ``plan``, its EMUs derived first (derive-emus)."""
    derive_missing_emus(m, plan)
    return holdings.state_bytes(m, plan, offloaded)


@st.composite
def layouts(draw, ms, layers, gpus, train):
    tp = draw(st.sampled_from([1, 2, 4]))
    pp = draw(st.integers(1, min(3, layers)))
    dp = draw(st.integers(1, max(1, len(gpus) // (tp * pp))))
    if tp * pp * dp > len(gpus):
        tp, pp, dp = 1, 1, 1
    mesh = draw(st.permutations(gpus))[: tp * pp * dp]
    ranges = [(lo, hi - 1) for lo, hi in (even_split(layers, pp, r) for r in range(pp))]
    zero = draw(st.integers(0, 3)) if train and dp > 1 else 0
    # what lives in host memory between stages differs between the plans: loads and offloads
    offload = draw(st.sampled_from([[], ["weights"]] + ([["optimizer"], ["weights", "optimizer"]] if train else [])))
    return Layout(model_stage=ms, tp=tp, pp=pp, dp=dp, layers=ranges, mesh=list(mesh), zero=zero, offload=offload)


@st.composite
def plan_pairs(draw):
    m = job(layers=draw(st.sampled_from([3, 5])))
    all_gpus = list(range(8))
    plans = []
    for name in ("a", "b"):
        # GPUs added and removed: each plan sees its own subset of the cluster
        avail = sorted(draw(st.sets(st.sampled_from(all_gpus), min_size=2, max_size=8)))
        lays = {
            ms: draw(layouts(ms, m.models["actor"].layers, avail, ms == "actor.train"))
            for ms in ("actor.generate", "ref.infer", "actor.train")
        }
        plans.append(Plan(name=name, workload="w", cluster="c", layouts=lays))
    for p in plans:
        m.plans[p.name] = p
    return m


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(plan_pairs())
def test_random_plan_pairs_reconstruct_exactly_with_lower_bound_bytes(m):
    nereus.verify(m)
    nereus.run_pipeline(m, "plan-transition{to=@b},schedule-transfers")
    t = m.transitions["a_to_b"]
    result = simulate(m, t)
    assert result.mismatches == []
    assert t.bytes_moved == t.lower_bound == result.received_bytes
    assert t.makespan >= t.port_bound
    text = nereus.print_ir(m)
    assert nereus.parse(text) == m


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(plan_pairs())
def test_receives_listed_per_gpu_only_when_asked_are_those_the_operations_make(m):
    """The planner lists a broadcast in its fan only; the bytes it counts onto each receiving GPU
    and the receives ``received(g)`` lists for a GPU (in the order operations were made) are
    those read off the operations themselves, receiver by receiver; an offload waits for what
    writes its shard whether or not the planner kept that list for the family (it keeps it only
    where plan B offloads)."""
    from collections import Counter, defaultdict

    from nereus.passes.transition.holdings import plan_holdings
    from nereus.passes.transition.plan_transition import group_optimizer_states
    from nereus.passes.transition.planner import Planner

    for plan in ("a", "b"):
        derive_missing_emus(m, plan)
    src_all, dst_all = group_optimizer_states(plan_holdings(m, "a"), plan_holdings(m, "b"))
    planner = Planner(m, "a", "b", m.clusters["c"], src_all, dst_all)
    for key in sorted(dst_all):
        planner.family(key, src_all.get(key, []), dst_all[key])
    planner.residency()
    planner._count_broadcasts()
    gpu_b = {h.ref: h.gpu for pieces in dst_all.values() for h in pieces}
    want_ops, want_bytes = defaultdict(list), Counter()
    for op in planner.ops:
        if op.kind in ("send", "broadcast"):
            for g, k in sorted(Counter(gpu_b[r] for r in op.dst).items()):
                want_ops[g].append((op.id, op.bytes * k))
                want_bytes[g] += op.bytes * k
    assert {g: planner.received(g) for g in want_ops} == dict(want_ops)
    assert {g: n for g, n in planner.recv_bytes.items() if n} == {g: n for g, n in want_bytes.items() if n}
    writes = defaultdict(list)
    for op in planner.ops:
        if op.kind in ("copy", "send", "broadcast"):
            for r in op.dst:
                writes[(op.state, op.family, r)].append(op.id)
    for op in planner.ops:
        if op.kind == "offload":
            assert op.deps == writes[(op.state, op.family, op.src[0])]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(plan_pairs())
def test_each_part_of_a_cells_receivers_gets_it_from_one_holder_by_load_and_run(m):
    """``_senders`` against its definition. A cell's receivers are split into parts: pieces of
    one region together, parts that share a GPU joined (so no GPU receives a cell twice). Cell by
    cell (ascending), part by part, the part gets the cell from the holder that sent it the
    part's last cell while that holder's load is at most the least loaded holder's plus the
    part's fair share (its largest slice's bytes times its GPUs), otherwise from the least loaded,
    ties to the lowest (GPU, model-stage, piece); the load grows by the cell's bytes times the
    part's GPUs."""
    from nereus.passes.transition.grid import Grid
    from nereus.passes.transition.holdings import plan_holdings
    from nereus.passes.transition.plan_transition import group_optimizer_states
    from nereus.passes.transition.planner import Planner, decide_structure, family_spec

    def volume(region):
        n = 1
        for lo, hi in region:
            n *= hi - lo
        return n

    for plan in ("a", "b"):
        derive_missing_emus(m, plan)
    src_all, dst_all = group_optimizer_states(plan_holdings(m, "a"), plan_holdings(m, "b"))
    planner = Planner(m, "a", "b", m.clusters["c"], src_all, dst_all)
    load = [0] * len(planner.load)  # bytes each GPU sends
    for key in sorted(dst_all):
        srcs, dsts = src_all.get(key, []), dst_all[key]
        if not srcs:
            continue
        itemsize = family_spec(m, *key)[1]
        grid = Grid({p.region for p in srcs} | {p.region for p in dsts})
        st = decide_structure(grid, srcs, dsts, shared=False)
        got = planner._senders(key, grid, srcs, dsts, st, itemsize)
        missing = st.missing
        want, last = {}, {}
        for c, numbers in zip(missing[0], missing[1]):
            parts = [missing[2][n] for n in numbers]
            # the parts, made again: by region, then joined while two share a GPU
            receivers = sorted({j for part in parts for j in part}, key=lambda j: (dsts[j].gpu, j))
            groups = [{j for j in receivers if dsts[j].region == r} for r in {dsts[j].region for j in receivers}]
            joined = True
            while joined:
                joined = False
                for x in range(len(groups)):
                    for y in range(x + 1, len(groups)):
                        if {dsts[j].gpu for j in groups[x]} & {dsts[j].gpu for j in groups[y]}:
                            groups[x] |= groups.pop(y)
                            joined = True
                            break
                    if joined:
                        break
            assert sorted(map(sorted, groups)) == sorted(map(sorted, parts))
            assert all(list(part) == sorted(part, key=lambda j: (dsts[j].gpu, j)) for part in parts)
            holders = [i for i, p in enumerate(srcs) if c in set(grid.cells(p.region))]
            for part in parts:
                gpus = len({dsts[j].gpu for j in part})
                share = max(volume(dsts[j].region) for j in part) * itemsize * gpus
                least = min(load[srcs[i].gpu] for i in holders)
                prev = last.get(part)
                if prev in holders and load[srcs[prev].gpu] <= least + share:
                    best = prev
                else:
                    best = min(holders, key=lambda i: (load[srcs[i].gpu], srcs[i].gpu, srcs[i].ref.model_stage, i))
                last[part] = best
                load[srcs[best].gpu] += grid.info(c)[1] * itemsize * gpus
                want.setdefault((best, part), []).append(c)
        assert got == want
    assert planner.sent_bytes == load


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(plan_pairs())
def test_families_that_lie_alike_decide_once_and_plan_as_if_each_decided_alone(m):
    """The planner decides a family's keeps, copies and missing cells once for the families that
    lie alike (``Planner._structure``): the same operations as with every family deciding alone,
    and fewer decisions where families share a structure (q, k, v, gate and up split alike)."""
    import nereus.passes.transition.planner as tp

    def ops(t):
        return [
            (
                op.id,
                op.kind,
                op.state,
                op.family,
                op.layers,
                op.box,
                [str(r) for r in op.src],
                [str(r) for r in op.dst],
                op.bytes,
                op.link,
                op.deps,
            )
            for op in t.ops
        ]

    alone, calls = copy.deepcopy(m), []
    decide, expect = tp.decide_structure, tp.Planner.expect
    try:
        tp.decide_structure = lambda *a, **k: calls.append(1) or decide(*a, **k)
        nereus.run_pipeline(m, "plan-transition{to=@b}")
        shared = len(calls)
        tp.Planner.expect = lambda self, families: None  # nothing remembered: each family decides alone
        calls.clear()
        nereus.run_pipeline(alone, "plan-transition{to=@b}")
    finally:
        tp.decide_structure, tp.Planner.expect = decide, expect
    assert ops(m.transitions["a_to_b"]) == ops(alone.transitions["a_to_b"])
    assert shared < len(calls)


def test_a_signature_tells_apart_slices_that_cut_alike_from_slices_that_do_not():
    """``structure_signature`` is what the planner remembers decisions by: two families whose slices lie
    on the same shards and cut their grids alike (one the other scaled) have one signature and
    the same decisions in cells; slices with the same number of cuts but other spans (one
    covering the middle cell, one not) have different signatures and different decisions."""
    from nereus.ir import ShardRef
    from nereus.passes.transition.grid import Grid, Holding
    from nereus.passes.transition.planner import decide_structure, structure_signature

    def family(src_regions, dst_region):
        srcs = [Holding(ShardRef("actor.train", i, 0, 0), i, (r,), i) for i, r in enumerate(src_regions)]
        dsts = [Holding(ShardRef("actor.generate", 0, 0, 0), 2, (dst_region,), 0)]
        return Grid({p.region for p in srcs + dsts}), srcs, dsts

    def decided(grid, srcs, dsts):
        st = decide_structure(grid, srcs, dsts)
        return st.keeps, st.copies, st.missing, st.members, st.group_of, dict(st.holders)

    overlapping = family([(0, 3), (1, 4)], (0, 4))  # cuts 0 1 3 4: every cell held
    scaled = family([(0, 30), (10, 40)], (0, 40))
    gapped = family([(0, 1), (3, 4)], (0, 4))  # cuts 0 1 3 4 too: the middle cell held by none
    assert overlapping[0].radix == gapped[0].radix
    assert structure_signature(*overlapping) == structure_signature(*scaled)
    assert decided(*overlapping) == decided(*scaled)
    assert structure_signature(*overlapping) != structure_signature(*gapped)
    assert decided(*overlapping) != decided(*gapped)


def test_inference_replicas_take_a_slice_in_one_run_apart_from_the_zero3_slices_that_need_it_too():
    """The actor's weights go from one GPU each of train and generate to two generation
    replicas (offloaded) and a ZeRO-3 training layout over four GPUs. Every cell of a tensor is
    needed by both replicas and by the one ZeRO-3 slice holding it: as one broadcast per cell,
    each replica's tensor would arrive in four operations (one per ZeRO-3 slice) and its offload
    would wait for all four. The replicas are one part, the slices others: each replica gets
    each tensor in one broadcast from one holder, each offload waits for that one operation, and
    still every missing byte arrives once (bytes moved equal the lower bound)."""
    from collections import Counter

    m = job(layers=3)

    def lay(ms, dp, mesh, zero=0, offload=()):
        return Layout(model_stage=ms, tp=1, pp=1, dp=dp, layers=[(0, 2)], mesh=mesh, zero=zero, offload=list(offload))

    m.plans["a"] = Plan(
        name="a",
        workload="w",
        cluster="c",
        layouts={
            "actor.generate": lay("actor.generate", 1, [1]),
            "ref.infer": lay("ref.infer", 1, [2]),
            "actor.train": lay("actor.train", 1, [0]),
        },
    )
    m.plans["b"] = Plan(
        name="b",
        workload="w",
        cluster="c",
        layouts={
            "actor.generate": lay("actor.generate", 2, [2, 3], offload=["weights"]),
            "ref.infer": lay("ref.infer", 1, [2]),
            "actor.train": lay("actor.train", 4, [4, 5, 6, 7], zero=3),
        },
    )
    nereus.run_pipeline(m, "plan-transition{to=@b}")
    t = m.transitions["a_to_b"]
    assert t.bytes_moved == t.lower_bound > 0
    assert simulate(m, t).mismatches == []
    writes = Counter(
        (op.family, r.dp) for op in t.ops if op.spec.delivers for r in op.dst if r.model_stage == "actor.generate"
    )
    families = {op.family for op in t.ops if op.state == "weight"}
    assert set(writes) == {(f, dp) for f in families for dp in (0, 1)} and set(writes.values()) == {1}
    assert all({r.model_stage for r in op.dst} == {"actor.generate"} for op in t.ops if op.kind == "broadcast")
    offloads = [op for op in t.ops if op.kind == "offload"]
    assert len(offloads) == 2 * len(families) and all(len(op.deps) == 1 for op in offloads)


def test_unchanged_plan_moves_nothing():
    m = job()
    lay = {
        ms: Layout(model_stage=ms, tp=2, pp=1, dp=2, layers=[(0, 4)], mesh=[0, 1, 2, 3])
        for ms in ("actor.generate", "ref.infer", "actor.train")
    }
    m.plans["a"] = Plan(name="a", workload="w", cluster="c", layouts=lay)
    m.plans["b"] = Plan(
        name="b", workload="w", cluster="c", layouts={k: Layout(**{**vars(v), "loc": v.loc}) for k, v in lay.items()}
    )
    nereus.run_pipeline(m, "plan-transition{to=@b}")
    t = m.transitions["a_to_b"]
    assert t.bytes_moved == t.lower_bound == 0
    assert t.ops == []  # every slice stays where it is


def test_a_missing_delivery_is_caught_by_the_verifier():
    m = job()
    m.plans["a"] = Plan(
        name="a",
        workload="w",
        cluster="c",
        layouts={
            ms: Layout(model_stage=ms, tp=4, pp=1, dp=1, layers=[(0, 4)], mesh=[0, 1, 2, 3])
            for ms in ("actor.generate", "ref.infer", "actor.train")
        },
    )
    m.plans["b"] = Plan(
        name="b",
        workload="w",
        cluster="c",
        layouts={
            ms: Layout(model_stage=ms, tp=2, pp=1, dp=2, layers=[(0, 4)], mesh=[4, 5, 6, 7])
            for ms in ("actor.generate", "ref.infer", "actor.train")
        },
    )
    nereus.run_pipeline(m, "plan-transition{to=@b}")
    t = m.transitions["a_to_b"]
    victim = next(op for op in t.ops if op.kind in ("send", "broadcast"))
    t.ops.remove(victim)
    for op in t.ops:
        op.deps = [d for d in op.deps if d != victim.id]
    with pytest.raises(nereus.DiagnosticError, match="leaves .* without all of"):
        nereus.verify(m)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(plan_pairs(), st.floats(1.0, 1.5))
def test_tight_memory_never_overflows_and_stages_through_host(m, slack):
    """GPU memory just above what plan A or plan B needs on the fullest GPU: the transition
    still reconstructs every tensor with lower-bound bytes, and in the order that needs the
    most memory (receives as early as allowed) no GPU ever holds more than its memory."""
    a, b = state_bytes(m, "a"), state_bytes(m, "b")
    cap = int(max(max(a.get(g, 0), b.get(g, 0)) for g in set(a) | set(b)) * slack)
    m.clusters["c"].gpu_memory = cap
    nereus.run_pipeline(m, "plan-transition{to=@b},schedule-transfers")
    t = m.transitions["a_to_b"]
    assert t.makespan >= t.port_bound
    nereus.verify(m)
    result = simulate(m, t)
    assert result.mismatches == []
    assert t.bytes_moved == t.lower_bound == result.received_bytes
    # every state offloaded to the host (drawn by hypothesis): no GPU holds anything, peak is empty
    assert max(result.peak.values(), default=0) <= cap, (result.peak, cap)
    assert nereus.parse(nereus.print_ir(m)) == m


def _swap(memory: int):
    """Every GPU sends its whole TP shard to the next one: nothing it holds is dead early."""
    m = job()
    m.clusters["c"].gpu_memory = memory
    mss = ("actor.generate", "ref.infer", "actor.train")
    m.plans["a"] = Plan(
        name="a",
        workload="w",
        cluster="c",
        layouts={ms: Layout(model_stage=ms, tp=4, pp=1, dp=1, layers=[(0, 4)], mesh=[0, 1, 2, 3]) for ms in mss},
    )
    m.plans["b"] = Plan(
        name="b",
        workload="w",
        cluster="c",
        layouts={ms: Layout(model_stage=ms, tp=4, pp=1, dp=1, layers=[(0, 4)], mesh=[1, 2, 3, 0]) for ms in mss},
    )
    return m


def test_a_swap_that_cannot_hold_both_shards_stages_the_rest():
    roomy = _swap(80 * GIB)
    nereus.run_pipeline(roomy, "plan-transition{to=@b}")
    unordered = simulate(roomy, roomy.transitions["a_to_b"]).peak
    assert not any(op.kind == "unstage" for op in roomy.transitions["a_to_b"].ops)  # room: nothing staged

    need = max(max(state_bytes(roomy, p).values()) for p in ("a", "b"))
    m = _swap(need + need // 4)
    assert max(unordered.values()) > m.clusters["c"].gpu_memory  # without staging it would overflow
    nereus.run_pipeline(m, "plan-transition{to=@b},schedule-transfers")
    t = m.transitions["a_to_b"]
    nereus.verify(m)
    unstaged = [op for op in t.ops if op.kind == "unstage"]
    staged = {op.id for op in t.ops if any(isinstance(r, nereus.ir.HostRef) for r in op.dst)}
    assert unstaged and all(set(op.deps) & staged for op in unstaged)
    result = simulate(m, t)
    assert result.mismatches == []
    assert max(result.peak.values()) <= m.clusters["c"].gpu_memory
    assert t.bytes_moved == t.lower_bound  # staging moves no extra bytes over the links
    assert t.makespan >= t.port_bound > 0


def test_a_plan_that_does_not_fit_is_a_diagnostic_naming_the_gpu():
    m = _swap(80 * GIB)
    need = max(state_bytes(m, "a").values())
    m.clusters["c"].gpu_memory = need // 2
    with pytest.raises(
        nereus.DiagnosticError, match=r"no order fits on GPU \d: plan A's state alone would take [\d,]+ bytes more"
    ):
        nereus.run_pipeline(m, "plan-transition{to=@b}")


def test_state_that_stays_in_host_memory_takes_no_gpu_memory():
    """The reference model is offloaded under both plans and does not move: it stays in host
    memory, so a GPU with room for the actor's state (and 5% more) but not for the
    reference model's too can still swap the actor's shards."""
    m = _swap(80 * GIB)
    for name in ("a", "b"):
        m.plans[name].layouts["ref.infer"] = Layout(
            model_stage="ref.infer", tp=4, pp=1, dp=1, layers=[(0, 4)], mesh=[0, 1, 2, 3], offload=["weights"]
        )
    resident = max(max(state_bytes(m, p, offloaded=False).values()) for p in ("a", "b"))
    assert max(state_bytes(m, "a").values()) > resident + resident // 20  # counted on the GPU, it would not fit
    m.clusters["c"].gpu_memory = resident + resident // 20
    nereus.run_pipeline(m, "plan-transition{to=@b},schedule-transfers")
    t = m.transitions["a_to_b"]
    assert not any(op.kind in ("load", "offload") for op in t.ops)  # the reference model never moves
    result = simulate(m, t)
    assert result.mismatches == [] and max(result.peak.values()) <= m.clusters["c"].gpu_memory


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(plan_pairs(), st.floats(1.0, 1.3))
def test_schedule_buckets_and_precedences_follow_every_operation(m, slack):
    """Under tight memory (staging, waves of unstages waiting for frees): each bucket's
    precedences, gathered once per bucket, equal those derived operation by operation through
    the non-bucket operations (frees, copies); an unstage's bucket is on the GPU of its shards."""
    from nereus.passes.cost.cost_model import CostModel
    from nereus.passes.schedule.buckets import bucket_precedences, buckets_of, endpoint_gpu

    a, b = state_bytes(m, "a"), state_bytes(m, "b")
    m.clusters["c"].gpu_memory = int(max(max(a.get(g, 0), b.get(g, 0)) for g in set(a) | set(b)) * slack)
    nereus.run_pipeline(m, "plan-transition{to=@b}")
    t = m.transitions["a_to_b"]
    buckets, bucket_of = buckets_of(m, t, CostModel(m.clusters["c"]))
    index = {op.id: i for i, bucket in enumerate(buckets) for op in bucket.ops}
    assert bucket_of.tolist() == [index.get(op.id, -1) for op in t.ops]
    by_id = {op.id: op for op in t.ops}

    def before(op_id):  # the buckets a non-bucket operation waits for, directly or through others
        out = set()
        for d in by_id[op_id].deps:
            out |= {index[d]} if d in index else before(d)
        return out

    want = set()
    for op in t.ops:
        i = index.get(op.id)
        for d in op.deps if i is not None else ():
            want |= {(j, i) for j in ({index[d]} if d in index else before(d)) if j != i}
    assert set(map(tuple, bucket_precedences(t, buckets, bucket_of).tolist())) == want
    # operations named otherwise than plan-transition's "%k" (a transition written by hand): the same
    name = {op.id: f"x{len(t.ops) - k}" for k, op in enumerate(t.ops)}
    renamed = copy.deepcopy(t)
    for op in renamed.ops:
        op.id, op.deps = name[op.id], [name[d] for d in op.deps]
    assert set(map(tuple, bucket_precedences(renamed, buckets, bucket_of).tolist())) == want
    for bucket in buckets:
        for op in bucket.ops:
            if op.kind == "unstage":
                assert {endpoint_gpu(m, "b", r) for r in op.dst} == {bucket.src} == set(bucket.dsts)
    # operations share their endpoint and empty dependency lists: no pass changes one in place
    from nereus.passes.transition.planner import NO_DEPS, NO_ENDPOINTS

    nereus.run_pipeline(m, "schedule-transfers")
    assert NO_DEPS == [] and NO_ENDPOINTS == []
    assert all(len(op.src) == 1 for op in t.ops if op.kind in ("send", "broadcast", "copy", "free"))


def test_a_broadcast_waits_for_the_dead_frees_of_every_gpu_it_writes():
    """The actor moves from GPU 0 to replicas on GPUs 1 and 2 (broadcasts), which hold reference
    replicas plan B no longer needs (the one on GPU 3 stays): with no room for both, each
    broadcast waits for the frees on both receiving GPUs, and neither GPU overflows."""
    m = job()
    one = {"actor.generate": [0], "actor.train": [0], "ref.infer": [1, 2, 3]}
    two = {"actor.generate": [1, 2], "actor.train": [1, 2], "ref.infer": [3]}
    for name, meshes in (("a", one), ("b", two)):
        m.plans[name] = Plan(
            name=name,
            workload="w",
            cluster="c",
            layouts={
                ms: Layout(model_stage=ms, tp=1, pp=1, dp=len(mesh), layers=[(0, 4)], mesh=mesh)
                for ms, mesh in meshes.items()
            },
        )
    a, b = state_bytes(m, "a"), state_bytes(m, "b")
    m.clusters["c"].gpu_memory = cap = max(max(a.values()), max(b.values()))
    assert a[1] + b[1] > cap  # the actor does not fit beside the reference replica
    nereus.run_pipeline(m, "plan-transition{to=@b},schedule-transfers")
    t = m.transitions["a_to_b"]
    frees_on = {
        g: {
            op.id
            for op in t.ops
            if op.kind == "free" and op.src[0].model_stage == "ref.infer" and op.src[0].dp == g - 1
        }
        for g in (1, 2)
    }
    waiting = [
        op for op in t.ops if op.kind == "broadcast" and set(op.deps) & frees_on[1] and set(op.deps) & frees_on[2]
    ]
    assert waiting and all(op.deps == sorted(set(op.deps), key=lambda d: int(d[1:])) for op in t.ops)
    result = simulate(m, t)
    assert result.mismatches == [] and max(result.peak.values()) <= cap


def test_a_shard_gathered_from_many_senders_is_unstaged_at_once():
    """Out of ZeRO-3 with no memory to spare: the slices that several senders stage for one new
    shard are moved onto the GPU by one unstage (fed by each of them), which the verifier, the
    reference executor and the memory bound all accept; the optimizer state moves as one state."""
    m = zero3_gather()
    nereus.run_pipeline(m, "plan-transition{to=@b},schedule-transfers")
    t = m.transitions["a_to_b"]
    staging = {op.id for op in t.ops if any(isinstance(r, nereus.ir.HostRef) for r in op.dst)}
    unstages = [op for op in t.ops if op.kind == "unstage"]
    fed = [len(set(op.deps) & staging) for op in unstages]
    assert max(fed) >= 3 and min(fed) >= 1
    assert sum(fed) == sum(1 for op in t.ops if op.id in staging for r in op.dst if isinstance(r, nereus.ir.HostRef))
    assert {op.state for op in t.ops} == {"weight", "optimizer"}
    result = simulate(m, t)
    assert result.mismatches == []
    assert t.bytes_moved == t.lower_bound == result.received_bytes
    assert max(result.peak.values()) <= m.clusters["c"].gpu_memory
    assert nereus.parse(nereus.print_ir(m)) == m


def test_an_unstage_its_dependencies_do_not_fill_is_a_diagnostic():
    m = zero3_gather()
    nereus.run_pipeline(m, "plan-transition{to=@b}")
    t = m.transitions["a_to_b"]
    staging = {op.id for op in t.ops if any(isinstance(r, nereus.ir.HostRef) for r in op.dst)}
    merged = next(op for op in t.ops if op.kind == "unstage" and len(set(op.deps) & staging) >= 2)
    merged.deps.remove(next(d for d in merged.deps if d in staging))  # one sender's slice no longer taken
    with pytest.raises(nereus.DiagnosticError, match=rf"{merged.id}: unstage reads .* do not fill it once"):
        nereus.verify(m)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(1, 4), min_size=1, max_size=4), st.lists(st.integers(1, 3), min_size=1, max_size=3), st.data()
)
def test_merge_boxes_keeps_exactly_the_cells_it_is_given(rows, cols, data):
    """Disjoint boxes cut from a grid (a random subset of its cells): each merged box is the
    union of the boxes it names, which lie inside it, and every box is named once."""
    from nereus.passes.transition.memory import merge_boxes

    r_cut = [0, *itertools.accumulate(rows)]
    c_cut = [0, *itertools.accumulate(cols)]
    cells = [((r_cut[i], r_cut[i + 1]), (c_cut[j], c_cut[j + 1])) for i in range(len(rows)) for j in range(len(cols))]
    boxes = data.draw(st.lists(st.sampled_from(cells), min_size=1, unique=True))
    out = merge_boxes(boxes)
    named = sorted(i for _, members in out for i in members)
    assert named == list(range(len(boxes)))
    for box, members in out:
        inside = [boxes[i] for i in members]
        assert all(all(a <= lo and hi <= b for (lo, hi), (a, b) in zip(x, box)) for x in inside)
        vol = lambda b: (b[0][1] - b[0][0]) * (b[1][1] - b[1][0])
        assert sum(vol(x) for x in inside) == vol(box)
