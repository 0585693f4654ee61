"""``dflash generate --window-limit`` and ``dflash train --follow`` as real subprocesses side by side, each
SIGKILLed at random points and rerun with the same command, then checked against a plain generate's cache.

Used by tests/train/test_follow_kill.py (three kills) and bench/soak_follow.py (many rounds of many).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np
import torch

from dflash_offline.cache.manifest import read_table
from dflash_offline.train.damaged import DAMAGED_FILE
from tests.generate.helpers import features_by_id, generate_cmd
from tests.train.helpers import train_config
from tests.train.test_follow import VAL_FRACTION, check_followed

VICTIMS = ("generate", "train", "both")
"""Whom one kill is meant for."""


def window_generate_cmd(cache: Path, data: Path) -> list[str]:
    """Generate with two workers through a 1 MB window: 60 records make 11 stores, a few at a time."""
    return generate_cmd(
        cache, data, "--workers", "2", "--flush-seconds", "0.2", "--window-limit", "1MB",
        "--val-fraction", str(VAL_FRACTION),
    )  # fmt: skip


def follow_cmd(cache: Path, run: Path) -> list[str]:
    return [
        sys.executable, "-m", "dflash_offline", "train", "--follow", "--passes", "2",
        "--cache", str(cache), "--out", str(run),
        "--num-layers", "1", "--block-size", "8", "--num-anchors", "32",
        "--tokens-per-microbatch", "600", "--lr", "3e-3", "--grad-accum", "1", "--checkpoint-every", "3",
        "--val-fraction", str(VAL_FRACTION), "--val-every", "1000",
        "--loader-threads", "2", "--prefetch", "2", "--deterministic", "--threads", "1", "--no-progress",
    ]  # fmt: skip


@dataclass(frozen=True, slots=True)
class KillOutcome:
    """One kill: whom it was meant for, after how long, and which of them it found running (a command that
    had already ended is rerun all the same: a rerun of a finished command must do nothing)."""

    victim: str
    delay_s: float
    landed: tuple[str, ...]


class _Command:
    """One command, started at once and again after every kill; every start's output appended to one log (a
    file, not a pipe: a pipe nobody reads until the end can fill and stall the command)."""

    def __init__(self, cmd: list[str], log: Path) -> None:
        self.cmd, self.log = cmd, log
        self._start()

    def _start(self) -> None:
        self._out: IO[bytes] = open(self.log, "ab")  # noqa: SIM115 (closed in kill, once the process is reaped)
        # A new session so that SIGKILL reaches the command and its workers alike.
        self.process = subprocess.Popen(
            self.cmd, start_new_session=True, stdout=self._out, stderr=subprocess.STDOUT
        )

    def kill(self) -> bool:
        """SIGKILL to its process group if it still runs, then reap it and close its log; whether it ran."""
        running = self.process.poll() is None
        if running:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self._out.close()
        return running

    def restart_if_ended(self) -> None:
        """Rerun the command if it ended, killed or finished (a rerun of a finished command must do nothing);
        one that failed fails the caller with its output."""
        if self.process.poll() is None:
            return
        assert self.process.returncode in (0, -signal.SIGKILL), self.tail()
        self.kill()  # nothing left to kill: reaped, its log closed
        self._start()

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


def kill_during_follow(
    generate: list[str],
    train: list[str],
    victims: Sequence[str],
    rng: np.random.Generator,
    logs: Path,
    *,
    delay_s: tuple[float, float] = (2.0, 8.0),
    timeout_s: float = 1500.0,
) -> list[KillOutcome]:
    """Start both commands, kill ``victims`` one after another (each a uniform ``delay_s`` after the kill
    before), rerun whatever ended, then let both end by themselves: generate once its data is done, train once
    generate finished and every store was trained. A command that exits other than 0 (or -9 from a kill)
    fails at once with its output: the other would wait for it forever."""
    logs.mkdir(parents=True, exist_ok=True)
    commands = {
        "generate": _Command(generate, logs / "generate.log"),
        "train": _Command(train, logs / "train.log"),
    }
    outcomes: list[KillOutcome] = []
    deadline = time.monotonic() + timeout_s
    try:
        for victim in victims:
            delay = float(rng.uniform(*delay_s))
            time.sleep(delay)
            names = ("generate", "train") if victim == "both" else (victim,)
            landed = tuple(name for name in names if commands[name].kill())
            for command in commands.values():
                command.restart_if_ended()
            outcomes.append(KillOutcome(victim=victim, delay_s=delay, landed=landed))
        while time.monotonic() < deadline and any(c.process.poll() is None for c in commands.values()):
            for command in commands.values():
                assert command.process.poll() in (None, 0), command.tail()
            time.sleep(0.1)
        for command in commands.values():
            assert command.process.poll() == 0, (
                f"not ended within {timeout_s:g} s, or failed: {command.tail()}"
            )
    finally:
        for command in commands.values():
            command.kill()
    return outcomes


def check_against_reference(cache: Path, run: Path, reference: Path) -> None:
    """Every training sample trained exactly its passes (counted from the run's records), every sealed
    training store retired by this run and no validation store, no retired store read (a read fails the run:
    its files are gone), verify clean, and every sample committed once and bit-equal to the plain
    generate's."""
    check_followed(cache, run, train_config(cache, run, max_steps=None, val_fraction=VAL_FRACTION))
    assert "train" in read_table(cache, "waits", ["side"]).column("side").to_pylist()  # it started first
    assert not list(run.rglob(DAMAGED_FILE))
    rows = read_table(cache, "samples", ["sample_id", "checksum"]).to_pydict()
    ref_rows = read_table(reference, "samples", ["sample_id", "checksum"]).to_pydict()
    assert len(rows["sample_id"]) == len(set(rows["sample_id"]))  # none committed twice
    assert dict(zip(rows["sample_id"], rows["checksum"], strict=True)) == dict(
        zip(ref_rows["sample_id"], ref_rows["checksum"], strict=True)
    )
    ref, got = features_by_id(reference), features_by_id(cache)
    assert got
    for sample_id, (features, ids, mask) in got.items():
        features_ref, ids_ref, mask_ref = ref[sample_id]
        assert np.array_equal(ids, ids_ref)
        assert np.array_equal(mask, mask_ref)
        assert torch.equal(features.view(torch.int16), features_ref.view(torch.int16)), sample_id
