"""docs/embedding.md's complete loop, run as written on 2 gloo processes; and ``ctl.stage``
checking its name on entry (issue 42, items 9 and 11)."""

import math
import re
from pathlib import Path

import pytest

from nereus.runtime.launch import run_local

from . import embedding_workers as w

DOC = Path(__file__).resolve().parents[2] / "docs" / "embedding.md"


def doc_loop() -> str:
    """The first python block under the heading '## A complete loop you can run'."""
    text = DOC.read_text()
    section = text.split("## A complete loop you can run", 1)[1]
    m = re.search(r"```python\n(.*?)```", section, re.S)
    assert m, "docs/embedding.md has no python block in its complete loop"
    return m.group(1)


def test_the_doc_loop_is_complete():
    code = doc_loop()
    for needed in ("init_from_env()", "build(", "LlamaAdapter(", "Controller(", "live.coordinate", "cluster @cpu"):
        assert needed in code, needed
    compile(code, "docs/embedding.md", "exec")


@pytest.mark.slow
def test_the_doc_loop_runs_on_two_processes():
    results = run_local(w.run_doc_loop, 2, doc_loop(), timeout=300)
    for res in results:
        assert len(res["losses"]) == 4 and all(math.isfinite(x) for x in res["losses"]), res
        assert res["active"]
    assert len({(r["plan"], r["action"]) for r in results}) == 1  # every rank took the same decisions


def test_stage_names_a_model_stage_of_the_plan_on_entry():
    (res,) = run_local(w.stage_names, 1, timeout=120)
    assert res["plan"] == "a"  # "@a" given from Python: stripped once
    assert "entered" not in res
    assert res["error"].startswith("ctl.stage('actor.generate'): actor.generate is not a model-stage of plan @a")
    assert "its model-stages: actor.train" in res["error"] and "@@" not in res["error"]
    assert res["timed"] == ["actor.train"]
