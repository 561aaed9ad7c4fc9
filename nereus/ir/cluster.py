"""The cluster: nodes x GPUs, what each GPU can do, and the links between them."""

from __future__ import annotations

from dataclasses import dataclass, field

from .attributes import LINK, AttrSpec, Link, RecordSpec, record
from .diagnostics import NOWHERE, Loc


@dataclass(frozen=True)
class Efficiency:
    """Achieved fractions of peak (compute, HBM, links) and a fixed cost per layer pass.

    The defaults are priors for a well-tuned bf16 stack: the GEMMs of a transformer layer at
    0.6 of peak (end-to-end, Megatron-LM reports 43-57% of peak on A100 GPT training and FSDP
    runs 50-64%, which include the bubble and communication the model adds separately; 0.6 was
    set from 0.5 with the published set of ``validation/`` in view, see docs/PERFORMANCE.md);
    decode kernels reach 60-80% of HBM bandwidth; NCCL buses reach 70-80% of link bandwidth;
    data-parallel communication beside compute is 90% hidden (``overlap``). ``calibrate``
    replaces them with values fitted to the job.

    ``memory_slack``: device memory a training or inference step holds at its peak per byte the
    cost model counts (weights, gradients, optimizer state, activations, logits). What the model
    does not count is the caching allocator's fragmentation and slack, the CUDA context and the
    libraries' workspaces, which a measured peak and a published per-GPU memory figure include.
    The prior, 1, counts none of it: no published figure was fitted. ``calibrate`` sets it to the
    largest ratio of a measured peak to the model's count in its records, so a job's own peaks
    decide which plans fit (generation is exempt: the engine fills its memory by design).

    ``expert_imbalance``: under expert parallelism, the tokens the busiest EP rank's experts
    receive per token of the mean (a mixture of experts' routing is uneven; the step waits for
    the busiest rank). It scales the experts' GEMMs and the all-to-all of layouts with ``ep > 1``.
    The prior, 1, is even routing (what a router's load-balancing loss aims at); no published
    figure was fitted. ``calibrate`` fits it when its records hold such layouts.

    ``gemm_knee``: kernel efficiency by shape. A GEMM of ``m x k`` by ``k x n`` on one GPU runs at
    ``compute / (1 + knee / size)`` of the peak, ``size`` = ``3 / (1/m + 1/n + 1/k)`` (the cube
    root of ``m n k`` for a square GEMM, about three times the thinnest dimension of a thin one)
    and ``knee`` this number times the GPU's machine balance (peak FLOPs per HBM byte), so a
    small GEMM (a small model's, a high TP degree's, an expert's few tokens) costs more per FLOP
    than a large one; ``compute`` is then the level the largest GEMMs approach. The form is the
    roofline's sum of a GEMM's FLOPs and its operands' bytes, ``(m k + k n + m n)``, at an
    effective traffic the knee sets; one number per GPU kind scales by its balance. On
    H100 SXM, cuBLAS bf16 reaches 716, 741 and 798 TFLOPs at M = N = K = 4096, 6144 and 8192
    (github.com/pranjalssh/fast.cu, README, "Kernel 0: cuBLAS"), which this form fits with a
    knee of 1,008 at 295 FLOPs per byte: 3.4 (``GEMM_KNEE_H100``). The prior, 0, keeps one
    efficiency for every GEMM: with 3.4 the published set's hold-out errors move both ways
    (docs/PERFORMANCE.md), so it is not the default. ``calibrate{fit_knee=true}`` fits it on a
    grid from records that span GEMM shapes.
    """

    compute: float = 0.6
    hbm: float = 0.7
    nvlink: float = 0.7
    nic: float = 0.7
    pcie: float = 0.7
    overhead: float = 10e-6  # seconds per layer per pass over a micro-batch or decode step
    overlap: float = 0.9  # share of data-parallel communication hidden behind the compute it can overlap
    memory_slack: float = 1.0  # peak bytes held per byte counted, training and inference (see above)
    expert_imbalance: float = 1.0  # busiest EP rank's routed tokens per mean (see above)
    gemm_knee: float = 0.0  # GEMM size at half the largest GEMMs' efficiency, per FLOP/byte of balance (above)


