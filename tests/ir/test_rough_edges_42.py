"""Issue 42, item 8: rough edges a user reported, each pinned down (see also
tests/cli/test_rough_edges_42.py and tests/integrations/test_embedding_doc.py).

1. a diagnostic for `4_096` or `1024 prompts` pointed at the next line (digit groups are accepted now);
2. `989e12` said "unexpected INT" (a plain number may carry an exponent; a quantity says what to write);
3. implausible units (`80MiB` of GPU memory, `3.35Tb/s` of HBM) passed silently (warnings now);
4. the TP hint offered TP degrees above the cluster's GPUs;
6. a plan name given from Python as "@b" printed as "@@b";
7. sizes printed as `91206076.5KiB` (now the largest unit, exactly);
8. counts of one printed as "1 plans", "1 time(s)".
"""

from __future__ import annotations

import pytest

import nereus
from nereus.ir import DiagnosticError, plural
from nereus.ir.plausible import unit_warnings
from nereus.ir.units import Dim, format_quantity, parse_quantity

from ..support import example
from .test_user_rough_edges import BASE, diagnostics, edit, line_of


def syntax_error(text: str):
    with pytest.raises(DiagnosticError) as e:
        nereus.parse(text, "job.nir")
    (d,) = e.value.diagnostics
    return d


# ---------------------------------------------------------------- 1. positions and digit groups


def test_digit_groups_are_read_as_python_and_toml_read_them_and_print_plainly():
    m = nereus.parse(
        edit(
            ("response_len_max = 4096", "response_len_max = 4_096"),
            ("vocab = 152064\n  trained", "vocab = 152_064\n  trained"),
        )
    )
    assert m == nereus.parse(BASE)
    assert "response_len_max = 4096" in nereus.print_ir(m)
    assert parse_quantity("4_096GiB") == parse_quantity("4096GiB")


@pytest.mark.parametrize("number", ["4__096", "4_096_", "4_"])
def test_a_malformed_number_points_at_itself_not_the_next_line(number):
    text = edit(("response_len_max = 4096", f"response_len_max = {number}"))
    d = syntax_error(text)
    assert d.message == f"malformed number '{number}'"
    assert line_of(text, d)[d.loc.col - 1 :].startswith(number)
    assert "one '_' between two digits" in d.hint


def test_a_word_after_a_count_points_at_the_word():
    text = edit(("prompt_len_max = 1024", "prompt_len_max = 1024 prompts  // the longest"))
    d = syntax_error(text)
    assert d.message == "unexpected NAME 'prompts' after the value of 'prompt_len_max'"
    assert line_of(text, d)[d.loc.col - 1 :].startswith("prompts")
    assert d.hint == "'prompts' is no part of the value: 'prompt_len_max' takes a bare number (prompt_len_max = 1024)"


def test_a_key_alone_on_its_line_points_at_the_key():
    text = edit(("  nodes = 1\n", "  nodes\n"))
    d = syntax_error(text)
    assert (d.message, d.loc.line) == ("attribute 'nodes' has no value", 2)


# ---------------------------------------------------------------- 2. exponents


def test_a_plain_number_takes_an_exponent_where_a_number_is_allowed():
    text = edit(("  nodes = 1\n", "  nodes = 1\n  efficiency = efficiency(compute = 5e-1, hbm = 0.75e0)\n"))
    c = nereus.verify(nereus.parse(text)).clusters["h100x8"]
    assert (c.efficiency.compute, c.efficiency.hbm) == (0.5, 0.75)
    assert "efficiency(compute = 0.5, hbm = 0.75" in nereus.print_ir(nereus.parse(text))  # printed without the exponent


def test_a_quantity_written_as_a_plain_number_with_an_exponent_is_told_its_unit():
    text = edit(("peak_flops = 989TFLOPs", "peak_flops = 989e12"))
    (d,) = diagnostics(text)
    assert d.message == "'peak_flops' expects a FLOP rate, got a number '989e12'"
    assert d.hint == "a FLOP rate carries its unit: write 989TFLOPs (if 989e12 is in FLOP/s)"
    assert line_of(text, d)[d.loc.col - 1 :].startswith("989e12")
    (d,) = diagnostics(edit(("gpu_memory = 80GiB", "gpu_memory = 85899345920")))
    assert d.hint == "a size carries its unit: write 80GiB (if 85899345920 is in bytes)"


# ---------------------------------------------------------------- 3. implausible units


def test_the_examples_and_the_base_have_no_unit_warnings():
    assert unit_warnings(nereus.parse(BASE)) == []
    for name in ("grpo_7b_8gpu.nir", "ppo_8b_16gpu.nir", "ppo_70b_1024gpu.nir"):
        assert unit_warnings(nereus.parse_file(example(name))) == [], name


