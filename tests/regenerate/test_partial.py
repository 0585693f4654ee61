"""A stop keeps the answered turns of the conversations in progress (``<out>.partial``) and the rerun
continues each at its next turn: the partial file holds exactly the turns answered before the stop, the
rerun submits only the turns not answered before, and the final output equals an uninterrupted run's; in
one process and with two spawned workers, after a torn last line in the partial file, and after a SIGKILL
of the rerun."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dflash_offline.errors import ConfigError
from dflash_offline.placement import Placement
from dflash_offline.regenerate import run as run_module
from dflash_offline.regenerate.config import RegenerateConfig
from dflash_offline.regenerate.run import RegenerateStopped, run_regenerate
from dflash_offline.regenerate.slot_engine import SlotEngine
from tests.eval.helpers import one_thread, write_chat_jsonl
from tests.process_helpers import reaped
from tests.regenerate.turns import answered_before_stop, sample_id, turn_keys

NUM_RECORDS, TURNS = 10, 3


@pytest.fixture(autouse=True)
def _single_thread() -> Iterator[None]:
    with one_thread():
        yield


def _config(out: Path, data: Path, **kw: Any) -> RegenerateConfig:
    values: dict[str, Any] = {
        "target": "random:tiny", "max_new_tokens": 8, "batch_size": 2, "progress": False,
        "placement": Placement(threads_per_worker=1),
    }  # fmt: skip
    values.update(kw)
    return RegenerateConfig(out=out, data=str(data), **values)


def _lines(path: Path) -> dict[str, dict[str, Any]]:
    """The lines of an output by sample id (each once; none when there is no file)."""
    text = path.read_text() if path.exists() else ""
    lines = [json.loads(line) for line in text.splitlines() if line.strip()]
    by_id = {line["source_sample_id"]: line for line in lines}
    assert len(by_id) == len(lines), "a conversation was written twice"
    return by_id


def _assistant(line: dict[str, Any]) -> list[dict[str, Any]]:
    """An output line's answers as the partial file writes them."""
    return [
        {"content": m["content"], "token_ids": m["token_ids"], "finish_reason": reason}
        for m, reason in zip(
            (m for m in line["messages"] if m["role"] == "assistant"), line["finish_reasons"], strict=True
        )
    ]


def _kept(path: Path) -> dict[str, list[dict[str, Any]]]:
    """The partial file's answers by sample id (finish reason, text and ids of each)."""
    kept: dict[str, list[dict[str, Any]]] = {}
    for raw in path.read_text().splitlines():
        line = json.loads(raw)
        assert line["source_sample_id"] not in kept, "a conversation kept twice"
        kept[line["source_sample_id"]] = [
            {"content": a["content"], "token_ids": a["token_ids"], "finish_reason": a["finish_reason"]}
            for a in line["answers"]
        ]
    return kept


class Submits:
    """Every turn handed to a ``SlotEngine`` (``<sample id>#<turn>``) and the answers it returned; with
    ``stop_after`` = k, ``should_stop`` turns true once k answers have come back."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, stop_after: int | None = None) -> None:
        self.keys: list[str] = []
        self.answered = 0
        self.stop_after = stop_after
        submit, poll = SlotEngine.submit, SlotEngine.poll

        def logged_submit(engine: SlotEngine, key: str, prompt: Any, **hints: Any) -> None:
            self.keys.append(key)
            submit(engine, key, prompt, **hints)

        def counted_poll(engine: SlotEngine, timeout: float) -> Any:
            finished = poll(engine, timeout)
            self.answered += len(finished)
            return finished

        monkeypatch.setattr(SlotEngine, "submit", logged_submit)
        monkeypatch.setattr(SlotEngine, "poll", counted_poll)
        # The in-process run asks this instead of the Ctrl-C flag.
        monkeypatch.setattr(run_module, "stop_requested", self.should_stop)

    def should_stop(self) -> bool:
        return self.stop_after is not None and self.answered >= self.stop_after

    def take(self) -> list[str]:
        keys, self.keys = self.keys, []
        return keys


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], set[str]]:
    """Multi-turn chat data, an uninterrupted run's output by sample id, and every turn it submitted."""
    tmp_path = tmp_path_factory.mktemp("reference")
    data = write_chat_jsonl(tmp_path / "chat.jsonl", NUM_RECORDS, turns=TURNS, seed=11)
    with pytest.MonkeyPatch.context() as m, one_thread():
        submits = Submits(m)
        summary = run_regenerate(_config(tmp_path / "reference.jsonl", data))
    assert summary is not None
    assert summary.written == NUM_RECORDS
    keys = submits.take()
    assert len(keys) == len(set(keys)) == NUM_RECORDS * TURNS
    return data, _lines(tmp_path / "reference.jsonl"), set(keys)


