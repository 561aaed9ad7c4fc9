"""Property tests of the printer and parser on generated modules, and of the verifier on valid ones.

For every generated module ``m``:

- ``parse(print_ir(m)) == m`` and ``print_ir`` is a fixed point (``print(parse(print(m))) == print(m)``);
- the same with one ``emu`` block per replica (``group_replicas=False``), which must denote the
  same module as the grouped text;
- a module built to be valid passes ``nereus.verify``, before and after a round trip.

The strategies are in ``tests/support/strategies.py``.
"""

from __future__ import annotations

import difflib

import pytest
from hypothesis import HealthCheck, Phase, given, settings

import nereus
from nereus import parse, print_ir, verify

from ..support import EXAMPLES
from ..support.strategies import modules

PROPERTY = settings(
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)


def _diff(a: str, b: str) -> str:
    return "".join(difflib.unified_diff(a.splitlines(True), b.splitlines(True), "printed", "reprinted", n=2))[:4000]


def _module_diff(a: nereus.Module, b: nereus.Module) -> str:
    """Which top-level entries differ (the dataclass repr of a whole module is unreadable)."""
    out = []
    for group in ("clusters", "models", "workloads", "plans", "emus", "transitions"):
        x, y = getattr(a, group), getattr(b, group)
        for key in sorted(set(x) | set(y), key=str):
            if x.get(key) != y.get(key):
                out.append(f"{group}[{key!r}]:\n  before: {x.get(key)!r}\n  after:  {y.get(key)!r}")
    return "\n".join(out)[:4000]


def assert_roundtrip(m: nereus.Module, group_replicas: bool = True) -> str:
    text = print_ir(m, group_replicas=group_replicas)
    try:
        again = parse(text)
    except nereus.DiagnosticError as e:
        raise AssertionError(f"printed module does not parse:\n{e.render(text)}\n--- text ---\n{text[:6000]}") from None
    assert again == m, "parse(print_ir(m)) != m:\n" + _module_diff(m, again)
    reprinted = print_ir(again, group_replicas=group_replicas)
    assert reprinted == text, "print_ir is not a fixed point:\n" + _diff(text, reprinted)
    return text


def assert_verifies(m: nereus.Module, what: str = "generated valid module") -> None:
    try:
        verify(m)
    except nereus.DiagnosticError as e:
        raise AssertionError(
            f"{what} rejected by verify:\n{e.render()}\n--- module ---\n{print_ir(m)[:6000]}"
        ) from None


# ---------------------------------------------------------------------------- generated modules


@PROPERTY
@given(modules())
def test_roundtrip_valid_modules(m):
    assert_roundtrip(m)


@PROPERTY
@given(modules())
def test_roundtrip_ungrouped_replicas(m):
    grouped = assert_roundtrip(m, group_replicas=True)
    ungrouped = assert_roundtrip(m, group_replicas=False)
    assert parse(ungrouped) == parse(grouped)
    # printing the ungrouped text's module again groups it exactly as before
    assert print_ir(parse(ungrouped)) == grouped
    assert ungrouped.count("\nemu @") + ungrouped.startswith("emu @") == len(m.emus)


@PROPERTY
@given(modules(valid=False))
def test_roundtrip_scrambled_modules(m):
    """Modules the verifier rejects (shard GPUs off the mesh, replicas beyond dp) still print and parse back."""
    assert_roundtrip(m)
    assert_roundtrip(m, group_replicas=False)


@PROPERTY
@given(modules())
def test_generated_valid_modules_verify(m):
    assert_verifies(m)
    again = parse(print_ir(m))
    assert_verifies(again, "round-tripped valid module")
    assert_verifies(parse(print_ir(m, group_replicas=False)), "round-tripped valid module (ungrouped)")


# No shrinking: shrinking these modules costs minutes; the minimal reproducer of the bug this
# guards against is test_empty_tp_slice_roundtrip.
@settings(
    max_examples=25,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)
@given(modules(tiny_dims=True))
def test_roundtrip_tiny_dims(m):
    """ffn or vocab below tp: the verifier accepts the module, so its printed text must parse back.

    Regression: ``derive_emus`` used to give the surplus TP ranks empty slices ``[k:k]``, which
    ``verify`` accepted and the parser rejects.
    """
    assert_verifies(m)
    assert_roundtrip(m)


TINY = """\
cluster @c {
  nodes = 1
  gpus_per_node = 2
  gpu_memory = 80GiB
  peak_flops = 989TFLOPs
  hbm_bandwidth = 3.35TB/s
  intra_node = link(bandwidth = 450GB/s, latency = 2us)
  inter_node = link(bandwidth = 50GB/s, latency = 5us)
}

model @m {
  layers = 1
  hidden = 2
  heads = 2
  kv_heads = 2
  ffn = 1
  vocab = 8
}

workload @w {
  algorithm = grpo
  roles = [@m]
  global_batch = 1
  group_size = 2
  prompt_len_mean = 1
  prompt_len_max = 1
  response_len_mean = 1
  response_len_max = 1
  micro_batch = 1
  stage gen { kind = generate, models = [@m] }
}

plan @p {
  workload = @w
  cluster = @c
  layout m.gen {
    tp = 2
    pp = 1
    dp = 1
    layers = [0..0]
    mesh = [0, 1]
  }
}
"""


def test_empty_tp_slice_roundtrip():
    """Minimal reproducer: ffn = 1 split over tp = 2 leaves TP rank 1 the empty slice [1:1]."""
    from nereus.ir.sharding import derive_emus

    m = verify(parse(TINY))
    lay = m.plans["p"].layouts["m.gen"]
    for emu in derive_emus("p", m.models["m"], lay):
        m.emus[emu.key] = emu
    assert_verifies(m, "module with the derived EMUs")
    assert_roundtrip(m)


# ---------------------------------------------------------------------------- the examples


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_roundtrip(path):
    text = path.read_text()
    m = parse(text, str(path))
    verify(m)
    assert print_ir(m) == text, "example not in canonical form:\n" + _diff(text, print_ir(m))
    assert parse(print_ir(m)) == m
    ungrouped = print_ir(m, group_replicas=False)
    assert parse(ungrouped) == m
    assert print_ir(parse(ungrouped)) == text


def test_examples_exist():
    assert len(EXAMPLES) >= 3