@pytest.mark.parametrize(
    "old, new, message, hint",
    [
        ("gpu_memory = 80GiB", "gpu_memory = 80MiB", "gpu_memory = 80MiB is under 1GiB", "did you mean 80GiB?"),
        ("gpu_memory = 80GiB", "gpu_memory = 80TiB", "gpu_memory = 80TiB is over 1TiB", "did you mean 80GiB?"),
        (
            "hbm_bandwidth = 3.35TB/s",
            "hbm_bandwidth = 3.35Tb/s",
            "hbm_bandwidth = 3.35Tb/s is in bits per second (418.75GB/s)",
            "did you mean 3.35TB/s?",
        ),
        (
            "peak_flops = 989TFLOPs",
            "peak_flops = 989KFLOPs",
            "peak_flops = 989KFLOPs is under 1GFLOPs",
            "did you mean 989TFLOPs?",
        ),
        (
            "latency = 2us)\n  inter",
            "latency = 2ms)\n  inter",
            "intra_node latency = 2ms is over 1ms",
            "did you mean 2us?",
        ),
    ],
)
def test_an_implausible_unit_is_a_warning_at_its_line(old, new, message, hint):
    text = edit((old, new))
    m = nereus.verify(nereus.parse(text, "job.nir"))  # valid IR: a warning, not an error
    (w,) = unit_warnings(m)
    assert w.severity == "warning" and w.message.startswith(message) and w.hint == hint
    assert new.split(" =")[0].split("(")[0] in line_of(text, w) or "intra_node" in line_of(text, w)


# ---------------------------------------------------------------- 4. the TP hint


def test_the_tp_hint_stays_within_the_cluster():
    text = edit(("    tp = 2\n    pp = 1\n    dp = 4", "    tp = 3\n    pp = 1\n    dp = 4"))
    (d,) = [d for d in diagnostics(text) if "does not divide heads" in d.message]
    assert d.hint == "choose tp from 1, 2, 4 (at most the 8 GPUs of cluster @h100x8)"  # not 28: 28 > 8 GPUs
    big = edit(
        ("  nodes = 1\n", "  nodes = 4\n"), ("    tp = 2\n    pp = 1\n    dp = 4", "    tp = 3\n    pp = 1\n    dp = 4")
    )
    (d,) = [d for d in diagnostics(big) if "does not divide heads" in d.message]
    assert d.hint == "choose tp from 1, 2, 4, 28"  # 32 GPUs: TP 28 fits


# ---------------------------------------------------------------- 6. names from Python


def test_a_plan_name_with_at_from_python_is_stripped_once():
    m = nereus.parse_file(example("grpo_7b_8gpu.nir"))
    with pytest.raises(ValueError) as e:
        nereus.DecisionCore(m, "@nope")
    assert str(e.value) == "no plan @nope in the module; its plans: @grpo_p0"
    assert nereus.DecisionCore(m, "@grpo_p0").plan == "grpo_p0"
    assert nereus.export_plan(m, "@grpo_p0", "verl") == nereus.export_plan(m, "grpo_p0", "verl")


# ---------------------------------------------------------------- 7. sizes in the largest sensible unit


@pytest.mark.parametrize(
    "dim, value, text",
    [
        (Dim.SIZE, 93395022336, "93.395022336GB"),  # was 91206076.5KiB
        (Dim.SIZE, 3 * 2**40 + 1, "3.298534883329TB"),  # was 3298534883.329KB
        (Dim.SIZE, 2000 * 2**20, "2000MiB"),
        (Dim.SIZE, 80 * 2**30, "80GiB"),
        (Dim.SIZE, 41838 * 2**20, "41838MiB"),  # short enough: kept
        (Dim.BANDWIDTH, 3.35e12, "3.35TB/s"),
    ],
)
def test_quantities_print_in_the_largest_sensible_unit_exactly(dim, value, text):
    assert format_quantity(dim, value) == text
    assert parse_quantity(text) == (dim, value)


def test_the_printer_prints_an_odd_size_canonically_everywhere():
    text = edit(
        ("gpu_memory = 80GiB", "gpu_memory = 91206076.5KiB"),
        ("  nodes = 1\n", "  nodes = 1\n  host_memory = 91206076.5KiB\n"),
    )
    printed = nereus.print_ir(nereus.parse(text))
    assert "gpu_memory = 93.395022336GB" in printed and "host_memory = 93.395022336GB" in printed
    assert "KiB" not in printed
    assert nereus.print_ir(nereus.parse(printed)) == printed
    assert nereus.parse(printed) == nereus.parse(text)


# ---------------------------------------------------------------- 8. counts of one


def test_plural():
    assert [plural(1, "plan"), plural(2, "plan"), plural(0, "GPU"), plural(1024, "GPU", fmt=",")] == [
        "1 plan",
        "2 plans",
        "0 GPUs",
        "1,024 GPUs",
    ]
    assert plural(1, "micro-batch", "micro-batches") == "1 micro-batch" and plural(1.5, "step") == "1.5 steps"


def test_a_shard_listing_one_gpu_says_so_in_the_singular():
    text = BASE + "\nemu @grpo_p0 actor.generate[0..1] {\n  shard [0, 0] gpus [0] {\n    norm.weight [0:3584]\n  }\n}\n"
    with pytest.raises(DiagnosticError) as e:
        nereus.parse(text)
    (d,) = e.value.diagnostics
    assert d.message == "shard [0, 0] lists 1 GPU for 2 replicas"
