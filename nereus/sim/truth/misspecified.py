"""Misspecified truths: the event truth with errors the cost model cannot know of.

A conclusion drawn from the simulator should survive a truth that differs from every model the
policies plan with. Each ``Misspecification`` adds one kind of error to the event truth:

- ``hidden``: every configuration (a model-stage's kind, model and layout) runs at its own
  hidden factor, log-normal with sigma 0.1, drawn once per configuration (seeded by it): two
  plans the cost model ranks close may swap, and calibration sees a different error per layout.
- ``long-gen``: decode iterations slower at long contexts, by a factor rising linearly from 1 at
  a mean context of ``RAMP_FROM`` tokens to 1.2 from ``RAMP_TO`` (attention kernels and KV-cache
  reads that fall off at long sequences; the cost model prices tokens alike at every length).
- ``slow-inter``: data-parallel collectives that cross nodes (all-reduce, all-gather,
  reduce-scatter) 30% slower (congestion on the fabric; the cost model knows one NIC efficiency).
- ``oversubscribed``: the fabric above every 32 nodes oversubscribed 1:7, as the aggregation
  layer above Meta's Llama 3 pods is (Dubey et al. 2024, section 3.3.1; their pods hold 3,072
  GPUs, here 256): collectives that run at once and cross pods share the uplinks
  (``network.slowdowns``). The event truth's own fabric is non-blocking (``network.SUPERPOD``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .network import SUPERPOD, Fabric

RAMP_FROM, RAMP_TO = 4096, 16384  # mean context, tokens


@dataclass(frozen=True)
class Misspecification:
    name: str = "none"
    hidden_sigma: float = 0.0  # per configuration, log-normal
    long_context: float = 1.0  # decode slowdown at a mean context of RAMP_TO and beyond
    inter_node: float = 1.0  # data-parallel collectives across nodes
    fabric: Fabric = SUPERPOD  # the switches: where concurrent flows share uplinks

    def context_factor(self, mean_context: float) -> float:
        """A decode iteration's slowdown at this mean context per running request."""
        if self.long_context == 1.0:
            return 1.0
        ramp = min(max((mean_context - RAMP_FROM) / (RAMP_TO - RAMP_FROM), 0.0), 1.0)
        return 1.0 + (self.long_context - 1.0) * ramp

    def hidden_factor(self, seed: int) -> float:
        """A configuration's hidden factor; ``seed`` names the configuration."""
        if not self.hidden_sigma:
            return 1.0
        # Box-Muller from the seed's two halves: the same configuration, the same factor, in any process
        u1 = ((seed & 0xFFFFFFFF) + 0.5) / 2**32
        u2 = ((seed >> 32 & 0xFFFFFFFF) + 0.5) / 2**32
        z = math.sqrt(-2 * math.log(u1)) * math.cos(2 * math.pi * u2)
        return math.exp(self.hidden_sigma * z)


NONE = Misspecification()
MISSPECIFIED = {
    "hidden": Misspecification("hidden", hidden_sigma=0.1),
    "long-gen": Misspecification("long-gen", long_context=1.2),
    "slow-inter": Misspecification("slow-inter", inter_node=1.3),
    "oversubscribed": Misspecification("oversubscribed", fabric=Fabric(leaf_nodes=32, oversubscription=7.0)),
}
