"""The planner thread of the coordinator: the run's deterministic job stream into the job channel.

Its failures (records that never reached a target) become manifest parts of its own; it counts what
the cache already held (the resume's ``skipped_already_done``) and stops on request."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from dflash_offline.cache.layout import create_or_open_cache
from dflash_offline.cache.manifest import records_to_table, write_part
from dflash_offline.cache.rows import FailureRow, utc_now
from dflash_offline.cache.window import routes_to_validation
from dflash_offline.config_fields import field_ref
from dflash_offline.data.conversations import SourceFailure
from dflash_offline.generate.channel import JobChannel
from dflash_offline.generate.config import GenerateConfig
from dflash_offline.generate.context import RunContext
from dflash_offline.generate.plan import CaptureJob, PlanConfig, PlanEvent, plan_jobs
from dflash_offline.generate.window_gate import JobSample, WindowGate

PLANNER_WORKER_ID = -1
"""``worker`` value of failure rows written by the planner (records that never reached a target)."""


def plan_events(ctx: RunContext) -> Iterator[PlanEvent]:
    """The deterministic job stream of this run (resume only filters it)."""
    from dflash_offline.data.decontaminate import decontaminator_for, screen_records
    from dflash_offline.data.sources import iter_records
    from dflash_offline.data.template import tokenize_conversation

    config = ctx.config
    records = screen_records(
        iter_records(
            config.data,
            skip=config.skip,
            limit=config.limit,
            data_format=config.data_format,
        ),
        decontaminator_for(config.decontaminate, command="generate"),
    )
    return plan_jobs(
        records,
        lambda conv: tokenize_conversation(
            ctx.tokenizer, conv, max_length=config.max_length, too_long=config.too_long
        ),
        PlanConfig(
            bucket_edges=config.bucket_edges,
            tokens_per_batch=config.tokens_per_batch,
            max_batch_size=config.max_batch_size,
            window_records=config.window_records,
            seed=config.seed,
        ),
        is_done=ctx.done_ids.__contains__,
        read_ahead=config.plan_read_ahead,
    )


class FailureLog:
    """Writes the planner's failures as manifest parts of its own (temp file + rename)."""

    def __init__(self, ctx: RunContext) -> None:
        self._layout = create_or_open_cache(ctx.config.cache_dir, ctx.fingerprint)
        self._name = f"plan-{ctx.session}"
        self._session = ctx.session
        self._fsync = ctx.config.fsync
        self._part = 0
        self.count = 0

    def write(self, failures: tuple[SourceFailure, ...]) -> None:
        if not failures:
            return
        now = utc_now()
        rows = [
            FailureRow(
                sample_id=f.sample_id,
                source_index=f.source_index,
                reason=f.reason,
                detail=f.detail,
                worker=PLANNER_WORKER_ID,
                session=self._session,
                created_at=now,
            )
            for f in failures
        ]
        write_part(
            self._layout.part_path("failures", self._name, self._part),
            records_to_table("failures", rows),
            fsync=self._fsync,
        )
        self._part += 1
        self.count += len(rows)


def free_bytes(path: Path) -> int:
    """Bytes free for this process on ``path``'s file system."""
    return shutil.disk_usage(path).free


@dataclass(frozen=True, kw_only=True, slots=True)
class LowSpace:
    """Why the planner stopped before the plan's end: the cache's file system ran low (``--keep-free-gb``)."""

    free_bytes: int
    keep_free_bytes: int

    @property
    def message(self) -> str:
        option = field_ref(GenerateConfig, "keep_free_gb")
        return (
            f"stopped handing out jobs with {self.free_bytes / 1e9:.2f} GB free on the cache's file system, "
            f"below {option} {self.keep_free_bytes / 1e9:.12g}: the committed samples are kept; free space "
            "and rerun the same command to resume"
        )


