"""The generate planner: buckets, padded-token budgets, determinism, resume filtering."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_offline.data.conversations import Conversation, Message, SourceFailure, TokenizedSample
from dflash_offline.errors import ConfigError
from dflash_offline.generate.plan import (
    PlanConfig,
    PlannedSample,
    bucket_of,
    pack_bucket,
    parse_bucket_edges,
    plan_jobs,
)


def _conv(i: int, length: int) -> Conversation:
    return Conversation(
        sample_id=f"s{i:04d}",
        source_index=i,
        record_id=str(i),
        messages=(Message(role="user", content="x" * length), Message(role="assistant", content="y")),
    )


def _tokenize(conv: Conversation) -> TokenizedSample | SourceFailure:
    length = len(conv.messages[0].content)
    if length == 0:
        return SourceFailure(
            sample_id=conv.sample_id, source_index=conv.source_index, reason="empty_response", detail=""
        )
    return TokenizedSample(
        sample_id=conv.sample_id,
        source_index=conv.source_index,
        input_ids_T=np.arange(length, dtype=np.int32),
        loss_mask_T=np.ones(length, dtype=np.uint8),
        truncated=False,
    )


def _records(lengths: list[int]) -> list[Conversation | SourceFailure]:
    return [_conv(i, n) for i, n in enumerate(lengths)]


CONFIG = PlanConfig(
    bucket_edges=(8, 16, 32, 64), tokens_per_batch=64, max_batch_size=6, window_records=50, seed=3
)


def test_bucket_of_is_first_edge_at_least_length() -> None:
    edges = (8, 16, 32)
    assert [bucket_of(n, edges) for n in (1, 8, 9, 16, 17, 32, 33, 1000)] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_parse_bucket_edges_rejects_bad_input() -> None:
    assert parse_bucket_edges("256, 512,1024") == (256, 512, 1024)
    for bad in ("", "a,b", "512,256", "0,8", "8,8"):
        with pytest.raises(ConfigError):
            parse_bucket_edges(bad)


def test_pack_bucket_respects_padded_budget_and_batch_size() -> None:
    rng = np.random.default_rng(0)
    samples = [
        PlannedSample(sample=_tokenize(_conv(i, int(n))), bucket_id=0)  # type: ignore[arg-type]
        for i, n in enumerate(rng.integers(1, 30, size=200))
    ]
    batches = pack_bucket(samples, tokens_per_batch=64, max_batch_size=5)
    assert sorted(p.sample.sample_id for b in batches for p in b) == sorted(
        p.sample.sample_id for p in samples
    )
    for batch in batches:
        longest = max(p.sample.num_tokens for p in batch)
        assert len(batch) <= 5
        assert len(batch) * longest <= 64 or len(batch) == 1


def test_plan_covers_every_record_once_and_is_deterministic() -> None:
    rng = np.random.default_rng(1)
    lengths = [int(n) for n in rng.integers(0, 70, size=180)]  # some empty -> failures, some > 64
    events = list(plan_jobs(_records(lengths), _tokenize, CONFIG))
    again = list(plan_jobs(_records(lengths), _tokenize, CONFIG))
    jobs = [e.job for e in events if e.job is not None]
    assert [j.job_index for j in jobs] == list(range(len(jobs)))
    assert [tuple(s.sample_id for s in j.samples) for j in jobs] == [
        tuple(s.sample_id for s in e.job.samples) for e in again if e.job is not None
    ]
    planned = [s.sample_id for j in jobs for s in j.samples]
    failed = [f.sample_id for e in events for f in e.failures]
    assert len(planned) == len(set(planned))
    assert sorted(planned + failed) == sorted(f"s{i:04d}" for i in range(len(lengths)))
    assert sorted(failed) == sorted(f"s{i:04d}" for i, n in enumerate(lengths) if n == 0)
    assert sum(e.records_read for e in events) == len(lengths)
    for job in jobs:
        assert {bucket_of(s.num_tokens, CONFIG.bucket_edges) for s in job.samples} == {job.bucket_id}
        assert job.padded_length == max(s.num_tokens for s in job.samples)
    # Several buckets, and the shuffle mixes them inside a window.
    assert len({j.bucket_id for j in jobs}) >= 4
    assert [j.bucket_id for j in jobs] != sorted(j.bucket_id for j in jobs)


def _ids(job: object) -> tuple[str, ...]:
    return tuple(s.sample_id for s in job.samples)  # type: ignore[attr-defined]


def test_resume_skips_whole_done_jobs_and_marks_partly_done_ones() -> None:
    lengths = [5 + (i * 7) % 50 for i in range(120)]
    full = [e.job for e in plan_jobs(_records(lengths), _tokenize, CONFIG) if e.job is not None]
    multi = [j for j in full if len(j.samples) > 1]
    done_job, partly = multi[0], multi[1]
    done = {s.sample_id for s in done_job.samples} | {partly.samples[0].sample_id}
    resumed = [
        e.job for e in plan_jobs(_records(lengths), _tokenize, CONFIG, is_done=done.__contains__) if e.job
    ]
    by_index = {j.job_index: j for j in resumed}
    assert done_job.job_index not in by_index  # nothing new: not handed out at all
    again = by_index[partly.job_index]
    assert again.samples is not partly.samples
    assert _ids(again) == _ids(partly)  # same batch composition: same bytes as the first run
    assert again.already_done == (True,) + (False,) * (len(partly.samples) - 1)
    # Every other job is identical, with the same index.
    for job in full:
        if job.job_index != done_job.job_index:
            assert _ids(by_index[job.job_index]) == _ids(job)


def test_duplicate_records_fail_as_duplicates() -> None:
    records: list[Conversation | SourceFailure] = [_conv(0, 5), _conv(1, 6), _conv(0, 5)]
    events = list(plan_jobs(records, _tokenize, CONFIG))
    failures = [f for e in events for f in e.failures]
    assert [f.reason for f in failures] == ["duplicate_record"]
    assert sum(len(e.job.samples) for e in events if e.job) == 2


def _event_key(event: object) -> tuple[object, ...]:
    """What a plan event says, as comparable values (the samples' arrays by their ids and lengths)."""
    job = event.job  # type: ignore[attr-defined]
    return (
        tuple((f.sample_id, f.reason) for f in event.failures),  # type: ignore[attr-defined]
        event.records_read,  # type: ignore[attr-defined]
        event.samples_already_done,  # type: ignore[attr-defined]
        None
        if job is None
        else (job.job_index, job.window, job.bucket_id, _ids(job), job.already_done, job.padded_length),
    )


def test_read_ahead_plans_the_same_events_in_the_same_order() -> None:
    rng = np.random.default_rng(4)
    lengths = [int(n) for n in rng.integers(0, 70, size=230)]  # five windows, failures among them
    records = [*_records(lengths), _conv(3, lengths[3])]  # and a repeated record
    done = {f"s{i:04d}" for i in range(0, 230, 3)}
    for is_done in (lambda _s: False, done.__contains__):
        plain = [_event_key(e) for e in plan_jobs(records, _tokenize, CONFIG, is_done=is_done)]
        ahead = [
            _event_key(e) for e in plan_jobs(records, _tokenize, CONFIG, is_done=is_done, read_ahead=True)
        ]
        assert ahead == plain
        assert sum(1 for key in plain if key[1]) == 5  # one event a window says how many records it read


def test_read_ahead_tokenizes_the_next_window_while_this_ones_jobs_are_handed_out() -> None:
    """The point of it: with the first window's first job in hand (and no more taken), the records of the
    second window get tokenized; without read-ahead they are not until the first window's jobs are out."""
    import threading

    second_window = threading.Event()

    def tokenize(conv: Conversation) -> TokenizedSample | SourceFailure:
        if conv.source_index >= CONFIG.window_records:
            second_window.set()
        return _tokenize(conv)

    lengths = [5 + (i * 7) % 50 for i in range(2 * CONFIG.window_records)]
    for read_ahead in (False, True):
        second_window.clear()
        events = plan_jobs(_records(lengths), tokenize, CONFIG, read_ahead=read_ahead)
        first_job = next(e.job for e in events if e.job is not None)
        assert first_job.window == 0
        assert second_window.wait(timeout=0.5 if not read_ahead else 30) is read_ahead
        events.close()


def test_read_ahead_raises_the_readers_error_in_order_and_stops_its_thread_when_closed() -> None:
    import threading

    def broken(conv: Conversation) -> TokenizedSample | SourceFailure:
        if conv.source_index == CONFIG.window_records + 7:
            raise ValueError("record 57 cannot be tokenized")
        return _tokenize(conv)

    lengths = [5 + (i * 7) % 50 for i in range(3 * CONFIG.window_records)]
    seen_windows: list[int] = []

    def consume() -> None:
        for event in plan_jobs(_records(lengths), broken, CONFIG, read_ahead=True):
            if event.job is not None:
                seen_windows.append(event.job.window)

    with pytest.raises(ValueError, match="record 57"):
        consume()
    assert seen_windows
    assert set(seen_windows) == {0}  # the first window's jobs came out before the error
    assert not [t for t in threading.enumerate() if t.name == "plan-read-ahead"]

    read: list[int] = []

    def records() -> object:
        for record in _records(lengths * 100):
            read.append(record.source_index)  # type: ignore[union-attr]
            yield record

    events = plan_jobs(records(), _tokenize, CONFIG, read_ahead=True)  # type: ignore[arg-type]
    next(e for e in events if e.job is not None)
    events.close()  # the consumer stops: so does the thread, long before the records run out
    assert not [t for t in threading.enumerate() if t.name == "plan-read-ahead"]
    assert len(read) <= 3 * CONFIG.window_records + 1