# How far each prior of ``Efficiency`` may be off, as stated with it (``validation/holdout.json``
# records the same numbers and the hold-out errors measured with them): the links and HBM from
# the vendors' 60-80% ranges, compute from the 43-64% that Megatron-LM and FSDP runs report, the
# overhead to within a kernel launch per layer pass. ``calibrate`` pulls each fitted coefficient
# toward its prior with a weight of ``model_error`` / (uncertainty / prior).
PRIOR_UNCERTAINTY = {
    "compute": 0.1,
    "hbm": 0.1,
    "nvlink": 0.1,
    "nic": 0.1,
    "pcie": 0.1,
    "overhead": 10e-6,
    "overlap": 0.1,
    "memory_slack": 0.0,
    "expert_imbalance": 0.0,
    "gemm_knee": 0.0,
}
# the GEMM knee of H100 SXM's cuBLAS bf16 curve (``Efficiency.gemm_knee``), published, not fitted here
GEMM_KNEE_H100 = 3.4


@dataclass(frozen=True)
class Calibration:
    """What ``calibrate`` fitted: how many measurements, mean absolute % error before and after."""

    records: int
    error_before: float
    error_after: float


EFFICIENCY = RecordSpec(
    "efficiency",
    (
        AttrSpec("compute", "float", 0.6),
        AttrSpec("hbm", "float", 0.7),
        AttrSpec("nvlink", "float", 0.7),
        AttrSpec("nic", "float", 0.7),
        AttrSpec("pcie", "float", 0.7),
        AttrSpec("overhead", "time", 10e-6),
        AttrSpec("overlap", "float", 0.9),
        AttrSpec("memory_slack", "float", 1.0),
        AttrSpec("expert_imbalance", "float", 1.0),
        AttrSpec("gemm_knee", "float", 0.0),
    ),
    Efficiency,
)
CALIBRATION = RecordSpec(
    "calibration",
    (AttrSpec("records", "posint"), AttrSpec("error_before", "float"), AttrSpec("error_after", "float")),
    Calibration,
)

CLUSTER_ATTRS = [
    AttrSpec("nodes", "posint", doc="number of nodes"),
    AttrSpec("gpus_per_node", "posint", doc="GPUs in each node"),
    AttrSpec("gpu_memory", "size", doc="memory of one GPU, e.g. 80GiB"),
    AttrSpec("peak_flops", "flops", doc="dense bf16 peak of one GPU, e.g. 989TFLOPs"),
    AttrSpec(
        "peak_flops_fp8",
        "flops",
        default=None,
        doc="dense FP8 peak of one GPU, e.g. 1979TFLOPs (layouts with fp8 = true)",
    ),
    AttrSpec("hbm_bandwidth", "bandwidth", doc="HBM bandwidth of one GPU, e.g. 3.35TB/s"),
    record("intra_node", LINK, doc="per-GPU NVLink: link(bandwidth = 450GB/s, latency = 2us)"),
    record("inter_node", LINK, doc="per-GPU NIC: link(bandwidth = 50GB/s, latency = 5us)"),
    record("host_link", LINK, default=None, doc="per-GPU PCIe to host memory, for offload"),
    AttrSpec("host_memory", "size", default=None, doc="host memory of one node"),
    AttrSpec("unavailable", "ints", default=[], doc="GPU ids that cannot be used"),
    record(
        "efficiency", EFFICIENCY, default=None, doc="cost-model coefficients; defaults are priors, calibrate fits them"
    ),
    record("calibration", CALIBRATION, default=None, doc="set by calibrate: records used and error before/after"),
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
    peak_flops_fp8: float | None = None
    unavailable: list[int] = field(default_factory=list)
    efficiency: Efficiency | None = None
    calibration: Calibration | None = None
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
