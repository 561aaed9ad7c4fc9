"""The attention core as frameworks ran it (``attention``): FlashAttention (the default) keeps each
head's s x s scores on chip; Megatron-LM before 2023 wrote them to HBM (``materialized``) and kept
the softmax output for the backward; selective recomputation (``recomputed``, Korthikanti et al.
2022) writes them and recomputes them in the backward instead of keeping them. The attribute
round-trips, is refused at its line where it means nothing, and changes the estimate as the
kernels' traffic and Korthikanti's activation count say."""

from __future__ import annotations

import numpy as np
import pytest

import nereus
from nereus.ir import DiagnosticError, print_ir
from nereus.passes import Candidates, CostModel
from nereus.passes.cost.cost_model import ATTENTION_KINDS, C_COMPUTE, C_HBM

from ..support import ROOT
from ..support.gpt import A100, gpt, train_workload

BASE = (ROOT / "validation" / "korthikanti_2022.nir").read_text()
STAGES = ", ".join(f"{12 * i}..{12 * i + 11}" for i in range(8))
GOOD = f"tp = 8, pp = 8, dp = 1, layers = [{STAGES}], mesh = [0..63], micro_batches = 64"


def _text(layout: str) -> str:
    plan = f"plan @probe {{\n  workload = @w175b\n  cluster = @selene\n  layout gpt175b.train {{ {layout} }}\n}}\n"
    return BASE + "\n" + plan


def test_it_round_trips_and_flash_is_the_default():
    m = nereus.parse(_text(GOOD + ", attention = recomputed"))
    nereus.verify(m)
    assert m.plans["probe"].layouts["gpt175b.train"].attention == "recomputed"
    assert "attention = recomputed" in print_ir(m)
    plain = nereus.parse(_text(GOOD))
    assert plain.plans["probe"].layouts["gpt175b.train"].attention == "flash"
    assert "attention" not in print_ir(plain).split("plan @probe")[1]


@pytest.mark.parametrize(
    "extra, words",
    [
        (", recompute = true, attention = recomputed", "full recomputation (recompute) already covers"),
        (", attention = sometimes", "attention"),
    ],
)
def test_what_cannot_run_is_refused_at_its_line(extra, words):
    text = _text(GOOD + extra)
    with pytest.raises(DiagnosticError) as e:
        nereus.verify(nereus.parse(text))
    (d,) = e.value.diagnostics
    assert words in d.message
    assert "layout gpt175b.train" in text.splitlines()[d.loc.line - 1]


def _stage(attention: str, recompute: bool = False, seq: int = 2048, tp: int = 1):
    model, cost = gpt(8, 2048, 16), CostModel(A100)
    c = Candidates.grid(A100, 8, tp, 1, 1, recompute=recompute)
    c.attention = np.full(1, ATTENTION_KINDS.index(attention))
    return cost.stage(model, train_workload(8, seq=seq), "train", c), cost.coeffs


def _hbm(sc) -> float:
    return float(sc.features[0][C_HBM])


def test_materialized_scores_cost_hbm_traffic_that_grows_with_the_square_of_the_sequence():
    """Per sample the scores are s x s a head: at twice the sequence, four times the HBM seconds
    they add per sample (the batch's samples fixed), where the GEMMs only double."""
    added = {}
    for seq in (1024, 2048):
        flash, _ = _stage("flash", seq=seq)
        mat, _ = _stage("materialized", seq=seq)
        added[seq] = _hbm(mat) - _hbm(flash)
        assert added[seq] > 0
        assert mat.features[0][C_COMPUTE] == pytest.approx(flash.features[0][C_COMPUTE], rel=1e-12)
    assert added[2048] / added[1024] == pytest.approx(4.0, rel=1e-9)


def test_recomputation_writes_the_scores_again_and_selective_recomputation_redoes_their_flops():
    """Forward 8 bytes an element, backward 14, each recomputed forward 8 more: full recomputation
    and selective recomputation both move 30 to materialized attention's 22; selective
    recomputation also runs the attention core's FLOPs once more, and keeps no scores."""
    flash, _ = _stage("flash")
    mat, _ = _stage("materialized")
    full_flash, _ = _stage("flash", recompute=True)
    full_mat, _ = _stage("materialized", recompute=True)
    selective, _ = _stage("recomputed")
    once = _hbm(mat) - _hbm(flash)
    assert (_hbm(full_mat) - _hbm(full_flash)) / once == pytest.approx(30 / 22, rel=1e-9)
    assert (_hbm(selective) - _hbm(flash)) / once == pytest.approx(30 / 22, rel=1e-9)
    assert selective.features[0][C_COMPUTE] > flash.features[0][C_COMPUTE]
    assert selective.activations[0] == pytest.approx(flash.activations[0], rel=1e-12)
    assert full_mat.activations[0] == pytest.approx(full_flash.activations[0], rel=1e-12)


@pytest.mark.parametrize("tp", [1, 8])
def test_kept_scores_are_korthikanti_table_2_without_dropout(tp):
    """Korthikanti et al. 2022, Table 2: attention's share of a layer's activations is 5as^2b
    bytes (softmax output 2, dropout mask 1, dropout output 2), over TP. Without dropout (RL
    fine-tuning runs without it, as the rest of the count) the softmax output alone: 2 a s^2 b / t
    a layer and micro-batch, on top of flash attention's count. Two models a layer apart isolate
    a layer."""
    s, b, a = 2048, 1, 16
    cost = CostModel(A100)

    def activations(layers, attention):
        c = Candidates.grid(A100, layers, tp, 1, 1)
        c.attention = np.full(1, ATTENTION_KINDS.index(attention))
        return float(cost.stage(gpt(layers, 2048, a), train_workload(1, seq=s), "train", c).activations[0])

    per_layer = {k: activations(9, k) - activations(8, k) for k in ("flash", "materialized")}
    assert per_layer["materialized"] - per_layer["flash"] == pytest.approx(2 * a * s * s * b / tp, rel=1e-12)
