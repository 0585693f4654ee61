"""Entry point of ``dflash generate``: spawned workers (``--gpus`` / ``--workers``) or ``torchrun`` ranks.

Under ``torchrun`` every rank is one worker (its GPU is ``LOCAL_RANK``); rank 0 also runs the one
coordinator of ``run.py`` (plan, run row, status, summary, index merge) over ``RankWorkers``: jobs go
out and worker events come back through the process group's key-value store. Multi-node runs need
only a shared file system for the cache directory. A rank that dies makes torchrun stop the others;
rank 0 then records the run as ``failed`` and the rerun of the same command resumes.
"""

from __future__ import annotations

import signal
from dataclasses import replace
from types import FrameType
from typing import Any

from dflash_offline.errors import WorkerError
from dflash_offline.generate.channel import StoreJobChannel
from dflash_offline.generate.config import GenerateConfig
from dflash_offline.generate.context import RunContext
from dflash_offline.generate.run import (
    GenerateSummary,
    RunWorkers,
    coordinate,
    prepare_run,
    run_generate,
    worker_policy,
    worker_spec,
)
from dflash_offline.generate.worker import run_worker
from dflash_offline.placement import torchrun_device, under_torchrun
from dflash_offline.workers.ranks import LockedStore, RankWorkers, StoreEvents, StoreStop, run_rank_worker

PREFIX = "dflash-generate"
"""Key prefix of this run's entries in the torchrun store."""


class RankTerminatedError(WorkerError):
    """torchrun stopped rank 0 (SIGTERM): another rank failed or was killed."""


def generate_from_config(config: GenerateConfig) -> GenerateSummary | None:
    """Run generate where the environment says; returns the summary on the coordinator (None on
    the other torchrun ranks). The caller prints it (``format_summary``)."""
    if under_torchrun():
        return run_generate_distributed(config)
    return run_generate(config)


def format_summary(summary: GenerateSummary, *, cache_dir: str) -> str:
    startup = "" if summary.startup_seconds is None else f", {summary.startup_seconds:.1f} s of it start-up"
    capture = summary.capture_tokens_per_second
    after_startup = "" if capture is None else f"; {capture:,.0f} tok/s after start-up"
    lines = [
        f"run {summary.run_id}: {summary.status} in {summary.seconds:.1f} s{startup}",
        f"  committed {summary.samples_committed} samples, {summary.tokens_committed} tokens "
        f"({summary.tokens_per_second:,.0f} tok/s{after_startup}), {summary.stored_bytes / 1e9:.3f} GB "
        f"stored, {summary.failures} failures, {summary.skipped_already_done} already in the cache",
    ]
    if summary.stopped_because:
        lines.append(f"  {summary.stopped_because}")
    if summary.window_wait_seconds:
        lines.append(f"  waited {summary.window_wait_seconds:.1f} s for training to free the disk window")
    for w in summary.workers:
        t = w.timings
        lines.append(
            f"  worker {w.stats.shard} on {w.device}: {w.jobs} jobs, {w.stats.samples} samples, "
            f"{w.stats.tokens} tokens; target and buffers loaded in {t.load_seconds:.1f} s, "
            f"forward {t.forward_seconds:.1f} s, "
            f"waited for jobs {t.job_wait_seconds:.1f} s, for the writer {t.writer_wait_seconds:.1f} s; "
            f"writer busy {t.write_seconds:.1f} s"
        )
    lines.append(f"inspect: dflash status {cache_dir}   |   dflash sql {cache_dir} --query buckets")
    return "\n".join(lines)


def _job_channel(store: Any, world: int) -> StoreJobChannel:
    return StoreJobChannel(store, prefix=f"{PREFIX}/jobs", lookahead=2 * world + 2)


def _rank_workers(ctx: RunContext, store: Any, world: int) -> RunWorkers:
    """Rank 0's view of the ranks: its own worker in a thread, the other ranks' events from the store."""
    store.set(f"{PREFIX}/session", ctx.session)  # read by the other ranks once rank 0 has started them
    channel = _job_channel(store, world)
    group = RankWorkers(
        run_worker,
        worker_spec(ctx, worker=0, num_workers=world, device=torchrun_device()),
        store=store,
        prefix=PREFIX,
        policy=worker_policy(ctx.config),
        shared=(channel,),
        on_stop=lambda: channel.finish(world),  # ranks waiting for a job get an end marker
    )
    return RunWorkers(group=group, channel=channel)


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: let the coordinator record the run
    raise RankTerminatedError(
        "torchrun stopped rank 0 (SIGTERM): another rank failed or was killed; the cache is "
        "resumable: rerun the same command"
    )


def run_generate_distributed(config: GenerateConfig) -> GenerateSummary | None:
    """One rank of a ``torchrun`` generate; returns the summary on rank 0, None elsewhere."""
    import torch.distributed as dist

    dist.init_process_group(backend="gloo")  # only for the store and barriers: no tensors move
    rank, world = dist.get_rank(), dist.get_world_size()
    store = LockedStore(dist.distributed_c10d._get_default_store())
    try:
        if rank == 0:
            previous = signal.signal(signal.SIGTERM, _raise_terminated)
            try:
                ctx = prepare_run(config, lock=True)
                store.set(f"{PREFIX}/ready", b"1")
                summary: GenerateSummary | None = coordinate(
                    ctx, lambda ctx: _rank_workers(ctx, store, world)
                )
            finally:
                signal.signal(signal.SIGTERM, previous)
        else:
            store.get(f"{PREFIX}/ready")  # blocks until rank 0 has created or checked the cache
            ctx = prepare_run(config)  # reads only; meanwhile rank 0 sweeps and writes the run row
            dist.barrier()  # rank 0 has swept the cache: workers may write
            ctx = replace(ctx, session=store.get(f"{PREFIX}/session").decode())
            spec = worker_spec(ctx, worker=rank, num_workers=world, device=torchrun_device())
            events, stop = StoreEvents(store, prefix=PREFIX, rank=rank), StoreStop(store, prefix=PREFIX)
            run_rank_worker(run_worker, spec, events, stop, _job_channel(store, world))
            summary = None
        dist.barrier()  # every rank leaves after rank 0's run row and index merge
        return summary
    finally:
        dist.destroy_process_group()
