"""Helpers shared by the tests (not tests themselves): paths, Hypothesis strategies
(``strategies``), the functions spawned ranks run (``runtime_workers``) and a tiny job
(``jobs``). Spawned processes import ``tests.support.runtime_workers`` by that name."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.nir"))
GOLDEN = ROOT / "tests" / "golden"


def example(name: str) -> Path:
    """The checked-in example ``examples/NAME``."""
    return next(p for p in EXAMPLES if p.name == name)
