"""GPT-3 175B of Korthikanti et al. 2022 on Selene (``validation/korthikanti_2022.nir``) as a
probe for one training layout: the tests of layout attributes write only the layout line.

``TP8_PP8`` is the paper's TP 8 x PP 8 over 8 nodes (every pipeline send crosses the NIC), 12
layers a stage; ``GOOD`` runs it with 64 micro-batches a flush."""

from __future__ import annotations

import numpy as np

import nereus
from nereus.ir import Module
from nereus.ir.cluster import Efficiency
from nereus.passes.cost.cost_model import Candidates, CostModel

from . import ROOT

BASE = (ROOT / "validation" / "korthikanti_2022.nir").read_text()
STAGES = ", ".join(f"{12 * i}..{12 * i + 11}" for i in range(8))
TP8_PP8 = f"tp = 8, pp = 8, dp = 1, layers = [{STAGES}], mesh = [0..63]"
GOOD = TP8_PP8 + ", micro_batches = 64"
NAME = "gpt175b.train"


def probe_text(layout: str) -> str:
    """The source with ``plan @probe`` laying the 175B's training stage out as ``layout``."""
    plan = f"plan @probe {{\n  workload = @w175b\n  cluster = @selene\n  layout {NAME} {{ {layout} }}\n}}\n"
    return BASE + "\n" + plan


def probe(layout: str, verify: bool = True):
    """The parsed (and verified) module and its probe layout."""
    m = nereus.parse(probe_text(layout))
    if verify:
        nereus.verify(m)
    return m, m.plans["probe"].layouts[NAME]


def probe_cost(layout: str, eff: Efficiency | None = None):
    """The cost model's stage cost of the probe layout, its coefficient vector, module and layout."""
    m, lay = probe(layout)
    cluster = m.clusters["selene"]
    model = CostModel(cluster) if eff is None else CostModel(cluster, eff)
    cost = model.stage(m.models["gpt175b"], m.workloads["w175b"], "train", Candidates.of_layout(cluster, lay))
    return cost, model.coeffs, m, lay


def probe_truth(m: Module, lay) -> float:
    """The event truth's seconds for the probe layout, every sample at the workload's mean length."""
    from nereus.sim.truth.stages import train_or_infer

    w = m.workloads["w175b"]
    lengths = np.full(w.samples, w.prompt_len_mean + w.response_len_mean)
    seconds, _ = train_or_infer(m.models["gpt175b"], lay, w, m.clusters["selene"], lengths, "train")
    return seconds
