"""Fixtures of the RL examples' tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="session")
def reward_model(tmp_path_factory) -> tuple[Path, dict]:
    """``examples/ppo_tiny.py``'s reward model, fitted once per test process
    (``reward_model.train``, its defaults) and saved: (the file, its held-out fit)."""
    pytest.importorskip("transformers")
    import torch

    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import grpo_tiny
    import reward_model as rm

    state, fit = rm.train(grpo_tiny.config(), digits=3, alphabet=4)
    path = tmp_path_factory.mktemp("reward") / "reward_model.pt"
    torch.save(state, path)
    return path, fit
