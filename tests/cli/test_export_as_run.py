"""nereus export reports what the framework really runs of a plan (issue 42, item 4)."""

import re

import nereus
from nereus.cli import main
from nereus.passes.search.targets import as_run_by

from ..passes.test_plan_search_targets import QWEN16


def test_export_warns_for_a_free_plan_verl_cannot_run_as_written_and_reports_the_real_figures(tmp_path, capsys):
    m = nereus.parse(QWEN16)
    nereus.run_pipeline(m, "plan-search{time_limit=60,into=@free}")
    path = tmp_path / "free.nir"
    path.write_text(nereus.print_ir(m))
    assert main(["export", str(path), "--plan", "@free", "--to", "verl"]) == 0
    out, err = capsys.readouterr()
    run = as_run_by(m, m.plans["free"], "verl")
    m.plans[run.name] = run
    nereus.run_pipeline(m, f"estimate{{plan=@{run.name},oom=warn}}")
    step = re.search(r"# as verl runs these settings: step ([\d.]+) s, peak ([\d.]+) GiB per GPU on (\S+)", out)
    assert step, out
    # printed to a tenth: the same digits as the estimate's own figures rounded alike
    assert step.group(1) == f"{run.step_time:.1f}", (step.group(1), run.step_time)
    peak = max(run.layouts.values(), key=lambda lay: lay.memory)
    assert step.group(2) == f"{peak.memory / 2**30:.1f}" and step.group(3) == peak.model_stage
    assert f"# warning: verl runs this plan in {run.step_time:.1f} s per step, not the" in out
    assert "over the 72.0 GiB plan-search leaves (headroom 0.1 of 80.0 GiB)" in out
    assert "nereus export: warning: verl runs this plan" in err


def test_export_of_a_verl_target_plan_has_no_warning(tmp_path, capsys):
    m = nereus.parse(QWEN16)
    nereus.run_pipeline(m, "plan-search{time_limit=60,into=@p,target=verl}")
    path = tmp_path / "p.nir"
    path.write_text(nereus.print_ir(m))
    assert main(["export", str(path), "--plan", "@p", "--to", "verl-overrides"]) == 0
    out, err = capsys.readouterr()
    assert f"# as verl runs these settings: step {m.plans['p'].step_time:.1f} s" in out
    assert "warning" not in out + err
