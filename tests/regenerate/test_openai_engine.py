"""``dflash regenerate --engine openai`` against a real HTTP server process (``openai_server.py``, the tiny
random target behind the OpenAI protocol): the greedy answers equal the built-in decode engine's while
429s, 500s and timeouts are injected, a request that keeps failing is a failure row and the run goes on,
a server killed mid-run stops the run and a rerun against a live server finishes it with every
conversation once, a stop keeps the answered turns of the conversations in progress and the rerun continues
them at their next turn, a server that takes only text gets the templated text, and a wrong URL, model, key
or tokenizer is a one-line error before anything is written."""

from __future__ import annotations

import gc
import json
import re
import subprocess
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from dflash_offline.cli import main
from dflash_offline.regenerate import run as run_module
from dflash_offline.regenerate.config import RegenerateConfig
from dflash_offline.regenerate.openai_engine import OpenAIEngine, ServerError, server_target
from dflash_offline.regenerate.run import RegenerateStopped, run_regenerate
from dflash_offline.target_model.loader import load_target, stop_token_ids
from tests.eval.helpers import one_thread, write_chat_jsonl
from tests.process_helpers import reaped
from tests.regenerate.openai_server_process import Server, ready, start_server
from tests.regenerate.turns import answered_before_stop, turn_keys

REPO = Path(__file__).resolve().parents[2]
COMMON: dict[str, Any] = {
    "target": "random:tiny",
    "max_new_tokens": 8,
    "progress": False,
    "max_prompt_tokens": 512,
}


@pytest.fixture(scope="module")
def starting() -> Iterator[list[subprocess.Popen[str]]]:
    """A healthy server and one that the kill test kills, loading while the reference is computed."""
    processes = [start_server(), start_server()]
    with reaped(processes[0]), reaped(processes[1]):
        yield processes


@pytest.fixture(scope="module")
def servers(starting: list[subprocess.Popen[str]], reference: dict[str, Any]) -> tuple[Server, Server]:
    healthy, victim = (ready(p) for p in starting)
    return healthy, victim


@pytest.fixture
def server(servers: tuple[Server, Server]) -> Iterator[Server]:
    healthy = servers[0]
    healthy.faults()
    yield healthy
    healthy.faults()


@pytest.fixture(autouse=True)
def _single_thread() -> Iterator[None]:
    with one_thread():
        yield


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_chat_jsonl(tmp_path_factory.mktemp("chat") / "chat.jsonl", 8, turns=2, seed=5)


@pytest.fixture(scope="module")
def reference(
    data: Path, tmp_path_factory: pytest.TempPathFactory, starting: list[subprocess.Popen[str]]
) -> dict[str, Any]:
    """The built-in decode engine's conversations (the server's greedy answers must be the same)."""
    out = tmp_path_factory.mktemp("slots") / "slots.jsonl"
    with one_thread():
        summary = run_regenerate(RegenerateConfig(out=out, data=str(data), batch_size=4, **COMMON))
    assert summary is not None
    assert summary.written == 8
    return _conversations(out)


def _conversations(path: Path) -> dict[str, Any]:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    ids = [line["source_sample_id"] for line in lines]
    assert len(ids) == len(set(ids)), "a conversation written twice"
    return {line["source_sample_id"]: line["messages"] for line in lines}


def _config(out: Path, data: Path, url: str, **kw: Any) -> RegenerateConfig:
    values: dict[str, Any] = {
        "engine": "openai", "base_url": url, "concurrency": 4, "request_timeout": 2.0,
        "max_retries": 3, "retry_backoff": 0.01, **COMMON,
    }  # fmt: skip
    values.update(kw)
    return RegenerateConfig(out=out, data=str(data), **values)


def test_answers_equal_the_decode_engines_through_injected_faults(
    tmp_path: Path, data: Path, reference: dict[str, Any], server: Server
) -> None:
    """Transient 429/500/timeouts are retried; a prompt the server always fails on is one failure row with
    its reason, and every other conversation is written once with the decode engine's greedy answers."""
    doomed = next(sid for sid, messages in reference.items() if "fox" in messages[-2]["content"])
    server.faults(status_at={"2": 429, "5": 500, "9": 503}, timeout_at=[7], sleep=3.0, reject_marker="fox")
    out = tmp_path / "served.jsonl"
    summary = run_regenerate(_config(out, data, server.url))
    assert summary is not None
    assert summary.engine == "openai"
    got = _conversations(out)
    failed = [json.loads(line) for line in (tmp_path / "served.failures.jsonl").read_text().splitlines()]
    failed_ids = {f["source_sample_id"] for f in failed}
    assert doomed in failed_ids
    assert all(f["reason"] == "server_error" and "4 attempts" in f["detail"] for f in failed)
    assert set(got) | failed_ids == set(reference)
    assert not set(got) & failed_ids
    assert (summary.written, summary.failed) == (len(got), len(failed_ids))
    assert got == {sid: reference[sid] for sid in got}
    line = json.loads(out.read_text().splitlines()[0])
    assert line["regenerated_by"]["served_model"] == "tiny"
    assert line["regenerated_by"]["prompt_form"] == "token_ids"


