"""The pass manager: pipeline strings, the registry, verification after every pass, nereus opt."""

from dataclasses import dataclass

import pytest

import nereus
from nereus.cli import main
from nereus.passes import PASSES, ModulePass, PipelineError, parse_pipeline, register, run_pipeline
from nereus.passes.derive_emus import DeriveEmus

from .conftest import EXAMPLES

GRPO = next(p for p in EXAMPLES if p.name == "grpo_7b_8gpu.nir")


def test_registry_keys_are_pass_names():
    assert PASSES and all(name == cls.name for name, cls in PASSES.items())


def test_parse_pipeline_options_and_errors():
    assert parse_pipeline("derive-emus{plan=@p, model_stage=actor.train}") == [DeriveEmus(plan="@p", model_stage="actor.train")]
    assert parse_pipeline("derive-emus,derive-emus{}") == [DeriveEmus(), DeriveEmus()]
    for spec, fragment in [("nope", "unknown pass 'nope'; known passes: admit, calibrate, derive-emus, estimate, lower-collectives, plan-search, plan-transition, remap, schedule-transfers"),
                           ("derive-emus{foo=1}", "has no option 'foo'; options: model_stage, plan"),
                           ("derive-emus{plan}", "needs a value"),
                           ("derive-emus{", "malformed pipeline at column 1")]:
        with pytest.raises(PipelineError, match=fragment):
            parse_pipeline(spec)


def test_derive_emus_matches_checked_in_emus():
    m = nereus.parse(GRPO.read_text())
    expected = dict(m.emus)
    m.emus.clear()
    run_pipeline(m, "derive-emus{model_stage=actor.generate}")
    assert m.emus == expected


def test_invalid_ir_after_a_pass_names_it_and_its_predecessors():
    @register
    @dataclass(frozen=True)
    class Breaker(ModulePass):
        name = "test-break-mesh"

        def apply(self, module):
            next(iter(module.plans.values())).layouts["actor.train"].mesh.append(99)

    try:
        m = nereus.parse(GRPO.read_text())
        with pytest.raises(nereus.DiagnosticError) as e:
            run_pipeline(m, "derive-emus{model_stage=actor.train},test-break-mesh")
        text = str(e.value)
        assert "IR is invalid after pass test-break-mesh (passes before it: derive-emus)" in text
        assert "mesh has 9 GPU(s) but dp x pp x tp = 2 x 1 x 4 = 8" in text
    finally:
        del PASSES["test-break-mesh"]


def test_opt_command(tmp_path, capsys):
    out = tmp_path / "out.nir"
    assert main(["opt", str(GRPO), "-p", "derive-emus{model_stage=actor.train}", "-o", str(out), "--print-ir-after-all"]) == 0
    assert "// ----- IR after derive-emus" in capsys.readouterr().err
    m = nereus.verify(nereus.parse(out.read_text()))
    assert {e.model_stage for e in m.emus.values()} == {"actor.generate", "actor.train"}
    assert main(["opt", str(GRPO), "-p", "bogus"]) == 1
    assert "unknown pass 'bogus'" in capsys.readouterr().err
