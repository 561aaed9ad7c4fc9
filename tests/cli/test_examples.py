"""The checked-in examples: valid, canonical, in sync with their generator, and summarised by show."""

import pytest

import nereus
from nereus.cli import main
from nereus.testing.jobs import EXAMPLES as BUILDERS

from ..support import EXAMPLES, ROOT


def test_every_example_is_generated():
    assert sorted(p.name for p in EXAMPLES) == sorted(BUILDERS)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_example_in_sync_with_generator(name):
    assert (ROOT / "examples" / name).read_text() == BUILDERS[name](), (
        f"examples/{name} is stale: run python -m nereus.testing.jobs examples"
    )


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_roundtrip_golden(path):
    text = path.read_text()
    m = nereus.verify(nereus.parse(text, str(path)))
    assert nereus.print_ir(m) == text
    assert nereus.parse(nereus.print_ir(m)) == m
    # each example carries a valid plan and the EMUs of one model-stage, all replicas; the
    # mixture of experts carries none (its training EMUs at 1,024 GPUs, experts differing per
    # replica, are 2.2 MB of text: derive-emus makes them)
    assert len(m.plans) == 1
    (plan,) = m.plans.values()
    if any(md.moe for md in m.models.values()):
        assert not m.emus
        return
    stages = {e.model_stage for e in m.emus.values()}
    assert len(stages) == 1
    (ms,) = stages
    assert len(m.emus_of(plan.name, ms)) == plan.layouts[ms].dp


def test_example_sizes():
    gpus = {p.name: nereus.parse(p.read_text()).clusters for p in EXAMPLES}
    sizes = {name: next(iter(c.values())).num_gpus for name, c in gpus.items()}
    assert sizes == {
        "grpo_7b_8gpu.nir": 8,
        "ppo_8b_16gpu.nir": 16,
        "ppo_70b_1024gpu.nir": 1024,
        "grpo_moe_1024gpu.nir": 1024,
    }


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_show(path, capsys):
    assert main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    m = nereus.parse(path.read_text())
    for plan in m.plans.values():
        assert f"plan @{plan.name}" in out
        for ms in plan.layouts:
            assert ms in out
    assert "EMU bytes/GPU" in out


def test_language_reference_in_sync():
    from nereus.ir.docs_reference import reference

    assert (ROOT / "docs" / "IR.md").read_text() == reference(), "run: python -m nereus.ir.docs_reference > docs/IR.md"