def _stop_then_check_kept(
    out: Path, data: Path, expected: dict[str, Any], submits: Submits, **kw: Any
) -> dict[str, int]:
    """A run stopped after ``submits.stop_after`` answers: its output holds only complete conversations, its
    partial file exactly the answered turns of the ones in progress; returns the turns answered per
    conversation."""
    with pytest.raises(RegenerateStopped) as stopped:
        run_regenerate(_config(out, data, **kw))
    written = _lines(out)
    assert 0 < len(written) < NUM_RECORDS
    assert all(expected[sid] == line for sid, line in written.items())
    answered = answered_before_stop(submits.take(), set(written))
    in_progress = {sid: n for sid, n in answered.items() if sid not in written and n > 0}
    assert len(in_progress) >= 2, "stop later: too few conversations were in progress"
    kept = _kept(out.with_name(out.name + ".partial"))
    assert {sid: len(a) for sid, a in kept.items()} == in_progress
    assert all(answers == _assistant(expected[sid])[: len(answers)] for sid, answers in kept.items())
    summary = stopped.value.summary
    assert (summary.kept, summary.kept_answers) == (len(in_progress), sum(in_progress.values()))
    return answered


def test_a_stop_keeps_the_answered_turns_and_the_rerun_continues_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reference: tuple[Path, dict[str, Any], set[str]]
) -> None:
    data, expected, all_turns = reference
    out = tmp_path / "out.jsonl"
    submits = Submits(monkeypatch, stop_after=9)
    answered = _stop_then_check_kept(out, data, expected, submits)
    before = out.read_bytes()
    kept = _kept(out.with_name(out.name + ".partial"))

    submits.stop_after = None
    summary = run_regenerate(_config(out, data))
    assert summary is not None
    rerun = submits.take()
    assert len(rerun) == len(set(rerun))
    assert set(rerun) == all_turns - turn_keys(answered)  # not one turn answered twice
    assert (summary.resumed, summary.resumed_answers) == (len(kept), sum(map(len, kept.values())))
    assert _lines(out) == expected
    assert out.read_bytes().startswith(before)
    assert not out.with_name(out.name + ".partial").exists()  # every kept conversation is written now
    again = run_regenerate(_config(out, data))
    assert again is not None
    assert (again.written, again.skipped, again.resumed, submits.take()) == (0, NUM_RECORDS, 0, [])


def test_a_torn_last_line_of_the_partial_file_is_answered_again_from_its_first_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reference: tuple[Path, dict[str, Any], set[str]]
) -> None:
    data, expected, all_turns = reference
    out = tmp_path / "out.jsonl"
    submits = Submits(monkeypatch, stop_after=9)
    answered = _stop_then_check_kept(out, data, expected, submits)
    partial = out.with_name(out.name + ".partial")
    lines = partial.read_text().splitlines(keepends=True)
    torn = json.loads(lines[-1])["source_sample_id"]
    partial.write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])  # a kill mid-write

    submits.stop_after = None
    summary = run_regenerate(_config(out, data))
    assert summary is not None
    assert set(submits.take()) == all_turns - turn_keys({**answered, torn: 0})
    assert summary.resumed == len(lines) - 1
    assert _lines(out) == expected
    assert not partial.exists()


