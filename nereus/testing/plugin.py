"""The pytest plugin (entry point ``pytest11: nereus``): the ``nir_golden`` fixture and the
``--update-goldens`` option. Only pytest imports this module."""

from __future__ import annotations

from pathlib import Path

import pytest

from .golden import GoldenMismatch, compare, produce


def pytest_addoption(parser):
    group = parser.getgroup("nereus")
    group.addoption(
        "--update-goldens",
        action="store_true",
        default=False,
        help="rewrite Nereus golden files (.nir.expected) and fail, so the diff gets read",
    )


@pytest.fixture
def nir_golden(request):
    """``nir_golden(path, pipeline=None)``: run the case's pipeline and compare with ``path + '.expected'``.
    A relative ``path`` is taken from the test file's folder (as a user writes it beside the
    test), so the test passes from any working directory."""
    update = request.config.getoption("--update-goldens")
    here = Path(request.node.fspath).parent

    def check(path, pipeline: str | None = None) -> str:
        path = Path(path)
        if not path.is_absolute():
            path = here / path
        actual = produce(path, pipeline)
        try:
            compare(actual, path.with_name(path.name + ".expected"), update)
        except GoldenMismatch as e:
            pytest.fail(str(e), pytrace=False)
        return actual

    return check
