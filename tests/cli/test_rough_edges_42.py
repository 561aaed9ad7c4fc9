"""Issue 42, item 8, from the command line: warnings for implausible units in ``nereus check``,
a non-positive ``time_limit``, counts of one, README's ``reshard_shards`` example."""

from __future__ import annotations

from pathlib import Path

import pytest

from nereus.cli import main

from ..ir.test_user_rough_edges import edit
from ..support import example

ROOT = Path(__file__).resolve().parents[2]


def test_check_prints_unit_warnings_at_the_attribute_and_exits_0(tmp_path, capsys):
    path = tmp_path / "job.nir"
    path.write_text(
        edit(("gpu_memory = 80GiB", "gpu_memory = 80MiB"), ("hbm_bandwidth = 3.35TB/s", "hbm_bandwidth = 3.35Tb/s"))
    )
    assert main(["check", str(path)]) == 0
    err = capsys.readouterr().err
    assert f"{path}:4:3: warning: gpu_memory = 80MiB is under 1GiB" in err and "hint: did you mean 80GiB?" in err
    assert f"{path}:6:3: warning: hbm_bandwidth = 3.35Tb/s is in bits per second" in err
    assert "hint: did you mean 3.35TB/s?" in err


@pytest.mark.parametrize(
    "pipeline", ["plan-search{time_limit=-1}", "plan-search{time_limit=0}", "schedule-transfers{time_limit=-2}"]
)
def test_a_non_positive_time_limit_says_it_must_be_positive(pipeline, capsys):
    assert main(["opt", str(example("grpo_7b_8gpu.nir")), "-p", pipeline]) == 1
    err = capsys.readouterr().err
    assert "time_limit must be a positive number of seconds, got" in err
    assert "raise time_limit" not in err


def test_diff_of_a_file_with_one_plan_says_one_plan(capsys):
    assert main(["diff", str(example("grpo_7b_8gpu.nir"))]) == 1
    assert "has 1 plan (@grpo_p0)" in capsys.readouterr().err


def test_readme_reshard_shards_example_passes_world():
    readme = (ROOT / "README.md").read_text()
    (line,) = [ln for ln in readme.splitlines() if ln.startswith("mine = nereus.reshard_shards(")]
    assert "world=" in line
    assert "needs `world=`" in readme


def test_reshard_shards_outside_a_process_group_asks_for_world():
    import nereus

    model = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 4, "ffn": 128, "vocab": 16}
    with pytest.raises(ValueError, match=r"reshard_shards needs world= outside an initialised process group"):
        nereus.reshard_shards(model, {"tp": 2}, 0)
    assert set(nereus.reshard_shards(model, {"tp": 2}, 0, world=2)) >= {"embed_tokens.weight"}
