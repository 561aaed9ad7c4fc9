"""Collectives by their algorithm, for the event truth.

A collective over ``n`` GPUs moves its bytes in steps, each a message per GPU over the slowest
link the group crosses: NVLink inside a node, the GPU's NIC between nodes. NCCL picks, per call,
the faster of a ring and a tree (double binary tree) for an all-reduce; all-gather and
reduce-scatter are rings; an all-to-all sends ``n - 1`` messages from every GPU; a pipeline send
is one message. A link carries its bytes at ``LINK_EFFICIENCY`` of its bandwidth and pays its
latency per step (``Link.latency`` of the cluster).
A ring between nodes runs a channel through each NIC of a node, as NCCL builds them: with ``k``
members on a node it crosses at ``k`` NICs' rate, bounded by NVLink (``ring_link_of``).

An all-to-all over a group spread across nodes (``all_to_all_seconds``: expert parallelism's
dispatch and combine) sends to the peers on its node over NVLink and to the others over its NIC
at the same time; it lasts as long as the slower of the two.

**Contention** (``Fabric``, ``slowdowns``): flows that run at the same time and cross the same NIC
or the same leaf group's uplinks share them. A ``phase`` lists the collectives that run at once
(every data-parallel ring of a model-stage, and those of the model-stages training beside it);
each collective runs at its slowest link's share: a NIC that sends ``u`` flows gives each
``1 / u``, and a leaf group whose GPUs send ``u`` NIC-rates to other leaf groups over uplinks of
``c`` gives each ``c / u`` when ``u > c``. Rates are offered loads (each flow at its NIC's rate),
the bottleneck's ratio is the share: an approximation of max-min fairness. An all-to-all's flows
to its own leaf group are not slowed by the uplinks; it lasts as long as its slowest part.
The default fabric (a DGX SuperPOD's) is non-blocking with a NIC per GPU: there, flows of one
phase that each use their own NIC never wait. Pipeline sends are left out of the phases (a
micro-batch's activations, small and spread over the step) except where one shares a NIC with
the gradient sync it overlaps (``stages``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from ...ir import Cluster

LINK_EFFICIENCY = {"nvlink": 0.8, "nic": 0.85}  # bus bandwidth of large messages (an assumption, nccl-tests-like)


@dataclass(frozen=True)
class Fabric:
    """The switches above the NICs: a rail-optimized two-tier fat tree. ``leaf_nodes`` nodes form a
    leaf group (their rails' leaf switches), whose uplinks to the spine carry ``1 /
    oversubscription`` of what its NICs can send. The default is NVIDIA's DGX SuperPOD (H100)
    reference architecture: scalable units of 32 nodes, each GPU's NIC on its rail's leaf, a
    non-blocking spine. NCCL's PXN moves a flow to another rail over NVLink first, so a flow
    between nodes stays on its rail inside a leaf group (an assumption)."""

    leaf_nodes: int = 32
    oversubscription: float = 1.0

    def uplink(self, cluster: Cluster) -> float:
        """A leaf group's uplink capacity, in NIC rates."""
        return self.leaf_nodes * cluster.gpus_per_node / self.oversubscription


SUPERPOD = Fabric()


def slowdowns(cluster: Cluster, fabric: Fabric, phase: list[tuple[str, list[int]]]) -> list[float]:
    """Each collective's slowdown (1: alone at its links' rate) when the collectives of ``phase``
    run at once. A collective is ``("ring", gpus)`` (an all-reduce, all-gather or reduce-scatter:
    NCCL's ring visits its nodes in order) or ``("all_to_all", gpus)``. For an all-to-all the
    share is that of its part that crosses leaf groups, weighted by that part's fraction of its
    inter-node bytes (see ``all_to_all_seconds``'s ``share``)."""
    per, leaf_nodes = cluster.gpus_per_node, fabric.leaf_nodes
    nic: dict[int, float] = defaultdict(float)
    up: dict[int, float] = defaultdict(float)
    down: dict[int, float] = defaultdict(float)
    flows = []  # per collective: (senders, leaves it sends from or to, its crossing fraction)
    for kind, gpus in phase:
        node = [g // per for g in gpus]
        leaf = [n // leaf_nodes for n in node]
        senders, crossed, cross = [], set(), 0.0
        if kind == "ring":
            # NCCL runs a channel through each NIC of a node: where the ring leaves a node, every
            # member there sends its share over its own NIC, at that NIC's rate
            order = sorted(range(len(gpus)), key=lambda i: gpus[i])
            for a, b in zip(order, order[1:] + order[:1]):
                if node[a] == node[b]:
                    continue  # NVLink
                members = [g for g, n in zip(gpus, node) if n == node[a]]
                for g in members:
                    nic[g] += 1
                senders += members
                if leaf[a] != leaf[b]:
                    up[leaf[a]] += len(members)
                    down[leaf[b]] += len(members)
                    crossed |= {leaf[a], leaf[b]}
                    cross = 1.0
        elif kind == "all_to_all":
            for i, g in enumerate(gpus):
                remote = [j for j in range(len(gpus)) if node[j] != node[i]]
                if not remote:
                    continue
                nic[g] += 1
                senders.append(g)
                off = [j for j in remote if leaf[j] != leaf[i]]
                if off:
                    f = len(off) / len(remote)
                    up[leaf[i]] += f
                    for j in off:
                        down[leaf[j]] += 1 / len(remote)
                    crossed |= {leaf[i]} | {leaf[j] for j in off}
                    cross = max(cross, f)
        else:
            raise ValueError(f"unknown flow {kind}")
        flows.append((senders, crossed, cross))
    cap = fabric.uplink(cluster)
    out = []
    for senders, crossed, cross in flows:
        at_nic = max((nic[g] for g in senders), default=1.0)
        at_spine = max((max(up[lf], down[lf]) / cap for lf in crossed), default=1.0)
        out.append(max(1.0, at_nic, cross * at_spine))
    return out


def link_of(cluster: Cluster, gpus: list[int]) -> tuple[str, float, float]:
    """The slowest link ``gpus`` cross: (kind, bytes per second, latency)."""
    per = cluster.gpus_per_node
    if len({g // per for g in gpus}) <= 1:
        link = cluster.intra_node
        return "nvlink", link.bandwidth * LINK_EFFICIENCY["nvlink"], link.latency
    link = cluster.inter_node
    return "nic", link.bandwidth * LINK_EFFICIENCY["nic"], link.latency


def ring_link_of(cluster: Cluster, gpus: list[int]) -> tuple[str, float, float]:
    """``link_of`` for a ring (all-reduce, all-gather, reduce-scatter) over ``gpus``: between nodes
    NCCL runs a channel through each NIC, so a ring with ``k`` members on a node crosses at ``k``
    NICs' rate, bounded by NVLink, which carries every member's whole ring (the groups here are
    alike on every node they touch)."""
    kind, bandwidth, latency = link_of(cluster, gpus)
    if kind != "nic":
        return kind, bandwidth, latency
    per = cluster.gpus_per_node
    members = sum(1 for g in gpus if g // per == gpus[0] // per)
    nvlink = cluster.intra_node.bandwidth * LINK_EFFICIENCY["nvlink"]
    return kind, min(bandwidth * members, nvlink), latency


def collective_seconds(
    kind: str, data: float, n: int, bandwidth: float, latency: float, *, share: float = 1.0
) -> float:
    """One collective over ``n`` GPUs of ``data`` bytes per GPU (the full buffer of an
    all-reduce, the gathered result of an all-gather, each GPU's whole send of an all-to-all)."""
    if n <= 1 or data <= 0:
        return 0.0
    bw = bandwidth / max(share, 1.0)
    if kind == "all_reduce":
        ring = 2 * (n - 1) / n * data / bw + 2 * (n - 1) * latency
        tree = 2 * data / bw + 2 * math.ceil(math.log2(n)) * latency  # pipelined double binary tree
        return min(ring, tree)
    if kind in ("all_gather", "reduce_scatter"):
        return (n - 1) / n * data / bw + (n - 1) * latency
    if kind == "all_to_all":
        return (n - 1) / n * data / bw + (n - 1) * latency
    if kind == "send":
        return data / bw + latency
    raise ValueError(f"unknown collective {kind}")


def all_to_all_seconds(cluster: Cluster, gpus: list[int], data: float, *, share: float = 1.0) -> float:
    """An all-to-all over ``gpus`` in which each sends ``data`` bytes in all, an equal part to every
    member (itself included): its node's peers over NVLink and the rest over its NIC, side by
    side (seen from the first member; the groups here are alike on every node they touch)."""
    n = len(gpus)
    if n <= 1 or data <= 0:
        return 0.0
    per = cluster.gpus_per_node
    local = sum(1 for g in gpus if g // per == gpus[0] // per)
    intra, inter = cluster.intra_node, cluster.inter_node
    nvlink = (local - 1) / n * data / (intra.bandwidth * LINK_EFFICIENCY["nvlink"]) + (local - 1) * intra.latency
    remote = n - local
    nic = remote / n * data / (inter.bandwidth * LINK_EFFICIENCY["nic"] / max(share, 1.0)) + remote * inter.latency
    return max(nvlink, nic)