class Planner(threading.Thread):
    """Feeds the job channel from the plan; records failures; stops on request, or before a job when the
    cache's file system has less than ``--keep-free-gb`` free (``low_space`` then says so: the workers
    finish the jobs already handed out). With ``--window-limit`` it waits before a job that does not fit
    the disk window (``window_gate.py``). Errors are kept.

    ``on_plan_end`` is called once the plan is read to its end, before the last job holding a training
    sample is handed out (the jobs after it hold validation samples only, which the window does not
    count): every training sample committed after the call is in a store sealed after it, and the run
    never waits for the window again (docs/follow.md, "The final segment")."""

    def __init__(
        self,
        ctx: RunContext,
        channel: JobChannel,
        stop: threading.Event,
        num_workers: int,
        *,
        on_plan_end: Callable[[], None] = lambda: None,
    ) -> None:
        super().__init__(name="planner", daemon=True)
        self._ctx = ctx
        self._channel = channel
        self.stop_requested = stop
        self._num_workers = num_workers
        self._on_plan_end = on_plan_end
        # Validation samples go to stores of their own only under a window (``worker_spec``).
        self._val_fraction = ctx.config.val_fraction if ctx.config.window_limit is not None else 0.0
        self.failure_log = FailureLog(ctx)
        self.error: BaseException | None = None
        self.planned_samples = 0
        self.planned_tokens = 0
        self.skipped = 0
        self.done = False
        self.low_space: LowSpace | None = None
        limit = ctx.config.window_limit
        self.window = (
            None
            if limit is None
            else WindowGate(
                ctx.config.cache_dir, limit, run_id=ctx.run_id, val_fraction=ctx.config.val_fraction
            )
        )
        """Waits while the disk window is full (``--window-limit``); None without a window."""

    def run(self) -> None:
        keep_free = int(self._ctx.config.keep_free_gb * 1e9)
        # The newest job holding a training sample and the jobs planned after it, admitted and not yet
        # handed out: whether it is the plan's last such job is known only once the plan has moved past
        # it, and the run's plan end (``on_plan_end``) must be recorded before that job goes out.
        held: list[CaptureJob] = []
        try:
            for event in plan_events(self._ctx):
                if self.stop_requested.is_set():
                    return
                self.failure_log.write(event.failures)
                self.skipped += event.samples_already_done
                job = event.job
                if job is None:
                    continue
                if keep_free and (free := free_bytes(self._ctx.config.cache_dir)) < keep_free:
                    self.low_space = LowSpace(free_bytes=free, keep_free_bytes=keep_free)
                    break
                training = self._holds_training_sample(job)
                if training:  # a later job holds a training sample: the held ones go now
                    if not self._hand_out(held):
                        return
                    held = []
                if self.window is not None and not self.window.admit(
                    [
                        JobSample(
                            sample_id=s.sample_id,
                            conversation_root=s.conversation_root,
                            num_tokens=s.num_tokens,
                        )
                        for s, done in zip(job.samples, job.already_done)
                        if not done
                    ],
                    self.stop_requested,
                ):
                    return
                self.skipped += len(job.samples) - job.num_new_samples
                self.planned_samples += job.num_new_samples
                self.planned_tokens += sum(
                    s.num_tokens for s, done in zip(job.samples, job.already_done) if not done
                )
                if training or held:
                    held.append(job)
                elif not self._hand_out([job]):
                    return
            if self.low_space is None:
                self._on_plan_end()  # before the last job holding a training sample is handed out
            if not self._hand_out(held):
                return
            self.done = self.low_space is None
            self._channel.finish(self._num_workers)
        except BaseException as e:
            self.error = e

    def _holds_training_sample(self, job: CaptureJob) -> bool:
        """The job holds a sample not yet in the cache that goes to a training store (not validation)."""
        return any(
            not done
            and not routes_to_validation(
                sample_id=s.sample_id, conversation_root=s.conversation_root, val_fraction=self._val_fraction
            )
            for s, done in zip(job.samples, job.already_done)
        )

    def _hand_out(self, jobs: list[CaptureJob]) -> bool:
        """Put ``jobs`` into the channel in order; False when a stop was requested meanwhile."""
        for job in jobs:
            while not self._channel.try_put(job, timeout=0.5):
                if self.stop_requested.is_set():
                    return False
        return True
