"""The slow modules that tests/conftest.py starts first exist: a renamed one would silently fall back to
its place in the collection, where it may start last and run alone at the end of `make test-slow`."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import LONGEST_FIRST

ROOT = Path(__file__).resolve().parents[1]


def test_every_module_started_first_exists_and_has_slow_tests() -> None:
    for path in LONGEST_FIRST:
        source = ROOT / path
        assert source.is_file(), f"{path} is listed in tests/conftest.py LONGEST_FIRST but does not exist"
        assert "mark.slow" in source.read_text(), f"{path} has no slow test: drop it from LONGEST_FIRST"
