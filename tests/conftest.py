from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.nir"))


@pytest.fixture
def root() -> Path:
    return ROOT
