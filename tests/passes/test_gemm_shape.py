"""Kernel efficiency by shape (``Efficiency.gemm_knee``): each GEMM of a layer costs its FLOPs at
``compute / (1 + knee / size)``, ``size = 3 / (1/m + 1/n + 1/k)`` on one GPU (the roofline's
FLOPs per operand element) and ``knee`` the number times the GPU's FLOPs per HBM byte. Checked
against the GEMMs of the 175B GPT of Korthikanti et al. and of Qwen3-235B-A22B's experts written
out by hand, by its effect on small against large GEMMs, and through the IR."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import nereus
from nereus.ir import print_ir
from nereus.ir.cluster import GEMM_KNEE_H100, Efficiency
from nereus.passes.cost.cost_model import CostModel, coefficient_vector, efficiency_from_vector

from ..support import ROOT
from ..support.probe import BASE, GOOD, STAGES, probe_cost


def _stage(layout: str, eff: Efficiency):
    cost, _, m, _ = probe_cost(layout, eff)
    return cost, m


TP8_PP8 = GOOD + ", sp = true"


def test_the_knee_charges_each_gemm_of_the_layer_as_written_out_by_hand():
    """GPT-175B (hidden 12,288, a plain MLP of 49,152) on TP 8, one sample of 2,048 tokens per
    micro-batch. Its four GEMMs on one GPU (rows m, columns n, inner k): QKV 2048 x 4608 x 12288,
    the projection 2048 x 12288 x 1536, the MLP's first 2048 x 6144 x 12288, its second
    2048 x 12288 x 6144. Each costs ``2 m n k x knee x (1/m + 1/n + 1/k) / 3`` FLOPs more,
    forward and backward (3 passes), in every layer, and the bubble stretches it as it does the
    rest."""
    base, m = _stage(TP8_PP8, Efficiency())
    kneed, _ = _stage(TP8_PP8, Efficiency(gemm_knee=2.0))
    cluster = m.clusters["selene"]
    knee = 2.0 * cluster.peak_flops / cluster.hbm_bandwidth  # 2 x 153 FLOPs per byte: GEMMs of 306 at half speed
    gemms = [(2048, 4608, 12288), (2048, 12288, 1536), (2048, 6144, 12288), (2048, 12288, 6144)]
    extra_per_microbatch = sum(2 * a * b * c * knee * (1 / a + 1 / b + 1 / c) / 3 for a, b, c in gemms)
    layers, passes, micro_batches, bubble = 12, 3, 64, 7 / 64  # a stage's 12 layers; 1F1B's (p - 1) / m
    want = micro_batches * passes * layers * extra_per_microbatch / cluster.peak_flops * (1 + bubble)
    x = coefficient_vector(Efficiency())
    a, b = base.breakdown(x), kneed.breakdown(x)
    got = (b["compute"] + b["bubble"]) - (a["compute"] + a["bubble"])
    assert got == pytest.approx(want / Efficiency().compute, rel=1e-9)
    assert float(kneed.time(x)[0]) - float(base.time(x)[0]) == pytest.approx(got, rel=1e-9)
    # nothing else moves
    assert {k: v for k, v in a.items() if k not in ("compute", "bubble")} == {
        k: v for k, v in b.items() if k not in ("compute", "bubble")
    }


def test_smaller_gemms_cost_more_per_flop():
    """The same model and work: TP 8 cuts each GEMM to an eighth of its columns, so its share of
    the shape's cost is larger than TP 1's; ``knee = 0`` charges every FLOP alike."""
    x = coefficient_vector(Efficiency())

    def extra_share(layout):
        plain, _ = _stage(layout, Efficiency())
        kneed, _ = _stage(layout, Efficiency(gemm_knee=GEMM_KNEE_H100))
        a, b = plain.breakdown(x), kneed.breakdown(x)
        return b["compute"] / a["compute"] - 1

    tp1 = "tp = 1, pp = 8, dp = 8, layers = [" + STAGES + "], mesh = [0..63], micro_batches = 8, recompute = true"
    # sizes: TP 1's GEMMs 2048 x 12288 x 12288 to 2048 x 49152 x 12288 (4,608-5,085); TP 8's
    # output projection 2048 x 12288 x 1536 (2,458), its others 3,813-4,096
    assert extra_share(TP8_PP8) > 1.25 * extra_share(tp1) > 0


def test_calibrate_grid_moves_the_knee_as_a_rebuilt_cost_would():
    """``calibrate``'s grid sets a cost's knee without rebuilding it: the time it then gives is
    the time of the cost built at that knee."""
    built, _ = _stage(TP8_PP8, Efficiency())
    x = coefficient_vector(Efficiency())
    for knee in (0.5, GEMM_KNEE_H100, 8.0):
        per_knee, _, at = built.shape
        built.shape = (per_knee, knee, at)
        rebuilt, _ = _stage(TP8_PP8, Efficiency(gemm_knee=knee))
        assert float(built.time(x)[0]) == pytest.approx(float(rebuilt.time(x)[0]), rel=1e-12)


def test_a_fit_keeps_the_priors_fields_it_does_not_fit():
    """The fitted vector carries compute, the links and the overhead; the knee, the overlap and
    the rest come from the prior (the knee was once dropped here, so every fit forgot it)."""
    prior = Efficiency(gemm_knee=3.0, overlap=0.35, memory_slack=1.2, expert_imbalance=1.4)
    x = coefficient_vector(replace(prior, compute=0.55, nic=0.6))
    got = efficiency_from_vector(x, prior)
    assert got == replace(prior, compute=pytest.approx(0.55), nic=pytest.approx(0.6))
    assert np.allclose(coefficient_vector(got), x)


def test_the_knee_round_trips_through_the_ir():
    text = BASE.replace("cluster @selene {", "cluster @selene {\n  efficiency = efficiency(gemm_knee = 3.4)", 1)
    m = nereus.verify(nereus.parse(text))
    assert m.clusters["selene"].efficiency.gemm_knee == 3.4
    printed = print_ir(m)
    assert "gemm_knee = 3.4" in printed
    assert nereus.parse(printed) == m


def test_an_experts_rows_are_its_share_of_the_ep_groups_tokens():
    """Qwen3-235B-A22B (hidden 4,096, 64 query and 4 KV heads of 128, 128 experts of 1,536, top 8)
    as Megatron-Bridge's H100 recipe runs it: TP 2, EP 32, each expert whole on one rank (ETP 1),
    4,096 tokens a micro-batch. Each of the 32 EP ranks dispatches the half of its tokens it holds
    (TP 2), so an expert receives 32 x 2,048 x 8 / 128 = 4,096 rows, and its gated MLP is two
    GEMMs: 4096 x 3072 x 4096 (gate and up) and 4096 x 4096 x 1536 (down). The attention's four
    projections are split over TP 2: QKV 4096 x 4608 x 4096, the output 4096 x 4096 x 4096."""
    m = nereus.verify(nereus.parse((ROOT / "validation" / "moe" / "megatron_bridge_h100_b200.nir").read_text()))
    model = m.models["qwen3_235b_a22b"]
    knee = 300.0

    def extra(flops, a, b, c):
        return flops * knee * (1 / a + 1 / b + 1 / c) / 3

    attention = extra(2 * 4096 * (8192 + 1024), 4096, 4608, 4096) + extra(2 * 8192 * 4096, 4096, 4096, 4096)
    expert = extra(2 * 2 * 4096 * 1536, 4096, 3072, 4096) + extra(2 * 4096 * 1536, 4096, 4096, 1536)
    want = attention + 8 * expert  # every layer a mixture of experts; each token through 8 of them
    got = CostModel.gemm_shape_flops(model, np.array([4096.0]), np.array([2]), np.array([32]), np.array([1]), knee)
    assert float(got[0]) == pytest.approx(want, rel=1e-12)
