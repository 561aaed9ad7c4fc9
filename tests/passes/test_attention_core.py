"""The attention core as frameworks ran it (``attention``): FlashAttention (the default) keeps each
head's s x s scores on chip; Megatron-LM before 2023 wrote them to HBM (``materialized``) and kept
the softmax output for the backward; selective recomputation (``recomputed``, Korthikanti et al.
2022) writes them and recomputes them in the backward instead of keeping them. The attribute
round-trips, is refused at its line where it means nothing, and changes the estimate as the
kernels' traffic and Korthikanti's activation count say."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import nereus
from nereus.ir import DiagnosticError, print_ir
from nereus.passes import Candidates, CostModel
from nereus.passes.cost.cost_model import ATTENTION_KINDS, C_COMPUTE, C_HBM

from ..support.gpt import A100, gpt, train_workload
from ..support.probe import GOOD
from ..support.probe import probe_text as _text


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


def _stage(attention: str, recompute: bool = False, seq: int = 2048, tp: int = 1, dropout: float = 0.0):
    model, cost = replace(gpt(8, 2048, 16), attention_dropout=dropout), CostModel(A100)
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
    """Forward 7 bytes an element, backward 12 (Megatron's causal softmax kernel reads the lower
    triangle only), each recomputed forward 7 more: full recomputation and selective
    recomputation both move 26 to materialized attention's 19; selective
    recomputation also runs the attention core's FLOPs once more, and keeps no scores; full
    recomputation keeps the scores of the one layer whose backward runs (a micro-batch in
    flight: 2 a s^2 b bytes)."""
    flash, _ = _stage("flash")
    mat, _ = _stage("materialized")
    full_flash, _ = _stage("flash", recompute=True)
    full_mat, _ = _stage("materialized", recompute=True)
    selective, _ = _stage("recomputed")
    once = _hbm(mat) - _hbm(flash)
    assert (_hbm(full_mat) - _hbm(full_flash)) / once == pytest.approx(26 / 19, rel=1e-9)
    assert (_hbm(selective) - _hbm(flash)) / once == pytest.approx(26 / 19, rel=1e-9)
    assert selective.features[0][C_COMPUTE] > flash.features[0][C_COMPUTE]
    assert selective.activations[0] == pytest.approx(flash.activations[0], rel=1e-12)
    assert full_mat.activations[0] - full_flash.activations[0] == pytest.approx(2 * 16 * 2048**2, rel=1e-12)


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


MODEL_175B = "ffn = 49152, vocab = 51200, mlp = plain,"


def _with_dropout(value: str) -> str:
    """The probe's source with the 175B's attention dropout set to ``value``."""
    text = _text(GOOD)
    assert text.count(MODEL_175B) == 1
    return text.replace(MODEL_175B, f"{MODEL_175B} attention_dropout = {value},")


@pytest.mark.parametrize("tp", [1, 8])
def test_with_dropout_kept_scores_are_korthikanti_table_2_as_printed(tp):
    """With dropout on the attention weights, Table 2's whole 5as^2b / t a layer: the softmax
    output (2 bytes an element), the dropout mask (1) and the dropped weights (2). Under flash
    attention the mask is drawn in the kernel: nothing more is kept."""
    s, b, a = 2048, 1, 16
    cost = CostModel(A100)

    def activations(layers, attention, dropout):
        c = Candidates.grid(A100, layers, tp, 1, 1)
        c.attention = np.full(1, ATTENTION_KINDS.index(attention))
        model = replace(gpt(layers, 2048, a), attention_dropout=dropout)
        return float(cost.stage(model, train_workload(1, seq=s), "train", c).activations[0])

    def per_layer(attention, dropout):
        return activations(9, attention, dropout) - activations(8, attention, dropout)

    assert per_layer("materialized", 0.1) - per_layer("flash", 0.1) == pytest.approx(5 * a * s * s * b / tp, rel=1e-12)
    assert per_layer("flash", 0.1) == pytest.approx(per_layer("flash", 0.0), rel=1e-12)


def test_dropout_moves_the_scores_through_hbm_again_and_only_outside_flash_attention():
    """Dropout reads the softmax output and writes its mask and the dropped weights (5 bytes an
    element) each forward, and its backward reads the mask and the gradient and writes one (5):
    materialized attention's 19 bytes an element become 29, and 41 with a recomputed forward
    (26 + 10 + 5). Flash attention's traffic does not change, nor do the FLOPs."""
    flash, _ = _stage("flash")
    once = _hbm(_stage("materialized")[0]) - _hbm(flash)
    assert _hbm(_stage("flash", dropout=0.1)[0]) == pytest.approx(_hbm(flash), rel=1e-12)
    mat = _stage("materialized", dropout=0.1)[0]
    assert (_hbm(mat) - _hbm(flash)) / once == pytest.approx(29 / 19, rel=1e-9)
    assert mat.features[0][C_COMPUTE] == pytest.approx(flash.features[0][C_COMPUTE], rel=1e-12)
    selective = _stage("recomputed", dropout=0.1)[0]
    assert (_hbm(selective) - _hbm(flash)) / once == pytest.approx(41 / 19, rel=1e-9)


@pytest.mark.parametrize("value", ["1.0", "-0.1", "1.5"])
def test_a_dropout_that_is_no_probability_is_refused_at_its_line(value):
    text = _with_dropout(value)
    with pytest.raises(DiagnosticError) as e:
        nereus.parse(text)
    (d,) = e.value.diagnostics
    assert "'attention_dropout' must be a probability below 1, got '" + value + "'" in d.message
    assert f"attention_dropout = {value}" in text.splitlines()[d.loc.line - 1]


def test_dropout_round_trips_and_none_is_not_printed():
    m = nereus.verify(nereus.parse(_with_dropout("0.1")))
    assert m.models["gpt175b"].attention_dropout == 0.1
    printed = print_ir(m)
    assert "attention_dropout = 0.1" in printed
    assert nereus.parse(printed).models["gpt175b"].attention_dropout == 0.1
    none = nereus.parse(_text(GOOD))
    assert none.models["gpt175b"].attention_dropout == 0.0
    assert "attention_dropout" not in print_ir(none).split("model @gpt175b")[1].split("}")[0]
