"""The coordinator of ``dflash generate``: fingerprint, resume, plan, start workers, watch, summarise.

One process plans (tokenizes and packs jobs, in a thread) and feeds a bounded job channel; one worker
process per GPU (or ``--workers N`` CPU processes) captures and writes. Under ``torchrun`` every rank
is a worker and rank 0 also coordinates (``launch.py``): both paths go through ``coordinate``, which
writes the ``running`` run row, the final status and the summary.

Rerunning the same command resumes: committed and failed samples are skipped, a different
fingerprint is refused naming the field. Ctrl-C stops cleanly (workers finish their job and commit; a
worker still loading its target is ended at once);
an exception in a worker stops the run with the worker's traceback.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_offline.cache.fingerprint import CacheFingerprint
from dflash_offline.cache.layout import create_or_open_cache, sweep_partial_files
from dflash_offline.cache.manifest import (
    committed_sample_ids,
    failed_sample_ids,
    read_runs,
    record_run,
)
from dflash_offline.cache.rows import RunRow, utc_now
from dflash_offline.cache.writer import new_session_id
from dflash_offline.config_fields import field_ref
from dflash_offline.errors import NoSpaceError, as_no_space_error
from dflash_offline.generate.channel import JobChannel, QueueJobChannel
from dflash_offline.generate.config import GenerateConfig
from dflash_offline.generate.context import RunContext
from dflash_offline.generate.events import JobDone, WorkerFinished, WorkerStarted
from dflash_offline.generate.feed import Planner
from dflash_offline.generate.progress import GenerateProgress, ProgressView
from dflash_offline.generate.window_setup import check_window, seal_abandoned_stores, store_bytes, window_on
from dflash_offline.generate.worker import CaptureTask, run_worker
from dflash_offline.interrupt import stop_on_sigint
from dflash_offline.locking import acquire_lock
from dflash_offline.workers.group import GroupPolicy, WorkerGroup, watch
from dflash_offline.workers.records import WorkerFailed, WorkerSpec
from dflash_offline.workers.spawned import SpawnedWorkers, spawn_context

if TYPE_CHECKING:
    from dflash_offline.target_model.loader import TargetInfo

DRAIN_SECONDS = 600.0
"""How long a stopped run waits for its workers to finish their current job and commit."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GenerateSummary:
    """The outcome of one run (also written as the ``runs`` table row)."""

    run_id: str
    status: str
    samples_committed: int
    tokens_committed: int
    failures: int
    stored_bytes: int
    seconds: float
    startup_seconds: float | None = None
    """From the run's start until its first worker was ready (target loaded, pinned buffers
    allocated); None when no worker got that far."""
    skipped_already_done: int
    """Samples of the plan the cache already held (resume)."""
    workers: tuple[WorkerFinished, ...]
    stopped_because: str = ""
    """Why a run that ended ``interrupted`` without Ctrl-C stopped early (``--keep-free-gb``); empty
    otherwise."""
    window_wait_seconds: float = 0.0
    """Seconds the planner waited for the disk window (``--window-limit``) to have room."""

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_committed / self.seconds if self.seconds > 0 else 0.0

    @property
    def capture_tokens_per_second(self) -> float | None:
        """Tokens committed per second once a worker was ready: the rate a longer run approaches, which
        a short run's start-up hides."""
        if self.startup_seconds is None or self.seconds <= self.startup_seconds:
            return None
        return self.tokens_committed / (self.seconds - self.startup_seconds)


class GenerateInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped the run cleanly (the workers' current jobs committed): what it had done by then,
    for the command to print before it exits 130 (a run stopped by a script's deadline says how far and
    how fast it got)."""

    def __init__(self, summary: GenerateSummary) -> None:
        super().__init__("interrupted")
        self.summary = summary


def resolved_compute_dtype(config: GenerateConfig) -> str:
    """``--dtype``, else the device's default: bfloat16 on GPUs, float32 on the CPU (exact features)."""
    if config.dtype is not None:
        return config.dtype
    import torch

    from dflash_offline.placement import under_torchrun
    from dflash_offline.target_model.loader import default_dtype

    on_gpu = bool(config.placement.gpus) or (under_torchrun() and torch.cuda.is_available())
    return str(default_dtype(torch.device("cuda" if on_gpu else "cpu"))).removeprefix("torch.")


def prepare_run(config: GenerateConfig, *, lock: bool = False) -> RunContext:
    """Resolve target, tokenizer and layers; create or check the cache; load the resume state.

    ``lock``: take the cache's writer lock first (the coordinator; refused with ``LockedError`` while
    another run holds it), kept in ``RunContext.lock`` for the caller to release."""
    from dflash_offline.writable import check_writable_dir

    if lock:  # the coordinator: it creates the cache (workers only open it)
        check_writable_dir(config.cache_dir, option=field_ref(GenerateConfig, "cache_dir"))
    from dflash_offline.target_model.loader import load_tokenizer, resolve_target, target_info

    data_path = _checked_data_path(config)
    info = target_info(resolve_target(config.target))
    tokenizer = load_tokenizer(config.target)
    fingerprint = _fingerprint(config, info, tokenizer, data_path)
    held = acquire_lock(config.cache_dir, what="cache") if lock else None
    try:
        create_or_open_cache(config.cache_dir, fingerprint)
        done = committed_sample_ids(config.cache_dir) | failed_sample_ids(config.cache_dir)
    except BaseException:
        if held is not None:
            held.release()
        raise
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    session = new_session_id()
    return RunContext(
        config=config,
        fingerprint=fingerprint,
        tokenizer=tokenizer,
        pad_id=int(pad_id),
        done_ids=frozenset(done),
        run_id=f"generate-{session}",
        session=session,
        lock=held,
    )


def _checked_data_path(config: GenerateConfig) -> Path:
    """The data file; a missing one, or (for a new cache) one of which no record parses, fails here,
    before any worker starts."""
    from dflash_offline.data.sources import first_usable_record, resolve_data_path

    data_path = resolve_data_path(config.data)
    if not (config.cache_dir / "cache.json").is_file():
        # A file of which no record parses (binary, another schema) fails here, before the cache exists.
        # (Not on resume: reaching --skip would cost a pass over the skipped records.)
        first_usable_record(data_path, skip=config.skip, limit=config.limit, data_format=config.data_format)
    return data_path


def _fingerprint(
    config: GenerateConfig, info: TargetInfo, tokenizer: Any, data_path: Path
) -> CacheFingerprint:
    """What the cache's samples depend on: the target, its layers, tokenizer and template, the codec,
    the length rules and the data file's name."""
    from dflash_offline.cache.codecs import DEFAULT_CODEC, storage_dtype
    from dflash_offline.data.sources import source_name
    from dflash_offline.data.template import chat_template_hash, tokenizer_hash
    from dflash_offline.target_model.layers import resolve_layer_ids

    layer_ids = resolve_layer_ids(
        info.num_layers, num_features=config.num_features, layer_ids=config.layer_ids
    )
    codec = config.codec or DEFAULT_CODEC  # an unknown name fails in storage_dtype, listing the known ones
    return CacheFingerprint(
        target_id=info.target_id,
        weights_hash=info.weights_hash,
        num_target_layers=info.num_layers,
        layer_ids=layer_ids,
        hidden_size=info.hidden_size,
        storage_dtype=storage_dtype(codec),
        codec=codec,
        tokenizer_hash=tokenizer_hash(tokenizer),
        chat_template_hash=chat_template_hash(tokenizer),
        max_length=config.max_length,
        too_long=config.too_long,
        bucket_edges=config.bucket_edges,
        data_source=source_name(data_path),
        compute_dtype=resolved_compute_dtype(config),
    )


def worker_spec(ctx: RunContext, *, worker: int, num_workers: int, device: str) -> WorkerSpec[CaptureTask]:
    """What worker ``worker`` of ``num_workers`` on ``device`` needs to know about this run."""
    config = ctx.config
    task = CaptureTask(
        target=config.target,
        dtype=ctx.fingerprint.compute_dtype,
        cache_dir=config.cache_dir,
        fingerprint=ctx.fingerprint,
        session=ctx.session,
        fsync=config.fsync,
        flush_seconds=config.flush_seconds,
        flush_bytes=config.flush_bytes,
        tokens_per_batch=config.tokens_per_batch,
        writer_queue_depth=config.writer_queue_depth,
        pad_id=ctx.pad_id,
        rolling=window_on(config),
        store_bytes=store_bytes(config, num_workers),
        val_fraction=config.val_fraction if config.window_limit is not None else 0.0,
        chunk_bytes=config.chunk_bytes,
        shard_file_bytes=config.shard_file_bytes,
    )
    return WorkerSpec(
        worker=worker,
        num_workers=num_workers,
        device=device,
        cpu_threads=config.placement.cpu_threads(),
        task=task,
    )


def worker_policy(config: GenerateConfig) -> GroupPolicy:
    """How generate's workers report, stop and read when they fail, on every launch path."""
    return GroupPolicy(
        label="worker",
        resumable="the cache",
        process_name="dflash-worker",
        drain_seconds=DRAIN_SECONDS,
        ready=WorkerStarted,  # its target is loaded, its shard group may be open
        finished=WorkerFinished,
        no_space_at=str(config.cache_dir),
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class RunWorkers:
    """The workers of one run as the coordinator sees them, whatever started them."""

    group: WorkerGroup
    """Spawned processes (``SpawnedWorkers``) or the ranks of a torchrun (``launch.py``)."""
    channel: JobChannel
    """Where the planner puts their jobs."""


@dataclass(kw_only=True, slots=True)
class _Tally:
    """Mutable counters of the coordinator's event loop (never crosses a thread boundary)."""

    samples: int = 0
    tokens: int = 0
    failures: int = 0
    stored_bytes_by_worker: dict[int, int] = field(default_factory=dict)
    finished: dict[int, WorkerFinished] = field(default_factory=dict)
    first_ready_at: float | None = None
    """``time.perf_counter()`` when the first worker said it was ready."""

    @property
    def stored_bytes(self) -> int:
        return sum(self.stored_bytes_by_worker.values())

    def apply(self, event: object) -> None:
        """Count a worker's progress or completion."""
        if isinstance(event, JobDone):
            self.samples += event.new_samples
            self.tokens += event.new_tokens
            self.failures += event.failures
            self.stored_bytes_by_worker[event.worker] = event.stored_bytes
        elif isinstance(event, WorkerFinished):
            self.finished[event.worker] = event
            self.stored_bytes_by_worker[event.worker] = event.stats.stored_bytes
        elif isinstance(event, WorkerStarted) and self.first_ready_at is None:
            self.first_ready_at = time.perf_counter()


def run_generate(
    config: GenerateConfig, *, on_event: Callable[[object], None] | None = None
) -> GenerateSummary:
    """Run (or resume) a generate job on ``config.placement``; returns the summary.

    Raises ``WorkerError`` (with the worker's traceback) when a worker fails, ``NoSpaceError`` when
    the disk filled up, ``LockedError`` when another run holds the cache; KeyboardInterrupt stops
    workers after their current job and leaves the cache resumable (status ``interrupted``)."""
    return coordinate(prepare_run(config, lock=True), _spawned_workers, on_event=on_event)


def _spawned_workers(ctx: RunContext) -> RunWorkers:
    """One spawned process per worker of ``config.placement``, taking jobs from a bounded queue."""
    placement = ctx.config.placement
    num_workers = placement.num_workers
    channel = QueueJobChannel(spawn_context(), depth=2 * num_workers + 2)
    specs = [
        worker_spec(ctx, worker=w, num_workers=num_workers, device=placement.device_of(w))
        for w in range(num_workers)
    ]
    group = SpawnedWorkers(run_worker, specs, policy=worker_policy(ctx.config), shared=(channel,))
    return RunWorkers(group=group, channel=channel)


def coordinate(
    ctx: RunContext,
    workers: Callable[[RunContext], RunWorkers],
    *,
    on_event: Callable[[object], None] | None = None,
) -> GenerateSummary:
    """The one coordinator of every launch path: run row, plan, watch ``workers(ctx)``, summarise.

    ``ctx`` holds the cache's lock (``prepare_run(lock=True)``); it is released here."""
    assert ctx.lock is not None
    try:
        # The first Ctrl-C stops the workers after their current job (each commits what it captured);
        # the run row then says ``interrupted``. A second aborts at once.
        with stop_on_sigint("dflash generate: stopping after the current jobs (committed samples are kept)"):
            return _run_locked(ctx, workers(ctx), on_event)
    except OSError as e:  # the coordinator's own writes (run rows, planner failures) hit a full disk
        converted = as_no_space_error(e, ctx.config.cache_dir)
        if converted is e:
            raise
        raise converted from e
    finally:
        ctx.lock.release()


def _run_locked(
    ctx: RunContext, workers: RunWorkers, on_event: Callable[[object], None] | None
) -> GenerateSummary:
    config = ctx.config
    group = workers.group
    check_window(config, ctx.fingerprint, group.num_workers)
    sweep_partial_files(config.cache_dir)  # under the lock: no other writer is running
    _close_abandoned_runs(ctx)
    seal_abandoned_stores(config)  # under the lock too: their writers are dead
    start = time.perf_counter()
    rows = RunRows(ctx, started_at=utc_now(), num_workers=group.num_workers)
    rows.running()
    planner = Planner(ctx, workers.channel, threading.Event(), group.num_workers, on_plan_end=rows.plan_ended)
    tally = _Tally()
    status, error = _watch(ctx, workers, planner, tally, on_event)
    low_space = planner.low_space.message if planner.low_space is not None else ""
    if status == "finished" and low_space:
        status = "interrupted"
    summary = GenerateSummary(
        run_id=ctx.run_id,
        status=status,
        stopped_because=low_space if status == "interrupted" else "",
        samples_committed=sum(f.stats.samples for f in tally.finished.values()) or tally.samples,
        tokens_committed=sum(f.stats.tokens for f in tally.finished.values()) or tally.tokens,
        failures=tally.failures + planner.failure_log.count,
        stored_bytes=tally.stored_bytes,
        seconds=time.perf_counter() - start,
        startup_seconds=None if tally.first_ready_at is None else tally.first_ready_at - start,
        skipped_already_done=planner.skipped,
        workers=tuple(tally.finished[w] for w in sorted(tally.finished)),
        window_wait_seconds=0.0 if planner.window is None else planner.window.waited_seconds,
    )
    error = as_no_space_error(error, config.cache_dir) if error is not None else None
    _record_end(ctx, rows, summary=summary, error=error)
    if isinstance(error, KeyboardInterrupt):
        raise GenerateInterrupted(summary) from error
    if error is not None:
        raise error
    return summary


KILLED_RUN_NOTE = "killed: it ended without recording its end"


def _close_abandoned_runs(ctx: RunContext) -> None:
    """A run row still ``running`` while this run holds the lock belongs to a run that was killed (SIGKILL,
    OOM killer, power loss) before it could record its end: it says ``interrupted`` from now on, naming
    the run that found it, so that ``status`` and ``--query runs`` show no run as live that is not."""
    cache_dir = ctx.config.cache_dir
    for run in read_runs(cache_dir):
        if run.status == "running" and run.run_id != ctx.run_id:
            note = f"{KILLED_RUN_NOTE} (found by {ctx.run_id}, which took over the cache's lock)"
            record_run(cache_dir, dataclasses.replace(run, status="interrupted", error=note))


def _watch(
    ctx: RunContext,
    workers: RunWorkers,
    planner: Planner,
    tally: _Tally,
    on_event: Callable[[object], None] | None,
) -> tuple[str, BaseException | None]:
    """Start the workers and the planner, count the workers' events until every worker finished;
    stop them all on the first failure (a failure to start included: the run row then says so).

    Returns the run's status and the error that ended it (None when ``finished``)."""
    group = workers.group
    progress = GenerateProgress(enabled=ctx.config.progress, num_workers=group.num_workers)
    status = "finished"
    error: BaseException | None = None

    def redraw() -> None:
        progress.update(tally=_progress_view(tally, planner))

    def count(event: object) -> None:
        if on_event is not None:
            on_event(event)
        tally.apply(event)
        if isinstance(event, WorkerStarted):
            progress.worker_started(event)
        if not isinstance(event, WorkerFailed):  # a failure stops the run (``watch`` raises it)
            redraw()

    def check_planner() -> None:
        if planner.error is not None:
            raise planner.error

    try:
        group.start()
        planner.start()
        watch(group, count, each_turn=check_planner, on_quiet=redraw)
        check_planner()
    except KeyboardInterrupt as e:
        status, error = "interrupted", e
    except BaseException as e:
        status, error = "failed", e
    finally:
        planner.stop_requested.set()
        if status != "finished":
            group.stop()
        group.drain_and_join(tally.apply)
        workers.channel.cancel_join()
        progress.close()
        if planner.ident is not None:  # started
            planner.join(timeout=5)
    return status, error


def _record_end(
    ctx: RunContext,
    rows: RunRows,
    *,
    summary: GenerateSummary,
    error: BaseException | None,
) -> None:
    """The run row's final status, then the index merge (not when the disk is full)."""
    config = ctx.config
    try:
        rows.ended(
            summary, error=summary.stopped_because if error is None else f"{type(error).__name__}: {error}"
        )
        if config.build_index and not isinstance(error, NoSpaceError):
            from dflash_offline.cache.index import build_index

            build_index(config.cache_dir)
    except OSError as e:
        if error is None:
            raise as_no_space_error(e, config.cache_dir) from e
        # The run already failed (e.g. the disk is full): report that, not this follow-up error.
        error.add_note(f"and recording the run failed too: {e!r}")


class RunRows:
    """The revisions of this run's ``runs`` row: ``running`` at its start, the plan's end from the
    planner thread (``Planner.on_plan_end``), the final status. One is written at a time, and the plan's
    end is never written after the final status (a planner outliving a stopped run)."""

    def __init__(self, ctx: RunContext, *, started_at: dt.datetime, num_workers: int) -> None:
        self._ctx = ctx
        self._started_at = started_at
        self._num_workers = num_workers
        self._lock = threading.Lock()
        self._plan_ended_at: dt.datetime | None = None
        self._ended = False

    def running(self) -> None:
        with self._lock:
            self._write("running")

    def plan_ended(self) -> None:
        with self._lock:
            if not self._ended:
                self._plan_ended_at = utc_now()
                self._write("running")

    def ended(self, summary: GenerateSummary, *, error: str) -> None:
        with self._lock:
            self._ended = True
            self._write(summary.status, summary=summary, error=error)

    def _write(self, status: str, *, summary: GenerateSummary | None = None, error: str = "") -> None:
        record_run(
            self._ctx.config.cache_dir,
            _run_row(
                self._ctx,
                started_at=self._started_at,
                status=status,
                num_workers=self._num_workers,
                summary=summary,
                error=error,
                plan_ended_at=self._plan_ended_at,
            ),
        )


def _progress_view(tally: _Tally, planner: Planner) -> ProgressView:
    return ProgressView(
        samples=tally.samples,
        tokens=tally.tokens,
        stored_bytes=tally.stored_bytes,
        failures=tally.failures + planner.failure_log.count,
        total=planner.planned_samples if planner.done else None,
        planned=planner.planned_samples,
    )


def _run_row(
    ctx: RunContext,
    *,
    started_at: Any,
    status: str,
    num_workers: int,
    summary: GenerateSummary | None = None,
    error: str = "",
    plan_ended_at: dt.datetime | None = None,
) -> RunRow:
    """The ``runs`` row: zero counts while ``running``, the summary's once the run ended."""
    return RunRow(
        run_id=ctx.run_id,
        command="generate",
        started_at=started_at,
        finished_at=None if status == "running" else utc_now(),
        status=status,
        num_workers=num_workers,
        samples_committed=summary.samples_committed if summary else 0,
        tokens_committed=summary.tokens_committed if summary else 0,
        bytes_written=summary.stored_bytes if summary else 0,
        failures=summary.failures if summary else 0,
        fingerprint_json=json.dumps(ctx.fingerprint.to_dict()),
        host=socket.gethostname(),
        config_json=json.dumps(ctx.config.to_dict(), default=str),
        error=error,
        plan_ended_at=plan_ended_at,
    )
