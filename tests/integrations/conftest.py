"""Fixtures of the RL examples' tests."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="session")
def reward_model(tmp_path_factory) -> tuple[Path, dict]:
    """``examples/ppo_tiny.py``'s reward model, fitted once per test run (``reward_model.train``,
    its defaults; the pytest-xdist workers share the file under a lock) and saved: (the file, its
    held-out fit)."""
    pytest.importorskip("transformers")
    import torch
    from filelock import FileLock

    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import grpo_tiny
    import reward_model as rm

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest-N/popen-gwK: pytest-N is this run's, shared by its workers
        root = root.parent
    path, fit_file = root / "reward_model.pt", root / "reward_model.fit.json"
    with FileLock(str(root / "reward_model.lock")):
        if not fit_file.exists():
            state, fit = rm.train(grpo_tiny.config(), digits=3, alphabet=4)
            torch.save(state, path)
            fit_file.write_text(json.dumps(fit))
    return path, json.loads(fit_file.read_text())
