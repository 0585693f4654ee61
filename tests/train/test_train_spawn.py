"""``dflash train`` with spawned DDP ranks (``--workers 2``): a rank's ``DflashError`` reaches the caller
as itself (one line at the CLI), a rank's bug as torch's ``ProcessRaisedException`` carrying the rank's
traceback (what ``mp.spawn`` raised), and the other rank is ended either way; a rank's notes reach a
command-line user with the flags, as the launcher's do."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.multiprocessing as torch_mp

from dflash_offline.errors import ConfigError
from dflash_offline.train.launch import run_training
from tests.process_helpers import workers_of
from tests.train import rank_entry
from tests.train.helpers import train_config


def _assert_no_rank_left() -> None:
    deadline = time.monotonic() + 60
    while workers_of(os.getpid()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not workers_of(os.getpid()), "a rank outlived the failed run"


@pytest.mark.timeout(300)
def test_a_ranks_dflash_error_reaches_the_caller_as_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Spawned ranks import their entry by name: the test's own, whose rank 1 raises.
    monkeypatch.setattr("dflash_offline.train.launch._rank_main", rank_entry.rank_1_config_error)
    with pytest.raises(ConfigError, match=rank_entry.FAULT_TEXT) as raised:
        run_training(train_config(tmp_path / "cache", tmp_path / "run", num_cpu_workers=2))
    assert str(raised.value) == rank_entry.FAULT_TEXT
    _assert_no_rank_left()


@pytest.mark.timeout(300)
def test_a_ranks_bug_reaches_the_caller_with_its_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("dflash_offline.train.launch._rank_main", rank_entry.rank_1_bug)
    with pytest.raises(torch_mp.ProcessRaisedException) as raised:
        run_training(train_config(tmp_path / "cache", tmp_path / "run", num_cpu_workers=2))
    text = str(raised.value)
    assert text.startswith("\n\n-- Process 1 terminated with the following error:\nTraceback")
    assert text.endswith(f"RuntimeError: {rank_entry.FAULT_TEXT}\n")
    assert raised.value.error_index == 1
    _assert_no_rank_left()


@pytest.mark.slow  # a launcher and two spawned ranks as processes of their own: seconds of start-up each
@pytest.mark.timeout(300)
def test_a_spawned_ranks_note_names_the_flag(tiny_cache: Path, tmp_path: Path) -> None:
    """Rank 0 prints the training subset's note, which names ``DataConfig.train_samples`` by its field;
    under ``dflash train --workers 2`` it reaches stderr spelled as the flag the user typed."""
    cmd = [
        sys.executable, "-m", "dflash_offline", "train",
        "--cache", str(tiny_cache), "--out", str(tmp_path / "run"), "--workers", "2", "--threads", "1",
        "--train-samples", "20", "--max-steps", "1", "--num-layers", "1", "--block-size", "8",
        "--num-anchors", "8", "--tokens-per-microbatch", "600", "--no-progress",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    (note,) = [line for line in done.stderr.splitlines() if "training on " in line]
    assert "training on 20 of 80 samples (" in note, note
    assert "; --train-samples 20, those of smallest hash)" in note, note
    assert "`" not in note, note  # no field name left unrendered
