"""``dflash regenerate`` with several worker processes: two CPU workers write the same conversations as one;
SIGKILL of the whole run, then a rerun (with another worker count), leaves every conversation once; Ctrl-C
stops cleanly (exit 130) and resumes, spawned workers and torchrun ranks alike; workers exit when their
coordinator is killed."""

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
from dflash_offline.errors import WorkerError
from dflash_offline.placement import Placement, free_port
from dflash_offline.regenerate.config import RegenerateConfig
from dflash_offline.regenerate.run import run_regenerate
from dflash_offline.regenerate.worker import belongs_to
from tests.eval.helpers import conversations, write_chat_jsonl
from tests.process_helpers import alive, reaped, workers_of

pytestmark = pytest.mark.slow


def _messages(path: Path) -> dict[str, Any]:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by_id = {line["source_sample_id"]: line["messages"] for line in lines}
    assert len(by_id) == len(lines), "a conversation was written twice"
    return by_id


def _config(out: Path, data: Path, workers: int) -> RegenerateConfig:
    return RegenerateConfig(
        out=out, data=str(data), target="random:tiny", max_new_tokens=10, batch_size=3, progress=False,
        placement=Placement(num_cpu_workers=workers, threads_per_worker=1),
    )  # fmt: skip


@pytest.mark.timeout(600)
def test_two_cpu_workers_write_the_same_conversations_as_one(tmp_path: Path) -> None:
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 12, turns=2, seed=2)
    one = run_regenerate(_config(tmp_path / "one.jsonl", data, 1))
    two = run_regenerate(_config(tmp_path / "two.jsonl", data, 2))
    assert one is not None
    assert two is not None
    assert (one.written, two.written, two.workers, two.answers) == (12, 12, 2, 24)
    assert two.new_tokens == one.new_tokens
    assert _messages(tmp_path / "two.jsonl") == _messages(tmp_path / "one.jsonl")
    assert not (tmp_path / "two.jsonl.parts").exists()  # merged into the one output
    # Both workers had a share (the hash partition is disjoint and covers every record).
    ids = [c.sample_id for c in conversations(data)]
    shares = [sum(belongs_to(i, w, 2) for i in ids) for w in (0, 1)]
    assert sum(shares) == 12
    assert min(shares) > 0
    # The engine stats are each worker's own, summed: the slots of both, every answer's decoded tokens
    # (its tokens, the stop token included, less the first, which its prefill gave) and every prompt token
    # prefilled or reused once, as in the one worker's run.
    one_stats, two_stats = one.engine_stats, two.engine_stats
    assert one_stats is not None
    assert two_stats is not None
    assert (one_stats.engines, one_stats.slots, two_stats.engines, two_stats.slots) == (1, 3, 2, 6)
    assert two_stats.slot_steps == 3 * two_stats.steps
    decoded = _decoded_tokens(tmp_path / "one.jsonl")
    assert (one_stats.decoded_tokens, two_stats.decoded_tokens) == (decoded, decoded)
    prompt_tokens = one_stats.prefill_tokens + one_stats.reused_tokens
    assert two_stats.prefill_tokens + two_stats.reused_tokens == prompt_tokens


def _decoded_tokens(path: Path) -> int:
    """Tokens decode steps gave the answers of the output at ``path``: each answer's ids and its stop token,
    less its first token (its prefill's)."""
    total = 0
    for line in path.read_text().splitlines():
        record = json.loads(line)
        answers = [m for m in record["messages"] if m["role"] == "assistant"]
        for m, reason in zip(answers, record["finish_reasons"], strict=True):
            total += len(m["token_ids"]) + (reason == "stop") - 1
    return total


def _cmd(data: Path, out: Path, workers: int) -> list[str]:
    return [sys.executable, "-m", "dflash_offline", "regenerate", "--target", "random:tiny",
            "--data", str(data), "--max-new-tokens", "24", "--batch-size", "2", "--workers", str(workers),
            "--threads", "1", "--no-progress", "--out", str(out)]  # fmt: skip


def _lines_written(out: Path) -> int:
    paths = [out, *out.with_name(out.name + ".parts").glob("w*.jsonl")]
    return sum(p.read_bytes().count(b"\n") for p in paths if p.exists() and ".failures." not in p.name)


def _start(cmd: list[str]) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # A new session so that a signal to the group reaches the coordinator and its workers alike.
    return subprocess.Popen(
        cmd, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env
    )


def _wait_for_lines(process: subprocess.Popen[bytes], out: Path, n: int) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        if _lines_written(out) >= n:
            return
        time.sleep(0.05)
    if process.poll() is not None:
        pytest.fail("the run finished before it could be interrupted; make it longer")
    pytest.fail("no output appeared in time")


@pytest.mark.timeout(900)
def test_sigkill_of_a_two_worker_run_then_rerun_writes_every_conversation_once(tmp_path: Path) -> None:
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 24, turns=2, seed=3)
    reference = tmp_path / "reference.jsonl"
    result = CliRunner().invoke(main, _cmd(data, reference, 1)[3:])  # in this process: no start-up cost
    assert result.exit_code == 0, result.output
    out = tmp_path / "killed.jsonl"
    with reaped(_start(_cmd(data, out, 2))) as process:
        _wait_for_lines(process, out, 4)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=60)
    assert 4 <= _lines_written(out) < 24
    # The rerun, with another worker count, merges the killed run's parts and answers the rest.
    rerun = CliRunner().invoke(main, _cmd(data, out, 1)[3:])  # in this process: no start-up cost
    assert rerun.exit_code == 0, (rerun.output, rerun.exception)
    assert "already done" in rerun.stdout
    assert _messages(out) == _messages(reference)
    assert not out.with_name(out.name + ".parts").exists()


