"""A mixture of experts' layers on one GPU, for the event truth: routing as drawn, the busiest
expert-parallel rank, its experts' GEMMs and the dispatcher's collectives.

- **Routing** (``routing``): each expert's share of the tokens is drawn per step and sampled
  MoE layer: log-normal popularity (sigma ``EXPERT_SKEW``), normalised. A token goes to ``k``
  distinct experts, so expert ``e`` receives ``k p_e`` of the tokens. The skew is an
  assumption: load-balancing losses keep experts near even but not at it, and no source gives
  the busiest expert's load for the models here. ``ROUTED_LAYERS`` layers are drawn (sampled);
  each layer's busiest rank sets that layer's time, and the drawn layers' mean stands for all.
- **Where experts sit**: Megatron's carving (``Layout.expert_rank``): EP rank ``r`` holds
  experts ``r E/ep .. (r+1) E/ep - 1``, each split over ``etp`` ranks, copied ``expert_dp``
  times. Expert ``e``'s tokens in a pipeline stage, ``replicas x tokens x k p_e``, are shared by
  its copies; each of its ``etp`` ranks multiplies all of a copy's tokens by its slice.
- **GEMMs**: per expert, at its own token count (``kernels.gemms_seconds``), in one grouped GEMM
  per projection (one launch for all of a GPU's experts). In decode a batch of
  ``n`` tokens touches expert ``e`` with probability ``1 - (1 - k p_e)^n``; a touched expert's
  GEMM runs on its tokens given it is touched, and its weights are read once.
- **The dispatcher** (Megatron's all-to-all dispatcher): a GPU's own tokens (its TP rank's share
  under sequence parallelism, as Megatron requires with TP) go ``k`` times to their experts'
  EP ranks and come back: an all-to-all each way over the EP group
  (``network.all_to_all_seconds``), the busiest rank receiving its load's share more; with
  ``etp > 1`` the ETP group then all-gathers them and reduce-scatters the outputs. An engine's
  EP over its own TP ranks (vLLM's, without data-parallel attention) moves nothing more than its
  TP all-reduce: every rank holds the batch's tokens.
"""

from __future__ import annotations

from typing import cast

import numpy as np

from ...ir import Cluster, Layout, Model
from .kernels import LAUNCH_S, gemms_seconds
from .network import SUPERPOD, Fabric, all_to_all_seconds, collective_seconds, link_of, slowdowns

EXPERT_SKEW = 0.5  # sigma of an expert's log-popularity (an assumption, see the docstring)
ROUTED_LAYERS = 4  # MoE layers whose routing is drawn per step (sampled)
ACT = 2  # bytes of an activation (bf16)


def routing(model: Model, rng: np.random.Generator) -> np.ndarray:
    """The drawn layers' token shares per expert (``ROUTED_LAYERS`` x ``experts``, rows sum to 1)."""
    w = rng.lognormal(0.0, EXPERT_SKEW, size=(ROUTED_LAYERS, cast(int, model.experts)))
    return w / w.sum(axis=1, keepdims=True)


def even(model: Model) -> np.ndarray:
    e = cast(int, model.experts)
    return np.full((1, e), 1.0 / e)


def stage_gpu(lay: Layout, r: int, stage: int = 0) -> int:
    """The GPU of rank ``r`` of pipeline stage ``stage`` (``tp`` fastest, then replica)."""
    replica, t = divmod(r, lay.tp)
    return lay.mesh[(replica * lay.pp + stage) * lay.tp + t]


def ep_groups(lay: Layout) -> list[list[int]]:
    """Every EP group of every pipeline stage: stage ranks ``etp x j + etp x ep x d + t`` for an
    ETP rank ``t`` and an expert-DP rank ``d``."""
    etp, ep = lay.expert_tp, lay.ep
    return [
        [stage_gpu(lay, t + etp * j + etp * ep * d, s) for j in range(ep)]
        for s in range(lay.pp)
        for d in range(lay.expert_dp)
        for t in range(etp)
    ]


def expert_dp_groups(lay: Layout) -> list[list[int]]:
    """Every expert-DP group (an expert slice's copies) of every pipeline stage."""
    etp, ep = lay.expert_tp, lay.ep
    return [
        [stage_gpu(lay, r + etp * ep * d, s) for d in range(lay.expert_dp)]
        for s in range(lay.pp)
        for r in range(etp * ep)
    ]


def ep_group(lay: Layout, stage: int = 0) -> list[int]:
    """The GPUs of the EP group of stage ``stage``'s first rank (ETP rank 0, expert-DP rank 0):
    stage ranks ``etp x j``."""
    return [stage_gpu(lay, lay.expert_tp * j, stage) for j in range(lay.ep)]


