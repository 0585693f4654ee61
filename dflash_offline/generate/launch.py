"""Entry point of ``dflash generate``: spawned workers (``--gpus`` / ``--workers``) or ``torchrun`` ranks.

Under ``torchrun`` every rank is one worker (its GPU is ``LOCAL_RANK``), rank 0 also plans and
publishes jobs through the process group's key-value store, and rank 0 merges the index once every
rank has finished. Multi-node runs need only a shared file system for the cache directory.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import threading
import time
from dataclasses import replace
from typing import Any

import click

from dflash_offline.cache.layout import sweep_partial_files
from dflash_offline.cache.manifest import record_run
from dflash_offline.cache.records import RunRow, utc_now
from dflash_offline.generate.channel import StoreJobChannel
from dflash_offline.generate.config import GenerateConfig
from dflash_offline.generate.events import JobDone, WorkerFinished
from dflash_offline.generate.run import (
    FailureLog,
    GenerateSummary,
    plan_events,
    prepare_run,
    run_generate,
    worker_spec,
)
from dflash_offline.generate.worker import run_worker_in_process
from dflash_offline.torchrun import under_torchrun


def generate_from_config(config: GenerateConfig) -> GenerateSummary | None:
    """Run generate where the environment says, print the summary; returns it on the coordinator."""
    if under_torchrun():
        summary = run_generate_distributed(config)
    else:
        try:
            summary = run_generate(config)
        except KeyboardInterrupt:
            click.echo("interrupted: committed samples are kept; rerun the same command to resume", err=True)
            raise SystemExit(130) from None
    if summary is not None:
        click.echo(format_summary(summary, cache_dir=str(config.cache_dir)))
    return summary


def format_summary(summary: GenerateSummary, *, cache_dir: str) -> str:
    lines = [
        f"run {summary.run_id}: {summary.status} in {summary.seconds:.1f} s",
        f"  committed {summary.samples_committed} samples, {summary.tokens_committed} tokens "
        f"({summary.tokens_per_second:,.0f} tok/s), {summary.stored_bytes / 1e9:.3f} GB stored, "
        f"{summary.failures} failures, {summary.skipped_already_done} already in the cache",
    ]
    for w in summary.workers:
        t = w.timings
        lines.append(
            f"  worker {w.stats.shard} on {w.device}: {w.jobs} jobs, {w.stats.samples} samples, "
            f"{w.stats.tokens} tokens; forward {t.forward_seconds:.1f} s, "
            f"waited for jobs {t.job_wait_seconds:.1f} s, for the writer {t.writer_wait_seconds:.1f} s; "
            f"writer busy {t.write_seconds:.1f} s"
        )
    lines.append(f"inspect: dflash status {cache_dir}   |   dflash sql {cache_dir} --query buckets")
    return "\n".join(lines)


class _StoreEvents:
    """The ``events`` queue of an in-process worker: adds progress to the store's counters."""

    def __init__(self, store: Any, prefix: str) -> None:
        self._store = store
        self._prefix = prefix
        self.local: queue.Queue[Any] = queue.Queue()

    def put(self, event: Any) -> None:
        if isinstance(event, JobDone):
            self._store.add(f"{self._prefix}/samples", event.new_samples)
            self._store.add(f"{self._prefix}/tokens", event.new_tokens)
            self._store.add(f"{self._prefix}/failures", event.failures)
        self.local.put(event)


def run_generate_distributed(config: GenerateConfig) -> GenerateSummary | None:
    """One rank of a ``torchrun`` generate; returns the summary on rank 0, None elsewhere."""
    import torch
    import torch.distributed as dist

    dist.init_process_group(backend="gloo")  # only for the store and barriers: no tensors move
    rank, world = dist.get_rank(), dist.get_world_size()
    store = dist.distributed_c10d._get_default_store()
    prefix = "dflash-generate"
    start = time.perf_counter()
    started_at = utc_now()
    held: list[Any] = []  # the cache's lock: only the coordinator (rank 0) holds it
    try:
        if rank == 0:
            ctx = prepare_run(config, lock=True)
            held.append(ctx.lock)
            sweep_partial_files(config.cache_dir)
            store.set(f"{prefix}/session", ctx.session)
        dist.barrier()
        if rank != 0:
            ctx = replace(prepare_run(config), session=store.get(f"{prefix}/session").decode())
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
        spec = worker_spec(ctx, worker=rank, device=device)
        channel = StoreJobChannel(store, prefix=f"{prefix}/jobs", lookahead=2 * world + 2)
        events = _StoreEvents(store, prefix)
        stop = threading.Event()
        planner_error: list[BaseException] = []
        failure_log = FailureLog(ctx) if rank == 0 else None

        def plan() -> None:
            try:
                assert failure_log is not None
                for event in plan_events(ctx):
                    failure_log.write(event.failures)
                    if event.job is not None:
                        channel.put(event.job)
            except BaseException as e:
                planner_error.append(e)
            finally:
                channel.finish(world)  # also on error: no rank may wait for a job forever

        planner = threading.Thread(target=plan, name="planner", daemon=True)
        if rank == 0:
            planner.start()
        run_worker_in_process(spec, channel, events, stop)
        if rank == 0:
            planner.join()
        finished = [e for e in list(events.local.queue) if isinstance(e, WorkerFinished)]
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, finished[0] if finished else None)
        if rank != 0:
            return None
        if planner_error:
            raise planner_error[0]
        workers = tuple(w for w in gathered if w is not None)
        summary = GenerateSummary(
            run_id=ctx.run_id,
            status="finished",
            samples_committed=sum(w.stats.samples for w in workers),
            tokens_committed=sum(w.stats.tokens for w in workers),
            failures=sum(w.stats.failures for w in workers) + (failure_log.count if failure_log else 0),
            stored_bytes=sum(w.stats.stored_bytes for w in workers),
            seconds=time.perf_counter() - start,
            skipped_already_done=0,
            workers=workers,
        )
        record_run(
            config.cache_dir,
            RunRow(
                run_id=ctx.run_id,
                command="generate",
                started_at=started_at,
                finished_at=utc_now(),
                status="finished",
                num_workers=world,
                samples_committed=summary.samples_committed,
                tokens_committed=summary.tokens_committed,
                bytes_written=summary.stored_bytes,
                failures=summary.failures,
                fingerprint_json=json.dumps(ctx.fingerprint.to_dict()),
                host=socket.gethostname(),
                config_json=json.dumps(config.to_dict(), default=str),
            ),
        )
        if config.build_index:
            from dflash_offline.cache.index import build_index

            build_index(config.cache_dir)
        return summary
    finally:
        for lock in held:
            lock.release()
        dist.destroy_process_group()
