"""Collectives by their algorithm, for the event truth.

A collective over ``n`` GPUs moves its bytes in steps, each a message per GPU over the slowest
link the group crosses: NVLink inside a node, the GPU's NIC between nodes. NCCL picks, per call,
the faster of a ring and a tree (double binary tree) for an all-reduce; all-gather and
reduce-scatter are rings; an all-to-all sends ``n - 1`` messages from every GPU; a pipeline send
is one message. A link carries its bytes at ``LINK_EFFICIENCY`` of its bandwidth and pays its
latency per step (``Link.latency`` of the cluster).

An all-to-all over a group spread across nodes (``all_to_all_seconds``: expert parallelism's
dispatch and combine) sends to the peers on its node over NVLink and to the others over its NIC
at the same time; it lasts as long as the slower of the two.

**Contention**: flows that cross the same NIC at the same time share it; ``share`` is how many
do (1: alone). The stages do not pass one yet: each GPU is taken to have a NIC of its own (a DGX
H100's), and a data-parallel all-reduce is not yet made to share it with pipeline sends.
"""

from __future__ import annotations

import math

from ...ir import Cluster

LINK_EFFICIENCY = {"nvlink": 0.8, "nic": 0.85}  # bus bandwidth of large messages (an assumption, nccl-tests-like)


def link_of(cluster: Cluster, gpus: list[int]) -> tuple[str, float, float]:
    """The slowest link ``gpus`` cross: (kind, bytes per second, latency)."""
    per = cluster.gpus_per_node
    if len({g // per for g in gpus}) <= 1:
        link = cluster.intra_node
        return "nvlink", link.bandwidth * LINK_EFFICIENCY["nvlink"], link.latency
    link = cluster.inter_node
    return "nic", link.bandwidth * LINK_EFFICIENCY["nic"], link.latency


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
