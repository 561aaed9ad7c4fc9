"""The cluster: nodes x GPUs, what each GPU can do, and the links between them."""

from __future__ import annotations

from dataclasses import dataclass, field

from .attributes import LINK, AttrSpec, Link, record
from .diagnostics import NOWHERE, Loc

CLUSTER_ATTRS = [
    AttrSpec("nodes", "posint", doc="number of nodes"),
    AttrSpec("gpus_per_node", "posint", doc="GPUs in each node"),
    AttrSpec("gpu_memory", "size", doc="memory of one GPU, e.g. 80GiB"),
    AttrSpec("peak_flops", "flops", doc="dense bf16 peak of one GPU, e.g. 989TFLOPs"),
    AttrSpec("hbm_bandwidth", "bandwidth", doc="HBM bandwidth of one GPU, e.g. 3.35TB/s"),
    record("intra_node", LINK, doc="per-GPU NVLink: link(bandwidth = 450GB/s, latency = 2us)"),
    record("inter_node", LINK, doc="per-GPU NIC: link(bandwidth = 50GB/s, latency = 5us)"),
    record("host_link", LINK, default=None, doc="per-GPU PCIe to host memory, for offload"),
    AttrSpec("host_memory", "size", default=None, doc="host memory of one node"),
    AttrSpec("unavailable", "ints", default=[], doc="GPU ids that cannot be used"),
]


@dataclass(kw_only=True)
class Cluster:
    name: str
    nodes: int
    gpus_per_node: int
    gpu_memory: int
    peak_flops: float
    hbm_bandwidth: float
    intra_node: Link
    inter_node: Link
    host_link: Link | None = None
    host_memory: int | None = None
    unavailable: list[int] = field(default_factory=list)
    loc: Loc = field(default=NOWHERE, compare=False, repr=False)
    locs: dict[str, Loc] = field(default_factory=dict, compare=False, repr=False)
    comments: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def available_gpus(self) -> list[int]:
        down = set(self.unavailable)
        return [g for g in range(self.num_gpus) if g not in down]

    def node_of(self, gpu: int) -> int:
        return gpu // self.gpus_per_node

    def link_kind(self, a: int, b: int) -> str:
        """``local`` for the same GPU, ``nvlink`` inside a node, ``nic`` across nodes."""
        if a == b:
            return "local"
        return "nvlink" if self.node_of(a) == self.node_of(b) else "nic"
