"""The pass manager: pipeline strings, the registry, verification after every pass, nereus opt."""

from dataclasses import dataclass

import pytest

import nereus
from nereus.cli import main
from nereus.passes import PASSES, ModulePass, PipelineError, parse_pipeline, register, run_pipeline
from nereus.passes.transition.derive_emus import DeriveEmus

from ..support import EXAMPLES, GOLDEN

GRPO = next(p for p in EXAMPLES if p.name == "grpo_7b_8gpu.nir")


def test_registry_keys_are_pass_names():
    assert PASSES and all(name == cls.name for name, cls in PASSES.items())


def test_parse_pipeline_options_and_errors():
    assert parse_pipeline("derive-emus{plan=@p, model_stage=actor.train}") == [
        DeriveEmus(plan="@p", model_stage="actor.train")
    ]
    assert parse_pipeline("derive-emus,derive-emus{}") == [DeriveEmus(), DeriveEmus()]
    for spec, fragment in [
        (
            "nope",
            "unknown pass 'nope'; known passes: admit, calibrate, derive-emus, estimate, plan-search, "
            "plan-transition, remap, schedule-transfers",
        ),
        ("derive-emus{foo=1}", "has no option 'foo'; options: model_stage, only_missing, plan"),
        ("derive-emus{plan}", "needs a value"),
        ("derive-emus{", "malformed pipeline at column 1"),
    ]:
        with pytest.raises(PipelineError, match=fragment):
            parse_pipeline(spec)


def test_the_registry_gathers_every_layers_passes():
    """Each layer registers its own passes; ``nereus.registry`` (above the layers) has them all."""
    from nereus.backend.lower_collectives import PASSES as BACKEND

    everything = nereus.get_all_passes()
    assert "lower-collectives" in BACKEND and "lower-collectives" not in PASSES
    assert set(everything) == set(PASSES) | set(BACKEND)
    with pytest.raises(PipelineError, match="known passes: admit, calibrate, derive-emus, estimate, lower-collectives"):
        nereus.registry.parse_pipeline("nope")


def test_options_are_typed_refs_and_sizes():
    from nereus.backend.lower_collectives import LowerCollectives

    [p] = nereus.registry.parse_pipeline("lower-collectives{transition=@t,bucket=2MiB}")
    assert p == LowerCollectives(transition="@t", bucket=2 * 2**20)
    assert nereus.registry.parse_pipeline("lower-collectives{bucket=4096}")[0].bucket == 4096
    for spec, fragment in [
        ("lower-collectives{bucket=2Mib}", "expects a size such as 64MiB, got '2Mib'"),
        ("lower-collectives{bucket=2GB/s}", "expects a size"),
        ("plan-transition{to=b}", "option to of pass plan-transition expects @name, got 'b'"),
    ]:
        with pytest.raises(PipelineError, match=fragment):
            nereus.registry.parse_pipeline(spec)


def test_a_pass_that_reads_emus_runs_derive_emus_visibly(capsys):
    """plan-transition declares that it needs both plans' EMUs: the pass manager runs derive-emus
    for each plan that lacks them, as a step that --print-ir-after-all shows."""
    case = str(GOLDEN / "plan-transition" / "tp4_to_tp2.nir")
    ran = []
    m = nereus.parse(open(case).read())
    assert m.missing_emus("a") and m.missing_emus("b")
    nereus.run_pipeline(m, "plan-transition{to=@b}", after_each=lambda p, _: ran.append(p))
    assert ran == [DeriveEmus(plan="@a", only_missing=True), DeriveEmus(plan="@b", only_missing=True), ran[-1]]
    assert ran[-1].name == "plan-transition"
    assert main(["opt", case, "-p", "plan-transition{to=@b}", "--print-ir-after-all"]) == 0
    err = capsys.readouterr().err
    assert [ln for ln in err.splitlines() if ln.startswith("// ----- IR after")] == [
        "// ----- IR after derive-emus",
        "// ----- IR after derive-emus",
        "// ----- IR after plan-transition",
    ]


def test_the_backend_never_derives_emus():
    """lower() on a transition whose plans' EMUs are gone is a diagnostic naming derive-emus;
    the backend does not run the cost model to make them."""
    from nereus.backend.lower import lower

    case = GOLDEN / "plan-transition" / "tp4_to_tp2.nir"
    m = nereus.run_pipeline(nereus.parse(case.read_text()), "plan-transition{to=@b,into=@t}")
    for key in [k for k in m.emus if k[0] == "b"]:
        del m.emus[key]
    with pytest.raises(nereus.DiagnosticError, match=r"(?s)lower-collectives: plan @b has no EMUs for .*derive-emus"):
        lower(m, "t")


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
        assert "mesh has 9 GPUs but dp x pp x tp = 2 x 1 x 4 = 8" in text
    finally:
        del PASSES["test-break-mesh"]


def test_opt_command(tmp_path, capsys):
    out = tmp_path / "out.nir"
    assert (
        main(["opt", str(GRPO), "-p", "derive-emus{model_stage=actor.train}", "-o", str(out), "--print-ir-after-all"])
        == 0
    )
    assert "// ----- IR after derive-emus" in capsys.readouterr().err
    m = nereus.verify(nereus.parse(out.read_text()))
    assert {e.model_stage for e in m.emus.values()} == {"actor.generate", "actor.train"}
    assert main(["opt", str(GRPO), "-p", "bogus"]) == 1
    assert "unknown pass 'bogus'" in capsys.readouterr().err
