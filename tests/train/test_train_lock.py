"""``dflash train``: one run per ``--out``, and DDP ranks that die with their launcher."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from dflash_offline.errors import ConfigError
from dflash_offline.locking import LockedError, acquire_lock
from dflash_offline.train.launch import run_training
from tests.process_helpers import group_members, workers_of
from tests.train.helpers import train_config
from tests.train.kill_helpers import last_step, train_cmd


def test_a_second_train_into_the_same_out_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "run"
    refused = pytest.raises(LockedError, match=rf"training run {out} is in use by pid {os.getpid()}")
    with acquire_lock(out, what="training run", command="dflash train --out run"), refused:
        run_training(train_config(tmp_path / "no-cache-needed", out))
    assert not (out / "metrics.jsonl").exists()  # refused before anything was written


def test_an_out_inside_the_cache_is_refused(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    for out in (cache, cache / "run", cache / "shards" / ".." / "run"):
        with pytest.raises(ConfigError, match=r"`TrainConfig\.out_dir` .* is inside `cache_dir`"):
            train_config(cache, out)
    train_config(cache, tmp_path / "cache-run")  # a sibling whose name starts alike is fine


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkill_of_the_launcher_takes_its_ddp_ranks_with_it(tiny_cache: Path, tmp_path: Path) -> None:
    cmd = train_cmd(tiny_cache, tmp_path / "run", steps=100000, workers=2)
    process = subprocess.Popen(
        cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 300
        ranks: list[int] = []
        while time.monotonic() < deadline and process.poll() is None and len(ranks) < 2:
            ranks = workers_of(process.pid)
            time.sleep(0.2)
        assert len(ranks) == 2, "the DDP ranks did not start"
        # Killed while training: the ranks stop at their next step boundary. (Killed earlier, a rank
        # still importing or joining the process group stops only when it gets there, or after
        # ORPHAN_GRACE_SECONDS: a fixed sleep here made the test race the ranks' start-up.)
        while time.monotonic() < deadline and process.poll() is None and last_step(tmp_path / "run") < 1:
            time.sleep(0.2)
        assert last_step(tmp_path / "run") >= 1, "the run logged no step"
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and group_members(process.pid):
            time.sleep(0.1)
        survivors = group_members(process.pid)
        assert not survivors, f"ranks {survivors} survived their launcher"
    finally:
        if group_members(process.pid):
            os.killpg(process.pid, signal.SIGKILL)
