"""``dflash regenerate`` started the way a script starts a background job (``cmd &`` in a non-interactive
shell: SIGINT inherited as ignored) still stops on SIGINT, between decode steps: exit 130, every finished
conversation kept, and the rerun completes to the output of an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from dflash_offline.cli import main
from tests.eval.helpers import write_chat_jsonl

pytestmark = pytest.mark.slow

NUM_RECORDS = 16


def _cmd(data: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "dflash_offline", "regenerate", "--target", "random:tiny",
            "--data", str(data), "--max-new-tokens", "32", "--batch-size", "2", "--threads", "1",
            "--no-progress", "--out", str(out)]  # fmt: skip


def _messages(path: Path) -> dict[str, Any]:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by_id = {line["source_sample_id"]: line["messages"] for line in lines}
    assert len(by_id) == len(lines), "a conversation was written twice"
    return by_id


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.timeout(900)
def test_sigint_stops_a_run_started_with_sigint_ignored_and_the_rerun_completes(tmp_path: Path) -> None:
    data = write_chat_jsonl(tmp_path / "chat.jsonl", NUM_RECORDS, turns=1, seed=8)
    reference = tmp_path / "reference.jsonl"
    result = CliRunner().invoke(main, _cmd(data, reference)[3:])  # in this process: no start-up cost
    assert result.exit_code == 0, result.output

    out = tmp_path / "out.jsonl"
    process = subprocess.Popen(
        _cmd(data, out), preexec_fn=_ignore_sigint, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and process.poll() is None:
            if out.exists() and out.read_bytes().count(b"\n") >= 2:
                break
            time.sleep(0.02)
        assert process.poll() is None, "the run ended before it could be interrupted"
        os.kill(process.pid, signal.SIGINT)  # as `kill -INT $pid` from the script
        try:
            output, _ = process.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            pytest.fail("SIGINT did not stop a run started with SIGINT ignored")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 130, output.decode()[-3000:]
    assert b"stopping after this decode step" in output
    assert b"resume" in output
    partial = _messages(out)
    assert 2 <= len(partial) < NUM_RECORDS  # stopped before the end, keeping every finished answer
    expected = _messages(reference)
    assert all(expected[k] == v for k, v in partial.items())

    rerun = CliRunner().invoke(main, _cmd(data, out)[3:])  # in this process: no start-up cost
    assert rerun.exit_code == 0, (rerun.output, rerun.exception)
    assert f"{len(partial)} already done" in rerun.stdout
    assert _messages(out) == expected
