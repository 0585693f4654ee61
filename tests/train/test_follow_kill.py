"""SIGKILL of ``dflash generate --window-limit``, of ``dflash train --follow`` and of both, at random
points, as real subprocesses on the CPU (generate with two workers); each rerun with the same command.
Each training sample is trained exactly ``--passes`` times counted from the run's records, no retired
store is ever read (a read of one would fail the run: its files are gone), the validation stores are
never retired, and every sample equals a plain generate's (docs/follow.md)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.generate.helpers import generate_cmd, make_chat_jsonl, run_in_process
from tests.train.follow_kill_helpers import (
    check_against_reference,
    follow_cmd,
    kill_during_follow,
    window_generate_cmd,
)

pytestmark = pytest.mark.slow


@pytest.mark.timeout(1800)
def test_sigkill_generate_train_and_both_during_follow(tmp_path: Path) -> None:
    # 60 records: a window of 1 MB holds a few of their 11 stores, and generate and training both run
    # well past the last kill (three kills within 24 s of the start, each costing the victim a start-up
    # of seconds: the uninterrupted pair takes about 30 s on 2 cores, and training, the slower, waits for
    # generate to finish).
    data = make_chat_jsonl(tmp_path / "chat.jsonl", 60, seed=9)
    reference = tmp_path / "reference"
    run_in_process(generate_cmd(reference, data))

    cache, run = tmp_path / "window", tmp_path / "run"
    outcomes = kill_during_follow(
        window_generate_cmd(cache, data), follow_cmd(cache, run), ["generate", "train", "both"],
        np.random.default_rng(5), tmp_path / "logs",
    )  # fmt: skip
    assert all(o.landed for o in outcomes), outcomes  # each kill found its victim, or one of both, running
    check_against_reference(cache, run, reference)
