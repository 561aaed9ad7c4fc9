"""Contention in the event truth (``network.slowdowns``): collectives that run at once share a NIC
or a leaf group's uplinks. The counts are worked by hand on small fabrics; then the 70B job's
gradient syncs under a fabric oversubscribed 1:7 above 32-node pods, and two trainings side by
side."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from nereus.ir import Cluster, Link, parse, verify
from nereus.sim.simulated_cluster import SimCluster
from nereus.sim.trace import read_trace
from nereus.sim.truth import stages
from nereus.sim.truth.misspecified import Misspecification
from nereus.sim.truth.network import SUPERPOD, Fabric, slowdowns
from nereus.testing.jobs import EXAMPLES

TRACES = Path(__file__).resolve().parents[2] / "nereus" / "sim" / "traces"


def cluster(nodes: int) -> Cluster:
    return Cluster(
        name="c",
        nodes=nodes,
        gpus_per_node=8,
        gpu_memory=80 * 2**30,
        peak_flops=989e12,
        hbm_bandwidth=3.35e12,
        intra_node=Link(bandwidth=450e9, latency=1e-6),
        inter_node=Link(bandwidth=50e9, latency=5e-6),
    )


def rails(nodes: int) -> list[list[int]]:
    """One group per rail: GPU ``t`` of every node."""
    return [[8 * n + t for n in range(nodes)] for t in range(8)]


def test_rings_across_an_oversubscribed_spine_share_its_uplinks():
    """4 nodes in 2 leaf groups of 2; each rail's ring (nodes 0, 1, 2, 3) crosses the spine
    twice, once out of each group. 8 rings send 8 NIC-rates out of each group: over uplinks of
    16 / 4 = 4 NIC-rates, each runs at half its rate; non-blocking, at its own."""
    c = cluster(4)
    phase = [("ring", g) for g in rails(4)]
    assert slowdowns(c, Fabric(leaf_nodes=2, oversubscription=4), phase) == [2.0] * 8
    assert slowdowns(c, Fabric(leaf_nodes=2, oversubscription=1), phase) == [1.0] * 8
    # two rings alone send 2 NIC-rates out of each group: under its 4
    assert slowdowns(c, Fabric(leaf_nodes=2, oversubscription=4), phase[:2]) == [1.0] * 2
    # rings inside one leaf group never reach the spine, however thin it is
    assert slowdowns(c, Fabric(leaf_nodes=4, oversubscription=100), phase) == [1.0] * 8


def test_two_collectives_through_one_nic_each_run_at_half_its_rate():
    c = cluster(4)
    phase = [("ring", [0, 8]), ("ring", [0, 16]), ("ring", [1, 9])]
    assert slowdowns(c, SUPERPOD, phase) == [2.0, 2.0, 1.0]
    # a ring whose members share a node crosses no NIC there
    assert slowdowns(c, SUPERPOD, [("ring", [0, 1]), ("ring", [0, 8])]) == [1.0, 1.0]


def test_an_all_to_all_is_slowed_only_in_its_part_that_crosses_the_spine():
    """Each rail's all-to-all over 4 nodes in 2 groups: a member sends 2/3 of its inter-node
    bytes out of its group. 8 of them send 8 x 2 x 2/3 = 32/3 NIC-rates out of each group; over
    uplinks of 16 / 8 = 2 that part runs at 3/16 of its rate, so the whole lasts 2/3 x 16/3 =
    32/9 times as long as alone."""
    c = cluster(4)
    phase = [("all_to_all", g) for g in rails(4)]
    assert slowdowns(c, Fabric(leaf_nodes=2, oversubscription=8), phase) == pytest.approx([32 / 9] * 8)
    # at 2:1 the uplinks carry 8 NIC-rates: 32/3 over 8 = 4/3, times 2/3 of the bytes < 1
    assert slowdowns(c, Fabric(leaf_nodes=2, oversubscription=2), phase) == [1.0] * 8


@pytest.fixture(scope="module")
def job():
    """The 70B job's plan with its trainings on the two halves of the GPUs: the actor TP 8 x PP 8
    on GPUs 512..1023, the critic TP 8 x PP 4 on 0..511 (as the plan search placed them until
    NCCL's per-NIC rings made ZeRO-3 at TP 1 its choice; written out, so that these tests do not
    follow the search)."""
    module = verify(parse(EXAMPLES["ppo_70b_1024gpu.nir"](), "ppo_70b_1024gpu.nir"))
    sim = SimCluster(module, read_trace(TRACES / "length_growth.jsonl"), model="event")
    p0 = module.plans["ppo70b_p0"]
    actor = dataclasses.replace(
        p0.layouts["actor.train"],
        pp=8,
        dp=8,
        layers=[(10 * i, 10 * i + 9) for i in range(8)],
        mesh=list(range(512, 1024)),
        time=None,
        memory=None,
    )
    critic = dataclasses.replace(p0.layouts["critic.train"], dp=16, mesh=list(range(512)), time=None, memory=None)
    layouts = {**p0.layouts, "actor.train": actor, "critic.train": critic}
    plan = dataclasses.replace(p0, name="halves", colocate=[], layouts=layouts)
    module.plans["halves"] = plan
    verify(module)
    return module, sim, plan


def test_only_syncs_that_overfill_the_pods_uplinks_slow_down(job):
    """The 70B job's plan (``job``) under ``oversubscribed``: the actor trains on one half of the
    GPUs, TP 8 x PP 8, so 64 DP rings each cross two 32-node pods: 64 NIC-rates over uplinks of
    256 / 7. The critic's 32 rings (TP 8 x PP 4 on the other half) fit under them, and generation
    and inference sync nothing."""
    module, sim, plan = job
    actor, critic = plan.layouts["actor.train"], plan.layouts["critic.train"]
    assert (actor.tp * actor.pp, critic.tp * critic.pp) == (64, 32)
    halves = sorted([sorted(actor.mesh), sorted(critic.mesh)])
    assert halves == [list(range(512)), list(range(512, 1024))]
    over = SimCluster(module, sim.trace, model="oversubscribed")
    base, slow = sim._evaluate(plan, 0), over._evaluate(plan, 0)
    assert slow.seconds["actor.train"] > base.seconds["actor.train"]
    assert {ms: t for ms, t in slow.seconds.items() if ms != "actor.train"} == {
        ms: t for ms, t in base.seconds.items() if ms != "actor.train"
    }


def test_a_training_beside_another_on_the_same_pods_waits_for_the_uplinks(job):
    """The actor's training layout spread over every other node, and its copy on the nodes
    between: alone each sends 64 NIC-rates out of a pod, together 128. Under uplinks of 256 / 5
    = 51.2 NIC-rates the first is slowed beside the second and a little alone; on the
    non-blocking fabric neither."""
    module, sim, plan = job
    lay = plan.layouts["actor.train"]
    even = dataclasses.replace(lay, mesh=[g % 8 + 16 * (g // 8 - 64) for g in lay.mesh])
    odd = dataclasses.replace(lay, mesh=[g + 8 for g in even.mesh])
    assert not set(even.mesh) & set(odd.mesh)
    (work,) = module.workloads.values()
    c = next(iter(module.clusters.values()))
    model = module.models[lay.model]
    lengths = np.full(work.samples, work.prompt_len_mean + 2048)

    def train(fabric: Fabric, beside=()) -> float:
        miss = Misspecification("f", fabric=fabric)
        return stages.train_or_infer(model, even, work, c, lengths, "train", miss, beside=beside)[0]

    thin = Fabric(leaf_nodes=32, oversubscription=5)
    alone, together = train(thin), train(thin, (odd,))
    assert train(SUPERPOD) == train(SUPERPOD, (odd,)) < alone < together
