"""Helpers for the generate tests (and the train tests that need a generated cache): small chat data
sets, a config on the random:tiny target, and ``dflash generate`` as a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash_offline.cache.reader import CacheReader
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


def make_conversations_jsonl(path: Path, *, seed: int, parts: int = 8, prompts: int = 6) -> Path:
    """Chat JSONL of related records, in shuffled order: ``parts`` long conversations split ShareGPT's way
    into records ``<root>_0``, ``<root>_4``, ``<root>_11`` (``data/sources.py:conversation_root``: one root),
    and ``prompts`` prompts answered twice (one record id, the same user turns, other answers: a greedy and
    a sampled regeneration)."""
    rng = np.random.default_rng(seed)
    alnum = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")

    def words(most: int) -> str:
        return " ".join(rng.choice(WORDS, int(rng.integers(1, most))))

    records: list[dict[str, Any]] = []
    for _ in range(parts):
        root = "".join(rng.choice(alnum, 7))
        for first_turn in (0, 4, 11):
            messages = [
                {"role": role, "content": words(30)} for _turn in range(2) for role in ("user", "assistant")
            ]
            records.append({"id": f"{root}_{first_turn}", "messages": messages})
    for p in range(prompts):
        asked = [words(12) for _turn in range(2)]
        for _answer in range(2):
            messages = [
                m
                for q in asked
                for m in ({"role": "user", "content": q}, {"role": "assistant", "content": words(30)})
            ]
            records.append({"id": f"prompt-{seed}-{p}", "messages": messages})
    order = rng.permutation(len(records))
    with open(path, "w") as f:
        for i in order.tolist():
            f.write(json.dumps(records[i]) + "\n")
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


def generate_cmd(cache: Path, data: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "dflash_offline",
        "generate",
        "--cache",
        str(cache),
        "--target",
        "random:tiny",
        "--data",
        str(data),
        "--layer-ids",
        "0,2",
        "--max-len",
        "256",
        "--too-long",
        "truncate",
        "--bucket-edges",
        "48,96,160,256",
        "--tokens-per-batch",
        "512",
        "--window",
        "30",
        "--threads",
        "1",
        "--no-progress",
        *extra,
    ]


def run_in_process(cmd: list[str]) -> str:
    """A ``python -m dflash_offline ...`` command line (``generate_cmd``, the train kill tests' ``train_cmd``)
    run to its end in this process through the CLI; its output (stdout and stderr). The same run as the
    subprocess's (generate's workers and train's spawned ranks are processes either way; one train rank
    trains in this process, as the fast tests' runs do), less a process's start-up (imports and the
    target's config: seconds of CPU on 2 cores), for a reference run that a test only reads, or the rerun
    that resumes a killed or interrupted subprocess's cache or run (all it resumes from is on disk)."""
    from click.testing import CliRunner

    from dflash_offline.cli import main

    assert cmd[1:3] == ["-m", "dflash_offline"], cmd
    result = CliRunner().invoke(main, cmd[3:])
    assert result.exit_code == 0, (result.output, result.exception)
    return result.output


def start_in_new_session(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    # A new session so that SIGKILL reaches the coordinator and its workers alike.
    return subprocess.Popen(
        cmd, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env
    )


def features_by_id(root: Path) -> dict[str, tuple[torch.Tensor, np.ndarray, np.ndarray]]:
    reader = CacheReader.open(root)
    try:
        samples = reader.read([str(s) for s in reader.samples.sample_id])
        return {s.sample_id: (s.features_TF, s.input_ids_T.numpy(), s.loss_mask_T.numpy()) for s in samples}
    finally:
        reader.close()
