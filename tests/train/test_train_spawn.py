"""``dflash train`` with spawned DDP ranks (``--workers 2``): a rank's ``DflashError`` reaches the caller
as itself (one line at the CLI), a rank's bug as torch's ``ProcessRaisedException`` carrying the rank's
traceback (what ``mp.spawn`` raised), and the other rank is ended either way."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch.multiprocessing as torch_mp

from dflash_offline.errors import ConfigError
from dflash_offline.train.trainer import run_training
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
    monkeypatch.setattr("dflash_offline.train.trainer._rank_main", rank_entry.rank_1_config_error)
    with pytest.raises(ConfigError, match=rank_entry.FAULT_TEXT) as raised:
        run_training(train_config(tmp_path / "cache", tmp_path / "run", num_cpu_workers=2))
    assert str(raised.value) == rank_entry.FAULT_TEXT
    _assert_no_rank_left()


@pytest.mark.timeout(300)
def test_a_ranks_bug_reaches_the_caller_with_its_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("dflash_offline.train.trainer._rank_main", rank_entry.rank_1_bug)
    with pytest.raises(torch_mp.ProcessRaisedException) as raised:
        run_training(train_config(tmp_path / "cache", tmp_path / "run", num_cpu_workers=2))
    text = str(raised.value)
    assert text.startswith("\n\n-- Process 1 terminated with the following error:\nTraceback")
    assert text.endswith(f"RuntimeError: {rank_entry.FAULT_TEXT}\n")
    assert raised.value.error_index == 1
    _assert_no_rank_left()