_SLOWDOWNS: dict[tuple, float] = {}


def dispatch_slowdown(lay: Layout, cluster: Cluster, fabric: Fabric) -> float:
    """The dispatcher's slowdown when every EP group of every stage sends at once (1F1B's steady
    state keeps every stage in its layers; an assumption that bounds it from above)."""
    key = (tuple(lay.mesh), lay.tp, lay.pp, lay.dp, lay.cp, lay.ep, lay.expert_tp, cluster.gpus_per_node, fabric)
    if key not in _SLOWDOWNS:
        if len(_SLOWDOWNS) > 4096:
            _SLOWDOWNS.clear()
        phase = [("all_to_all", g) for g in ep_groups(lay)]
        _SLOWDOWNS[key] = max(slowdowns(cluster, fabric, phase))
    return _SLOWDOWNS[key]


class Experts:
    """One GPU's share of a MoE layer under ``lay`` with the drawn ``shares`` (layers x experts);
    ``engine``: a generation engine's layout."""

    def __init__(
        self,
        model: Model,
        lay: Layout,
        cluster: Cluster,
        shares: np.ndarray,
        engine: bool = False,
        fabric: Fabric = SUPERPOD,
    ):
        self.m, self.lay, self.c, self.engine, self.fabric = model, lay, cluster, engine, fabric
        self.k = cast(int, model.experts_per_token)
        self.f = cast(int, model.expert_ffn)
        e = cast(int, model.experts)
        self.q = np.minimum(self.k * shares, 1.0)  # a token's chance to go to each expert
        # tokens of a replica per expert copy, per token of the replica: replicas x k p_e / expert_dp
        self.per_copy = lay.replicas * self.q / lay.expert_dp
        self.by_rank = self.q.reshape(len(shares), lay.ep, e // lay.ep)
        # the busiest rank's tokens over the mean rank's, per drawn layer
        self.load = float((self.by_rank.sum(axis=2).max(axis=1) * lay.ep / self.k).mean())
        self.group = ep_group(lay)
        etp_gpus = lay.mesh[: lay.expert_tp]
        _, self.etp_bw, self.etp_lat = link_of(cluster, etp_gpus)

    @property
    def contention(self) -> float:
        return dispatch_slowdown(self.lay, self.c, self.fabric)

    def gemm_seconds(self, tokens: float, decode: bool = False) -> float:
        """Forward GEMMs of the busiest EP rank's experts for ``tokens`` of a replica (a decode
        batch's tokens when ``decode``: only the experts they touch run)."""
        m, c, etp = self.m, self.c, self.lay.expert_tp
        x = self.per_copy * tokens
        if decode:
            touched = 1.0 - (1.0 - self.q) ** tokens
            per = np.divide(x, touched, out=np.zeros_like(x), where=touched > 0)
        else:
            touched, per = np.ones_like(x), x
        t = touched * (
            gemms_seconds(per, 2 * self.f / etp, m.hidden, c.peak_flops, c.hbm_bandwidth)
            + gemms_seconds(per, m.hidden, self.f / etp, c.peak_flops, c.hbm_bandwidth)
            - 2 * LAUNCH_S
        )
        e = cast(int, m.experts)
        # one grouped GEMM per projection runs every local expert (vLLM's fused MoE kernel,
        # Megatron's grouped GEMM): two launches, each expert at its own shape's efficiency
        return float(t.reshape(len(t), self.lay.ep, e // self.lay.ep).sum(axis=2).max(axis=1).mean()) + 2 * LAUNCH_S

    def touched_bytes(self, tokens: float) -> float:
        """Bytes of expert weights a decode batch of ``tokens`` reads on the busiest EP rank (one MoE layer)."""
        m = self.m
        expert = 3 * self.f * m.hidden * m.dtype_bytes / self.lay.expert_tp
        touched = 1.0 - (1.0 - self.by_rank) ** tokens
        return float(touched.sum(axis=2).max(axis=1).mean() * expert)

    def dispatch_seconds(self, tokens: float) -> float:
        """The dispatcher's collectives of one MoE layer, one way (dispatch or combine), for
        ``tokens`` of a replica; 0 where the experts are split as the dense layers are."""
        lay = self.lay
        if not lay.carves_experts or (self.engine and lay.ep <= lay.tp):
            return 0.0
        own = tokens / lay.tp * self.k * self.m.hidden * ACT  # this GPU's tokens, k copies each
        t = all_to_all_seconds(self.c, self.group, own * self.load, share=self.contention)
        etp = lay.expert_tp
        if etp > 1:
            t += collective_seconds("all_gather", own * etp * self.load, etp, self.etp_bw, self.etp_lat)
        return t
