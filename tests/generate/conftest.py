"""Fixtures for generate tests: small chat data sets and a config on the random:tiny target."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dflash_offline.generate.config import GenerateConfig
from dflash_offline.placement import Placement

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex bad jokes".split()  # noqa: SIM905


def make_chat_jsonl(path: Path, num_records: int, *, seed: int = 0, max_words: int = 120) -> Path:
    """Chat JSONL (messages of role/content) with varied lengths, so that several buckets fill."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for i in range(num_records):
            messages: list[dict[str, Any]] = []
            if i % 5 == 0:
                messages.append({"role": "system", "content": "Answer briefly."})
            for _turn in range(1 + int(rng.integers(0, 3))):
                n_user = int(rng.integers(1, max_words // 3))
                n_bot = int(rng.integers(1, max_words))
                messages.append({"role": "user", "content": " ".join(rng.choice(WORDS, n_user))})
                messages.append({"role": "assistant", "content": " ".join(rng.choice(WORDS, n_bot))})
            f.write(json.dumps({"id": f"rec-{i}", "messages": messages}) + "\n")
    return path


def tiny_config(cache_dir: Path, data: Path, **overrides: Any) -> GenerateConfig:
    config = GenerateConfig(
        cache_dir=cache_dir,
        target="random:tiny",
        data=data,
        # random:tiny has 4 layers; HF's last hidden state is post-norm, so the reference can only
        # check layers below the last.
        layer_ids=(0, 2),
        max_length=256,
        too_long="truncate",
        bucket_edges=(48, 96, 160, 256),
        tokens_per_batch=768,
        max_batch_size=16,
        window_records=40,
        flush_seconds=0.3,
        progress=False,
        placement=Placement(num_cpu_workers=1, threads_per_worker=1),
    )
    return replace(config, **overrides)


@pytest.fixture(scope="session")
def chat_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chat_jsonl(tmp_path_factory.mktemp("data") / "chat.jsonl", 60)
