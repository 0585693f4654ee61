"""Fixtures for generate tests: a small chat data set."""

from __future__ import annotations

from pathlib import Path

import pytest

from .helpers import make_chat_jsonl


@pytest.fixture(scope="session")
def chat_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chat_jsonl(tmp_path_factory.mktemp("data") / "chat.jsonl", 60)
