"""The slow modules that tests/conftest.py starts first exist: a renamed one would silently fall back to
its place in the collection, where it may start last and run alone at the end of `make test-slow`; nor
would one of the fast modules put first so that their module-scoped set-ups run on one worker."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import LONGEST_FIRST, SET_UP_ONCE_FIRST

ROOT = Path(__file__).resolve().parents[1]


def test_every_module_started_first_exists_and_has_slow_tests() -> None:
    for path in LONGEST_FIRST:
        source = ROOT / path
        assert source.is_file(), f"{path} is listed in tests/conftest.py LONGEST_FIRST but does not exist"
        assert "mark.slow" in source.read_text(), f"{path} has no slow test: drop it from LONGEST_FIRST"


def test_every_module_set_up_first_exists_and_has_a_module_scoped_fixture() -> None:
    for path in SET_UP_ONCE_FIRST:
        source = ROOT / path
        assert source.is_file(), f"{path} is listed in tests/conftest.py SET_UP_ONCE_FIRST but does not exist"
        assert 'scope="module"' in source.read_text(), f"{path} sets nothing up per module: drop it"