@pytest.mark.timeout(900)
def test_ctrl_c_stops_workers_cleanly_and_the_rerun_completes(tmp_path: Path) -> None:
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 24, turns=2, seed=4)
    out = tmp_path / "out.jsonl"
    with reaped(_start(_cmd(data, out, 2))) as process:
        _wait_for_lines(process, out, 3)
        os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends to the process group
        output, _ = process.communicate(timeout=300)
    assert process.returncode == 130, output.decode()[-3000:]
    assert b"resume" in output
    partial = _messages(out)  # merged at the stop: no parts left behind
    assert 3 <= len(partial) < 24
    assert not out.with_name(out.name + ".parts").exists()
    rerun = CliRunner().invoke(main, _cmd(data, out, 2)[3:])  # in this process: no coordinator start-up
    assert rerun.exit_code == 0, (rerun.output, rerun.exception)
    final = _messages(out)
    assert len(final) == 24
    assert all(final[k] == v for k, v in partial.items())


@pytest.mark.timeout(600)
def test_workers_exit_when_the_coordinator_is_killed(tmp_path: Path) -> None:
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 24, turns=2, seed=5)
    out = tmp_path / "out.jsonl"
    with reaped(_start(_cmd(data, out, 2))) as process:
        _wait_for_lines(process, out, 1)
        workers = workers_of(process.pid)
        assert len(workers) == 2
        process.kill()  # the coordinator alone
        process.wait(timeout=60)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and alive(workers):
            time.sleep(0.2)
        assert not alive(workers), "a worker outlived its coordinator"


@pytest.mark.timeout(600)
def test_torchrun_ranks_write_the_same_conversations_as_one_worker(tmp_path: Path) -> None:
    import socket

    data = write_chat_jsonl(tmp_path / "chat.jsonl", 10, turns=2, seed=6)
    one = tmp_path / "one.jsonl"
    assert CliRunner().invoke(main, _cmd(data, one, 1)[3:]).exit_code == 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "ranks.jsonl"
    cmd = _cmd(data, out, 1)
    cmd[1:3] = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port), "-m",
                "dflash_offline"]  # fmt: skip
    result = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 worker(s)" in result.stdout
    assert _messages(out) == _messages(one)
    assert not out.with_name(out.name + ".parts").exists()


def _torchrun(cmd: list[str], module: str, port: int) -> list[str]:
    """``cmd`` (a ``python -m dflash_offline ...`` line) as two CPU ranks of torchrun running ``module``."""
    return [cmd[0], "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
            "-m", module, *cmd[3:]]  # fmt: skip


@pytest.mark.timeout(600)
def test_ctrl_c_stops_torchrun_ranks_after_their_decode_step_and_the_rerun_completes(tmp_path: Path) -> None:
    from tests.regenerate.worker_entry import HOLD_ENV

    data = write_chat_jsonl(tmp_path / "chat.jsonl", 16, turns=2, seed=7)
    ids = [c.sample_id for c in conversations(data)]
    assert all(any(belongs_to(i, rank, 2) for i in ids) for rank in (0, 1))  # each rank has records
    reference = tmp_path / "reference.jsonl"
    assert CliRunner().invoke(main, _cmd(data, reference, 1)[3:]).exit_code == 0
    out, held = tmp_path / "out.jsonl", tmp_path / "held"
    held.mkdir()
    # Each rank holds after its first written conversation until it is asked to stop (worker_entry.py).
    cmd = _torchrun(_cmd(data, out, 1), "tests.regenerate.worker_entry", free_port())
    process = subprocess.Popen(
        cmd, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1", HOLD_ENV: str(held)},
    )  # fmt: skip
    with reaped(process):
        deadline = time.monotonic() + 300
        while len(list(held.glob("w*"))) < 2 and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(list(held.glob("w*"))) == 2, "the ranks did not each write a conversation"
        # A terminal's Ctrl-C reaches torchrun and the ranks; torchrun passes it on to the ranks again.
        os.killpg(process.pid, signal.SIGINT)
        output, _ = process.communicate(timeout=300)
    text = output.decode()
    for rank in (0, 1):
        assert f"[rank {rank}] dflash regenerate: stopping after this decode step" in text, text[-3000:]
        assert (held / f"exit-{rank}").read_text() == "130", text[-3000:]
    assert not out.with_name(out.name + ".parts").exists()  # merged at the stop, as on the spawned path
    partial = _messages(out)
    assert 2 <= len(partial) < 16
    expected = _messages(reference)
    assert all(expected[k] == v for k, v in partial.items())
    rerun = CliRunner().invoke(main, _cmd(data, out, 1)[3:])
    assert rerun.exit_code == 0, rerun.output
    assert f"{len(partial)} already done" in rerun.output
    assert _messages(out) == expected


@pytest.mark.timeout(600)
def test_a_failing_worker_stops_the_run_with_its_traceback(tmp_path: Path, monkeypatch: Any) -> None:
    from tests.regenerate import worker_entry

    data = write_chat_jsonl(tmp_path / "chat.jsonl", 6, turns=1, seed=3)
    # Spawned workers import their entry point by name: the test's own, which raises in the record loop.
    monkeypatch.setattr("dflash_offline.regenerate.run.worker_process", worker_entry.faulty_worker_process)
    with pytest.raises(WorkerError) as failed:
        run_regenerate(_config(tmp_path / "out.jsonl", data, 2))
    text = str(failed.value)
    assert "failed; the output is resumable" in text
    assert worker_entry.FAULT_TEXT in text
    assert "Traceback" in text