def test_a_server_killed_mid_run_stops_it_and_a_rerun_finishes_it(
    tmp_path: Path, data: Path, reference: dict[str, Any], servers: tuple[Server, Server]
) -> None:
    healthy, victim = servers
    healthy.faults()
    victim.faults(die_after=6)  # SIGKILL on the 6th completion request, with others in flight
    out = tmp_path / "served.jsonl"
    with pytest.raises(ServerError, match=r"stopped answering.*rerun"):
        run_regenerate(_config(out, data, victim.url))
    assert victim.process.wait(timeout=30) != 0
    partial = _conversations(out) if out.exists() else {}
    assert len(partial) < len(reference)
    summary = run_regenerate(_config(out, data, healthy.url))  # the restarted server
    assert summary is not None
    assert (summary.skipped, summary.written, summary.failed) == (
        len(partial),
        len(reference) - len(partial),
        0,
    )
    assert _conversations(out) == reference  # every conversation once, the greedy answers


def test_a_stop_keeps_the_conversations_in_progress_and_the_rerun_continues_them(
    tmp_path: Path, data: Path, reference: dict[str, Any], server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver is the built-in engine's: stopped after 5 answers, the answered turns of the conversations
    in progress are kept with the server's text and ids, and the rerun sends only the turns not answered."""
    submitted: list[str] = []
    answers = [0]
    stop_after = [5]
    submit, poll = OpenAIEngine.submit, OpenAIEngine.poll

    def logged_submit(engine: OpenAIEngine, key: str, prompt: Any, **hints: Any) -> None:
        submitted.append(key)
        submit(engine, key, prompt, **hints)

    def counted_poll(engine: OpenAIEngine, timeout: float) -> Any:
        finished = poll(engine, timeout)
        answers[0] += len(finished)
        return finished

    monkeypatch.setattr(OpenAIEngine, "submit", logged_submit)
    monkeypatch.setattr(OpenAIEngine, "poll", counted_poll)
    monkeypatch.setattr(run_module, "stop_requested", lambda: answers[0] >= stop_after[0])
    out = tmp_path / "served.jsonl"
    partial = tmp_path / "served.jsonl.partial"
    with pytest.raises(RegenerateStopped) as stopped:
        run_regenerate(_config(out, data, server.url))
    written = _conversations(out) if out.exists() else {}
    answered = answered_before_stop(submitted, set(written))
    kept = [json.loads(line) for line in partial.read_text().splitlines()]
    assert {k["source_sample_id"]: len(k["answers"]) for k in kept} == {
        sid: n for sid, n in answered.items() if n and sid not in written
    }
    assert len(kept) == stopped.value.summary.kept >= 1
    for k in kept:  # the server's text and token ids, as the decode engine's
        want = [m for m in reference[k["source_sample_id"]] if m["role"] == "assistant"]
        got = [
            {"role": "assistant", "content": a["content"], "token_ids": a["token_ids"]} for a in k["answers"]
        ]
        assert got == want[: len(got)]

    stop_after[0] = 10**9
    submitted.clear()
    summary = run_regenerate(_config(out, data, server.url))
    assert summary is not None
    assert summary.resumed == len(kept)
    every_turn = {f"{sid}#{t}" for sid in reference for t in range(2)}  # the data's 2 turns each
    assert len(submitted) == len(set(submitted))
    assert set(submitted) == every_turn - turn_keys(answered)  # not one turn answered twice
    assert _conversations(out) == reference
    assert not partial.exists()


def test_a_server_that_takes_only_text_gets_the_templated_text(
    tmp_path: Path, data: Path, reference: dict[str, Any], server: Server
) -> None:
    server.faults(text_only=True)
    out = tmp_path / "served.jsonl"
    summary = run_regenerate(_config(out, data, server.url, limit=4, model="tiny"))
    assert summary is not None
    assert (summary.written, summary.failed) == (4, 0)
    got = _conversations(out)
    # The same text; no token ids, since our tokenizer's reading of a text answer is not the target's ids.
    texts = {sid: [{"role": m["role"], "content": m["content"]} for m in reference[sid]] for sid in got}
    assert got == texts
    assert json.loads(out.read_text().splitlines()[0])["regenerated_by"]["prompt_form"] == "text"


def test_a_wrong_url_model_key_or_tokenizer_is_one_line_before_anything_is_written(
    tmp_path: Path, data: Path, server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "new" / "served.jsonl"
    closed = "http://127.0.0.1:9"  # the discard port: nothing listens there
    cases = [
        (["--base-url", closed], "no OpenAI-compatible server answers"),
        (["--base-url", server.url + "/v1", "--model", "llama-70b"], "--model 'llama-70b' is not served"),
        (
            ["--base-url", server.url, "--api-key-env", "DFLASH_TEST_NO_KEY"],
            r"\$DFLASH_TEST_NO_KEY is not set",
        ),
    ]
    monkeypatch.delenv("DFLASH_TEST_NO_KEY", raising=False)
    runner = CliRunner()
    for flags, message in cases:
        result = runner.invoke(
            main,
            ["regenerate", "--engine", "openai", *flags, "--target", "random:tiny", "--data", str(data),
             "--out", str(out), "--no-progress"],
        )  # fmt: skip
        assert result.exit_code == 1, result.output
        assert len(result.output.strip().splitlines()) == 1, result.output
        assert re.search(message, result.output), result.output
        assert not out.parent.exists()
    server.faults(text_only=True, add_bos=True)  # the server reads the text as one token more
    with pytest.raises(ServerError, match="read the probe prompt \\(text\\) as"):
        run_regenerate(_config(out, data, server.url))
    assert not out.parent.exists()


def test_the_probe_and_every_request_thread_close_their_connections(
    tmp_path: Path, data: Path, server: Server
) -> None:
    """No connection is left for the garbage collector to close (with a ResourceWarning): neither the
    probe's nor those of the request threads, once the run has ended."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        summary = run_regenerate(_config(tmp_path / "served.jsonl", data, server.url, limit=4))
        for thread in threading.enumerate():
            if thread.name.startswith("openai-"):
                thread.join(timeout=60)  # the engine's close told it to stop
        gc.collect()
    assert summary is not None
    assert (summary.written, summary.failed) == (4, 0)
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []


def test_server_target_stop_ids_are_those_of_the_loaded_model() -> None:
    """No weights are loaded for --engine openai; the end-of-turn ids must still be the loaded model's."""
    loaded = load_target("random:tiny", device="cpu")
    assert server_target("random:tiny").stop_ids == stop_token_ids(loaded.tokenizer, loaded.model)


def test_the_retry_wait_doubles_and_honours_retry_after() -> None:
    from dflash_offline.regenerate.http_client import RetryPolicy

    policy = RetryPolicy(timeout_seconds=1.0, max_retries=10, backoff_seconds=0.5)
    assert [policy.wait_before(k, None) for k in (1, 2, 3)] == [0.5, 1.0, 2.0]
    assert policy.wait_before(20, None) == 60.0
    assert policy.wait_before(1, 7.0) == 7.0


def _answer(**choice: Any) -> dict[str, Any]:
    usage = choice.pop("usage", {"prompt_tokens": 3, "completion_tokens": 3})
    return {
        "choices": [{"text": "abc", "finish_reason": "stop", "token_ids": [7, 8, 2], **choice}],
        "usage": usage,
    }


@pytest.mark.parametrize(
    ("answer", "fault"),
    [
        ([], "the answer is [], not a JSON object"),
        ({"choices": [], "usage": {}}, "choices is [], not a list of objects"),
        (_answer(finish_reason="abort"), "choices[0].finish_reason 'abort'"),
        (_answer(usage=None), "usage is None, not an object"),
        (_answer(usage={"prompt_tokens": "3"}), "usage.prompt_tokens is '3', not an integer"),
        (_answer(usage={"prompt_tokens": 4}), "the server read the prompt as 4 tokens, ours has 3"),
        (
            _answer(token_ids=[7, 2, 8, 2]),
            "choices[0].token_ids[1] is the stop token 2 before the answer's end",
        ),
        (_answer(token_ids=[7, False]), "choices[0].token_ids[1] is False, not an integer"),
        (
            _answer(token_ids=[7, 100]),
            "choices[0].token_ids[1] is 100, not a token id of the target (0 to 99)",
        ),
        (_answer(token_ids=list(range(3, 8))), "has 5 ids, more than the request's max_tokens 4"),
    ],
)
def test_every_value_of_an_answer_is_checked_against_the_request(answer: Any, fault: str) -> None:
    from dflash_offline.regenerate.served_answer import AnswerFault, AnswerRequest, parse_served_answer

    request = AnswerRequest(prompt_tokens=3, max_tokens=4, vocab_size=100, stop_ids=frozenset({2}))
    checked = parse_served_answer(answer, request)
    assert isinstance(checked, AnswerFault), checked
    assert fault in checked.detail


def test_a_good_answer_keeps_its_ids_less_the_final_stop_token() -> None:
    from dflash_offline.regenerate.served_answer import AnswerRequest, ServedAnswer, parse_served_answer

    request = AnswerRequest(prompt_tokens=3, max_tokens=4, vocab_size=100, stop_ids=frozenset({2}))
    assert parse_served_answer(_answer(), request) == ServedAnswer(
        text="abc", finish_reason="stop", token_ids=(7, 8), completion_tokens=3
    )
