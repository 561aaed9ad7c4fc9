"""The event truth on the traces' 70B PPO job: a step played out has every model-stage's time and
memory, fails as out of memory exactly where a GPU's allocation exceeds its memory, grows with
the responses, runs under ``nereus simulate`` (its default), and its misspecified variants add
their error where they say."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest

from nereus.ir import parse, verify
from nereus.sim.policies import POLICIES
from nereus.sim.simulate import simulate
from nereus.sim.simulated_cluster import SimCluster
from nereus.sim.trace import read_trace
from nereus.testing.jobs import EXAMPLES

TRACES = Path(__file__).resolve().parents[2] / "nereus" / "sim" / "traces"


@pytest.fixture(scope="module")
def sim():
    module = verify(parse(EXAMPLES["ppo_70b_1024gpu.nir"](), "ppo_70b_1024gpu.nir"))
    return SimCluster(module, read_trace(TRACES / "length_growth.jsonl"), model="event")


@pytest.fixture(scope="module")
def plan(sim):
    policy = POLICIES["fixed"]()
    policy.start(sim)
    return policy.plan


def test_a_step_played_out_has_every_model_stage_and_grows_with_the_responses(sim, plan):
    first = sim._evaluate(plan, 0)
    assert not first.failure and set(first.seconds) == set(plan.layouts)
    assert all(0 < s < math.inf for s in first.seconds.values())
    # the step is the stages in order: at least the slowest model-stage of each stage
    stages = sim.workload.stages
    floor = sum(max(first.seconds[ms] for ms in st.model_stages() if ms in plan.layouts) for st in stages)
    assert first.step_time >= floor - 1e-9
    later = sim._evaluate(plan, 300)  # longer responses: generation and training take longer
    assert later.seconds["actor.generate"] > first.seconds["actor.generate"]
    assert later.seconds["actor.train"] > first.seconds["actor.train"]


def test_out_of_memory_is_where_an_allocation_exceeds_the_gpu(sim, plan):
    gpu = sim.cluster.gpu_memory
    for i in (0, 300, 600, 999):
        out = sim._evaluate(plan, i)
        over = any(b > gpu for b in out.memory.values())
        assert (out.failure == "out of memory") == over, (i, out.failure, out.memory)
    assert sim._evaluate(plan, 999).failure == "out of memory"  # the step-0 plan does not hold 10k-token responses


def test_offloading_pays_the_host_link_both_ways(sim, plan):
    off = copy.deepcopy(plan)
    lay = off.layouts["ref.infer"]
    assert "weights" not in lay.offload
    lay.offload = ["weights"]
    base, moved = sim._evaluate(plan, 0), sim._evaluate(off, 0)
    assert moved.seconds["ref.infer"] > base.seconds["ref.infer"]


def test_simulate_runs_the_policies_under_the_event_truth():
    module = verify(parse(EXAMPLES["ppo_70b_1024gpu.nir"](), "ppo_70b_1024gpu.nir"))
    trace = read_trace(TRACES / "length_growth.jsonl")
    result = simulate(module, trace, ["fixed", "nereus"], steps=30, progress=False, truth="event")
    assert result["truth"] == "event"
    for name in ("fixed", "nereus"):
        run = result["runs"][name]
        assert run.summary()["completed"] > 0


def test_the_misspecified_truths_add_their_error_where_they_say(sim, plan):
    """``long-gen`` slows generation at long contexts only, ``slow-inter`` the training stages
    whose data-parallel collectives cross nodes and not generation, and ``hidden`` gives each
    configuration its own factor: the same at every step, log-normal with sigma about 0.1."""
    module, trace = sim.base, sim.trace
    truths = {name: SimCluster(module, trace, model=name) for name in ("long-gen", "slow-inter", "hidden")}
    short, long = 0, 999  # mean response about 1.5k tokens at step 0, about 10k at the end
    assert sim.trace.steps[long].response_len_mean > 6 * sim.trace.steps[short].response_len_mean
    # a plan that fits the long responses: the fixed policy's own restart there
    late = POLICIES["fixed"]()
    late.start(sim)
    late.adopt(late.initial(sim, long))
    base_s, base_l = sim._evaluate(plan, short), sim._evaluate(late.plan, long)
    gen_s, gen_l = truths["long-gen"]._evaluate(plan, short), truths["long-gen"]._evaluate(late.plan, long)
    # short contexts (most requests' under the ramp's 4k start): as the event truth, within 1%
    assert gen_s.seconds["actor.generate"] == pytest.approx(base_s.seconds["actor.generate"], rel=0.01)
    slowed = gen_l.seconds["actor.generate"] / base_l.seconds["actor.generate"]
    assert 1.05 < slowed <= 1.2
    assert {ms: t for ms, t in gen_l.seconds.items() if ms != "actor.generate"} == {
        ms: t for ms, t in base_l.seconds.items() if ms != "actor.generate"
    }
    inter = truths["slow-inter"]._evaluate(plan, short)
    assert inter.seconds["actor.generate"] == base_s.seconds["actor.generate"]
    assert inter.seconds["actor.train"] > base_s.seconds["actor.train"]  # DP 16 over nodes
    hidden = truths["hidden"]
    factors = []
    for i in (short, 300):
        base, hid = sim._evaluate(plan, i), hidden._evaluate(plan, i)
        factors.append({ms: hid.seconds[ms] / base.seconds[ms] for ms in base.seconds})
    assert factors[0] == pytest.approx(factors[1], rel=1e-12)  # the configuration's, not the step's
    # the factor is a hash of the configuration: over many, its log spreads as sigma 0.1
    from nereus.sim.truth.misspecified import MISSPECIFIED
    from nereus.sim.truth.step import seed_of

    logs = [math.log(MISSPECIFIED["hidden"].hidden_factor(seed_of("train", k))) for k in range(4000)]
    mean = sum(logs) / len(logs)
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / len(logs))
    assert abs(mean) < 0.01 and 0.095 < sd < 0.105


def test_verls_push_is_megatrons_gather_over_tp_then_broadcast_over_pp(sim, plan):
    """Each GPU gathers its stage's weights whole over its TP group, then the other stages' over
    its PP group: far fewer bytes over the NIC than FSDP's all-gather of the whole model."""
    from nereus.sim.truth.network import LINK_EFFICIENCY

    train = next(lay for ms, lay in plan.layouts.items() if ms == "actor.train")
    full = sim.weight_bytes("actor")
    per = sim.cluster.gpus_per_node
    nvl = sim.cluster.intra_node.bandwidth * LINK_EFFICIENCY["nvlink"]
    nic = sim.cluster.inter_node.bandwidth * LINK_EFFICIENCY["nic"]

    def rate(gpus):
        return nvl if len({g // per for g in gpus}) == 1 else nic

    stage = full / train.pp
    want = (train.tp - 1) / train.tp * stage / rate(train.mesh[: train.tp])
    want += (train.pp - 1) * stage / rate(train.mesh[: train.tp * train.pp : train.tp])
    assert sim.sync_seconds(plan, "megatron") == pytest.approx(want)
    assert sim.sync_seconds(plan, "megatron") < sim.sync_seconds(plan, "allgather")


def test_a_step_draws_the_same_after_its_trace_is_pickled(sim, plan):
    """A worker process receives the trace pickled, and a frozenset rebuilt from a pickle may
    iterate in another order. The truth seeds its draws with the step's conditions, so they must
    not depend on that order: here GPUs 728-735 and 224-231 down, the set built two ways."""
    import pickle

    from nereus.sim.simulated_cluster import conditions
    from nereus.sim.trace import TraceStep

    base = sim.trace.steps[0]
    down = [728 + k for k in range(8)] + [224 + k for k in range(8)]
    grown = set(range(0, 1024))  # a large table, then shrunk: its order is not a fresh set's
    grown -= set(range(0, 1024)) - set(down)
    steps = [
        TraceStep(0, base.response_len_dist, frozenset(grown)),
        TraceStep(0, base.response_len_dist, frozenset(down)),
        pickle.loads(pickle.dumps(TraceStep(0, base.response_len_dist, frozenset(grown)))),
    ]
    assert len({repr(conditions(s)) for s in steps}) == 1
