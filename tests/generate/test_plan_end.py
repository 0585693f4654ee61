"""Generate's planner records its plan's end (``Planner.on_plan_end``, ``RunRow.plan_ended_at``) before
it hands out the last job holding a training sample, and hands out every job in the plan's order
(docs/follow.md, "The final segment"): every training sample committed after the record is in a store
sealed after it, and no job after it waits for the disk window."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

from dflash_offline.cache.window import routing_key
from dflash_offline.generate.context import RunContext
from dflash_offline.generate.feed import Planner, plan_events
from dflash_offline.generate.plan import CaptureJob
from dflash_offline.generate.run import prepare_run

from .helpers import make_chat_jsonl, tiny_config

VAL_FRACTION = 0.5  # one sample a job: the plan's last jobs include validation-only ones


class ListChannel:
    """A job channel that keeps what it is given, in order (``generate.channel.JobChannel``)."""

    def __init__(self) -> None:
        self.jobs: list[CaptureJob] = []
        self.end_markers = 0

    def try_put(self, job: CaptureJob, timeout: float) -> bool:
        self.jobs.append(job)
        return True

    def finish(self, num_consumers: int) -> None:
        self.end_markers += num_consumers

    def get(self, timeout: float) -> CaptureJob | bool | None:
        raise AssertionError("the test reads the jobs itself")

    def cancel_join(self) -> None:
        pass


def run_planner(ctx: RunContext) -> tuple[ListChannel, list[int]]:
    """Run the planner to its end; returns its channel and, per plan-end call, the jobs handed out by then."""
    channel = ListChannel()
    ended: list[int] = []
    planner = Planner(ctx, channel, threading.Event(), 2, on_plan_end=lambda: ended.append(len(channel.jobs)))
    planner.run()  # in this thread: the plan is read to its end
    assert planner.error is None
    assert planner.done
    assert channel.end_markers == 2
    return channel, ended


def test_the_plans_end_is_recorded_before_its_last_training_job(tmp_path: Path) -> None:
    data = make_chat_jsonl(tmp_path / "chat.jsonl", 24, seed=5)  # its plan ends with validation-only jobs
    config = tiny_config(
        tmp_path / "cache", data, window_limit=10**9, val_fraction=VAL_FRACTION, max_batch_size=1
    )
    ctx = prepare_run(config)
    channel, ended = run_planner(ctx)

    planned = [event.job for event in plan_events(ctx) if event.job is not None]
    assert [job.job_index for job in channel.jobs] == [job.job_index for job in planned]  # the plan's order
    training = [
        i
        for i, job in enumerate(channel.jobs)
        if any(
            routing_key(sample_id=s.sample_id, conversation_root=s.conversation_root) >= VAL_FRACTION
            for s in job.samples
        )
    ]
    assert training
    assert training[-1] < len(channel.jobs) - 1  # validation-only jobs come after the last training job
    assert ended == [training[-1]]  # once, right before the last job holding a training sample

    # A resume with every sample already in the cache: no job at all, and the plan ends at once.
    done = frozenset(s.sample_id for job in planned for s in job.samples)
    channel, ended = run_planner(dataclasses.replace(ctx, done_ids=done))
    assert channel.jobs == []
    assert ended == [0]


def test_a_job_of_validation_samples_only_never_waits_for_the_window(tmp_path: Path) -> None:
    """After the plan's end only such jobs come: they add nothing to the window, so they go even while
    the window is over its limit (here by a job larger than the limit, which goes into an empty window)."""
    from dflash_offline.generate.window_gate import JobSample, WindowGate

    data = make_chat_jsonl(tmp_path / "chat.jsonl", 2, seed=1)
    ctx = prepare_run(tiny_config(tmp_path / "cache", data, window_limit=10**9, val_fraction=VAL_FRACTION))
    gate = WindowGate(ctx.config.cache_dir, 1000, run_id="r", val_fraction=VAL_FRACTION)

    def own_key(name: str) -> float:
        return routing_key(sample_id=name, conversation_root=None)

    def job(sample_id: str, tokens: int, root: str | None = None) -> list[JobSample]:
        return [JobSample(sample_id=sample_id, conversation_root=root, num_tokens=tokens)]

    training_ids = [f"t{i}" for i in range(100) if own_key(f"t{i}") >= VAL_FRACTION]
    validation_ids = [f"v{i}" for i in range(100) if own_key(f"v{i}") < VAL_FRACTION]
    assert gate.admit(job(training_ids[0], 10**6), threading.Event())  # larger than the limit: goes alone
    assert gate.read().total > 1000
    refuse_waiting = threading.Event()
    refuse_waiting.set()  # a job that would wait is refused at once
    assert not gate.admit(job(training_ids[1], 10), refuse_waiting)  # a training job waits
    assert gate.admit(job(validation_ids[0], 10), refuse_waiting)  # a validation-only job does not
    # A sample is counted by its conversation, not its own id: a sample of a training conversation waits
    # whatever its id's key, one of a validation conversation does not.
    assert not gate.admit(job(validation_ids[1], 10, root=training_ids[2]), refuse_waiting)
    assert gate.admit(job(training_ids[3], 10, root=validation_ids[2]), refuse_waiting)