def test_the_partial_file_is_checked_before_a_resume_with_other_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 4, turns=TURNS, seed=12)
    out = tmp_path / "out.jsonl"
    submits = Submits(
        monkeypatch, stop_after=3
    )  # before any conversation is complete: the partial file alone
    with pytest.raises(RegenerateStopped):
        run_regenerate(_config(out, data))
    partial = out.with_name(out.name + ".partial")
    assert partial.exists()
    assert not out.exists() or not out.read_text()
    submits.stop_after = None
    with pytest.raises(
        ConfigError,
        match=rf"`RegenerateConfig\.max_new_tokens` 9 differs .* 8 that wrote {re.escape(str(partial))}",
    ):
        run_regenerate(_config(out, data, max_new_tokens=9))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_spawned_workers_keep_their_conversations_in_progress_and_the_rerun_continues_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reference: tuple[Path, dict[str, Any], set[str]]
) -> None:
    from tests.regenerate import worker_entry

    data, expected, all_turns = reference
    logs = tmp_path / "logs"
    logs.mkdir()
    # Spawned workers import their entry point by name: the test's own, which logs every turn it submits
    # and holds after its 6th answer until the run is stopped.
    monkeypatch.setattr(run_module, "worker_process", worker_entry.recording_worker_process)
    monkeypatch.setenv(worker_entry.SUBMITS_ENV, str(logs))
    monkeypatch.setenv(worker_entry.HOLD_AFTER_ENV, "6")
    out = tmp_path / "out.jsonl"
    config = _config(out, data, placement=Placement(num_cpu_workers=2, threads_per_worker=1))
    ended = threading.Event()
    both_held = lambda: len(list(logs.glob("answered-w*"))) == 2  # noqa: E731
    ctrl_c = threading.Thread(target=_ctrl_c_when, args=(both_held, ended))
    ctrl_c.start()
    try:
        with pytest.raises(RegenerateStopped) as stopped:
            run_regenerate(config)
    finally:
        ended.set()
        ctrl_c.join()
    assert not out.with_name(out.name + ".parts").exists()  # merged at the stop
    written = _lines(out)
    assert all(expected[sid] == line for sid, line in written.items())
    answered = answered_before_stop(_take_logs(logs), set(written))
    in_progress = {sid: n for sid, n in answered.items() if sid not in written and n > 0}
    kept = _kept(out.with_name(out.name + ".partial"))
    assert {sid: len(a) for sid, a in kept.items()} == in_progress
    assert len(in_progress) >= 2
    assert all(answers == _assistant(expected[sid])[: len(answers)] for sid, answers in kept.items())
    assert stopped.value.summary.kept == len(in_progress)

    monkeypatch.delenv(worker_entry.HOLD_AFTER_ENV)
    summary = run_regenerate(config)
    assert summary is not None
    assert summary.resumed == len(in_progress)
    rerun = _take_logs(logs)
    assert len(rerun) == len(set(rerun))
    assert set(rerun) == all_turns - turn_keys(answered)
    assert _lines(out) == expected
    assert not out.with_name(out.name + ".partial").exists()


def _ctrl_c_when(ready: Callable[[], bool], ended: threading.Event) -> None:
    """Send this process the first Ctrl-C once ``ready`` (the run's coordinator then stops its workers),
    unless the run ``ended`` first."""
    while not ready():
        if ended.wait(0.05):
            return
    os.kill(os.getpid(), signal.SIGINT)


def _take_logs(logs: Path) -> list[str]:
    keys: list[str] = []
    for log in sorted(logs.glob("submits-w*")):
        keys += log.read_text().split()
        log.unlink()
    for mark in logs.glob("answered-w*"):
        mark.unlink()
    return keys


@pytest.mark.timeout(900)
def test_a_rerun_killed_after_continuing_a_kept_conversation_then_a_rerun_completes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reference: tuple[Path, dict[str, Any], set[str]]
) -> None:
    """Stopped (conversations kept), rerun and SIGKILLed once it has written a kept conversation (which the
    partial file still holds), rerun again: every conversation once, as in the uninterrupted run, no kept
    turn answered again, the written one not continued again."""
    from tests.regenerate.worker_entry import HOLD_ENV

    data, expected, all_turns = reference
    out = tmp_path / "out.jsonl"
    submits = Submits(monkeypatch, stop_after=9)
    answered = _stop_then_check_kept(out, data, expected, submits)
    partial = out.with_name(out.name + ".partial")
    kept = set(_kept(partial))
    written_before = set(_lines(out))

    held = tmp_path / "held"
    held.mkdir()
    cmd = [sys.executable, "-m", "tests.regenerate.worker_entry", "regenerate", "--target", "random:tiny",
           "--data", str(data), "--max-new-tokens", "8", "--batch-size", "2", "--threads", "1",
           "--no-progress", "--out", str(out)]  # fmt: skip
    # Held after its first written conversation (worker_entry.py), then killed.
    env = {**os.environ, "OMP_NUM_THREADS": "1", HOLD_ENV: str(held)}
    with reaped(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)) as process:
        deadline = time.monotonic() + 300
        while not (held / "w0").exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (held / "w0").exists(), process.communicate()[0].decode()[-3000:]
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=60)
    newly = set(_lines(out)) - written_before
    assert len(newly) == 1
    assert newly <= kept <= set(_kept(partial))  # written, and still in the partial file

    submits.stop_after = None
    submits.take()
    summary = run_regenerate(_config(out, data))
    assert summary is not None
    rerun = set(submits.take())
    assert not rerun & turn_keys(answered)  # no kept turn answered again
    assert not {sample_id(key) for key in rerun} & newly  # the written one is skipped
    # The rest: the turns that the killed run answered for the other conversations were lost with it.
    newly_turns = {key for key in all_turns if sample_id(key) in newly}
    assert rerun | turn_keys(answered) | newly_turns == all_turns
    assert _lines(out) == expected
    assert not partial.exists()
