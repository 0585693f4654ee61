"""One regenerate worker: load the target on its device, build the engine, drive its share of the records.

A worker answers the records whose sample id hashes to it (``crc32(sample_id) % num_workers``: disjoint,
stable across reruns with the same worker count) and writes them to its own JSONL (the output itself
for a single worker, ``<out>.parts/w<k>.jsonl`` otherwise). It continues its own conversations that an
earlier run left in progress (``<out>.partial``, ``partial_out.py``) and, stopped, keeps its own there (a
single worker) or in ``<out>.parts/w<k>.partial``. Spawned workers (``--gpus`` / ``--workers``,
``workers.spawned``) report through an event queue, ignore SIGINT (the coordinator decides), and die with
their coordinator.
"""

from __future__ import annotations

import functools
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dflash_offline.regenerate.config import RegenerateConfig
from dflash_offline.regenerate.driver import KEY, ConversationSink, Driver, Tally
from dflash_offline.workers.device import bind_device
from dflash_offline.workers.records import EventSink, StopFlag, WorkerSpec

if TYPE_CHECKING:
    from dflash_offline.data.conversations import Conversation, SourceFailure
    from dflash_offline.data.decontaminate import Decontaminator
    from dflash_offline.regenerate.engine_protocol import Engine, EngineStats
    from dflash_offline.regenerate.jsonl_out import ResumableJsonl
    from dflash_offline.target_model.loader import TargetInfo


@dataclass(frozen=True, kw_only=True, slots=True)
class AnswerTask:
    """What a regenerate worker answers and where it writes (``WorkerSpec.task``, pickled at spawn)."""

    config: RegenerateConfig
    out: Path
    """This worker's JSONL: the output itself for a single worker, else its part ``w<worker>.jsonl``."""
    failures: Path
    partial: Path
    """Where a stop keeps this worker's conversations in progress: ``<out>.partial`` itself for a single
    worker, else its part ``w<worker>.partial`` (it continues those of ``config.partial_path``)."""
    done: frozenset[str]
    """Sample ids written or failed by earlier runs (in the merged output)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerReady:
    worker: int
    device: str
    engine: str
    load_seconds: float


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerProgress:
    worker: int
    delta: Tally


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerNote:
    """A line for stderr (a failed record, the decontamination note)."""

    worker: int
    text: str


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerDone:
    worker: int
    device: str
    engine: str
    total: Tally
    generation_seconds: float
    """From the engine being ready to the last answer."""
    completed: bool
    """False when a stop request ended it early."""
    engine_stats: EngineStats | None
    """What the engine's steps did (None: a server engine)."""


def belongs_to(sample_id: str, worker: int, num_workers: int) -> bool:
    return num_workers == 1 or zlib.crc32(sample_id.encode()) % num_workers == worker


def run_worker(
    spec: WorkerSpec[AnswerTask], emit: Callable[[Any], None], should_stop: Callable[[], bool]
) -> WorkerDone:
    """The worker's whole life in this process; ``emit`` receives the Worker* events above."""
    return answer_records(spec, load_worker(spec, emit), emit, should_stop)


def load_worker(spec: WorkerSpec[AnswerTask], emit: Callable[[Any], None]) -> LoadedEngine:
    """Load the target and build the engine on the worker's device, then emit ``WorkerReady``."""
    device = bind_device(spec)
    start = time.perf_counter()
    loaded = _load_engine(spec, device)
    emit(
        WorkerReady(
            worker=spec.worker,
            device=spec.device,
            engine=loaded.engine.name,
            load_seconds=time.perf_counter() - start,
        )
    )
    return loaded


@dataclass(frozen=True, kw_only=True, slots=True)
class LoadedEngine:
    """The generation engine and what the driver and the output need of the target (``_load_engine``)."""

    tokenizer: Any
    info: TargetInfo
    engine: Engine
    batch_size: int
    """Conversations the engine answers at once (per forward step, or requests in flight)."""
    provenance: dict[str, Any]
    """Extra ``regenerated_by`` entries (the engine's sampler; ``--engine openai``: the served model)."""


def _load_engine(spec: WorkerSpec[AnswerTask], device: torch.device) -> LoadedEngine:
    from dflash_offline.decode.attention import fused_kernels_run
    from dflash_offline.decode.forward import DEFAULT_COMPILE_BACKEND
    from dflash_offline.decode.sampling import SAMPLER
    from dflash_offline.regenerate.engine_protocol import EngineOptions
    from dflash_offline.regenerate.generation import GenerationSettings
    from dflash_offline.regenerate.slot_engine import SlotEngine
    from dflash_offline.target_model.loader import compute_dtype, load_target, stop_token_ids

    config = spec.task.config
    if config.engine == "openai":
        return _load_server_engine(spec)
    target = load_target(config.target, device=device, dtype=compute_dtype(config.dtype, device))
    tokenizer = target.tokenizer
    settings = GenerationSettings(
        max_new_tokens=config.max_new_tokens,
        temperature=config.temperature,
        stop_ids=stop_token_ids(tokenizer, target.model),
        top_p=config.top_p,
    )
    batch_size = config.batch_size_for(device.type)
    options = EngineOptions(
        batch_size=batch_size,
        kv_tokens=config.kv_tokens,
        max_batch_tokens=config.max_batch_tokens,
        prefill_wait=config.prefill_wait_for(device.type),
        max_prompt_tokens=config.max_prompt_tokens,
        cuda_graphs=config.cuda_graphs == "on",
        prefill_graphs=config.prefill_graphs_for(device.type),
        live_attention=config.live_attention_for(fused_kernels=fused_kernels_run(device, target.dtype)),
        compile_backend=DEFAULT_COMPILE_BACKEND if config.compile == "on" else None,
        reuse_kv={"auto": None, "on": True, "off": False}[config.reuse_kv],
        seed=config.seed,
    )
    engine = SlotEngine(target.model, settings, options)  # --engine auto and slots alike
    return LoadedEngine(
        tokenizer=tokenizer, info=target.info, engine=engine, batch_size=batch_size,
        provenance={"sampler": SAMPLER},
    )  # fmt: skip


def _load_server_engine(spec: WorkerSpec[AnswerTask]) -> LoadedEngine:
    """``--engine openai``: the tokenizer and facts of --target (no weights) and the server's engine."""
    from dflash_offline.regenerate.generation import GenerationSettings
    from dflash_offline.regenerate.openai_engine import (
        OpenAIEngine,
        probe_server,
        server_options,
        server_target,
    )

    config = spec.task.config
    target = server_target(config.target)
    options = server_options(config)
    served = probe_server(options, target.tokenizer)
    settings = GenerationSettings(
        max_new_tokens=config.max_new_tokens,
        temperature=config.temperature,
        stop_ids=target.stop_ids,
    )
    engine = OpenAIEngine(
        options=options, served=served, settings=settings, tokenizer=target.tokenizer,
        vocab_size=target.info.vocab_size, seed=config.seed + spec.worker,
    )  # fmt: skip
    return LoadedEngine(
        tokenizer=target.tokenizer,
        info=target.info,
        engine=engine,
        batch_size=config.concurrency,
        provenance={"served_model": served.model, "prompt_form": served.prompt_form},
    )


def _note(spec: WorkerSpec[AnswerTask], text: str) -> WorkerNote:
    return WorkerNote(worker=spec.worker, text=text)


def answer_records(
    spec: WorkerSpec[AnswerTask],
    loaded: LoadedEngine,
    emit: Callable[[Any], None],
    should_stop: Callable[[], bool],
) -> WorkerDone:
    """Drive this worker's share of the records through the engine into its own JSONL files."""
    from dflash_offline.data.decontaminate import Decontaminator
    from dflash_offline.data.sources import source_name
    from dflash_offline.regenerate.jsonl_out import ResumableJsonl
    from dflash_offline.regenerate.partial_out import read_partials

    config, engine = spec.task.config, loaded.engine
    mine = functools.partial(belongs_to, worker=spec.worker, num_workers=spec.num_workers)
    window = config.window or loaded.batch_size * 2
    completed = False
    gen_start = time.perf_counter()
    source = source_name(config.data)
    decontaminator, note = Decontaminator.from_installed() if config.decontaminate else (None, "")
    if note and spec.worker == 0:
        emit(_note(spec, f"regenerate: {note}"))
    with (
        ResumableJsonl(spec.task.out, key=KEY) as out,
        ResumableJsonl(spec.task.failures, key=KEY) as failures,
    ):
        own = out.keys | failures.keys
        sink = _sink(spec, loaded, emit, out=out, failures=failures, source=source)
        restored = read_partials([config.partial_path], mine=mine)
        driver = Driver(
            engine=engine,
            sink=sink,
            tokenizer=loaded.tokenizer,
            max_prompt_tokens=config.max_prompt_tokens,
            window=window,
            done=lambda sid: sid in spec.task.done or sid in own,
            mine=mine,
            restored={sid: entry.answers for sid, entry in restored.items()},
        )

        def finished(sid: str) -> bool:
            """Written or failed by now, by this run (its keys grow as it writes) or an earlier one."""
            return sid in spec.task.done or sid in out.keys or sid in failures.keys

        try:
            records = _records(config, source=source, decontaminator=decontaminator, mine=mine)
            completed = driver.run(records, should_stop=should_stop)
        finally:
            _end_run(spec, driver, engine, completed=completed, finished=finished)
    return WorkerDone(
        worker=spec.worker,
        device=spec.device,
        engine=engine.name,
        total=sink.total,
        generation_seconds=time.perf_counter() - gen_start,
        completed=completed,
        engine_stats=engine.stats(),
    )


def _records(
    config: RegenerateConfig,
    *,
    source: str,
    decontaminator: Decontaminator | None,
    mine: Callable[[str], bool],
) -> Iterator[Conversation | SourceFailure]:
    """The records of --data (from --skip, up to --limit), screened against the evaluation questions."""
    from dflash_offline.data.decontaminate import screen_records
    from dflash_offline.data.sources import iter_records

    records = iter_records(
        config.data, skip=config.skip, limit=config.limit, data_format=config.data_format, source=source
    )
    # Each worker screens its own records only (the others pass through: it never admits them).
    return screen_records(records, decontaminator, checked=mine)


def _end_run(
    spec: WorkerSpec[AnswerTask],
    driver: Driver,
    engine: Engine,
    *,
    completed: bool,
    finished: Callable[[str], bool],
) -> None:
    """Keep the answered turns of the conversations in progress when the run ends early (a stop, or an
    engine that gave up: they are the target's answers all the same), close the engine, and, for a worker
    that writes the output itself, fold its kept conversations into ``<out>.partial``, dropping the ones it
    has written or failed by now, ``finished`` (several workers: their coordinator does it as it merges)."""
    from dflash_offline.regenerate.partial_out import compact_partials

    task = spec.task
    try:
        if not completed:
            driver.sink.keep(driver.in_progress())
    finally:
        engine.close(abort=not completed)
    if task.partial == task.config.partial_path and task.partial.exists():
        compact_partials(task.partial, [], done=finished)


def _sink(
    spec: WorkerSpec[AnswerTask],
    loaded: LoadedEngine,
    emit: Callable[[Any], None],
    *,
    out: ResumableJsonl,
    failures: ResumableJsonl,
    source: str,
) -> ConversationSink:
    """Where answers go: the output JSONL (with their provenance) and the failures JSONL; every tally
    goes to the coordinator as a ``WorkerProgress``."""
    config, info = spec.task.config, loaded.info

    def on_tally(delta: Tally) -> None:
        emit(WorkerProgress(worker=spec.worker, delta=delta))

    sink = ConversationSink(
        out=out,
        failures=failures,
        partial=spec.task.partial,
        source=source,
        regenerated_by={
            "target": info.target_id,
            "weights_hash": info.weights_hash,
            "temperature": config.temperature,
            "max_new_tokens": config.max_new_tokens,
            "seed": config.seed,
            "top_p": config.top_p,
            **loaded.provenance,
        },
        on_tally=on_tally,
        on_failure=lambda text: emit(_note(spec, text)),
    )
    return sink


class _BatchedEmitter:
    """Sends progress to the coordinator at most every 0.25 s (one event per answer would flood the queue)."""

    def __init__(self, events: EventSink, worker: int) -> None:
        self._events = events
        self._worker = worker
        self._pending = Tally()
        self._last = 0.0

    def __call__(self, event: Any) -> None:
        if isinstance(event, WorkerProgress):
            self._pending = self._pending + event.delta
            if time.monotonic() - self._last >= 0.25:
                self.flush()
            return
        self.flush()
        self._events.put(event)

    def flush(self) -> None:
        if self._pending != Tally():
            self._events.put(WorkerProgress(worker=self._worker, delta=self._pending))
            self._pending = Tally()
        self._last = time.monotonic()


def worker_process(spec: WorkerSpec[AnswerTask], events: EventSink, stop: StopFlag) -> None:
    """Entry point of a spawned worker (``workers.spawned.spawned_main`` reports its failure)."""
    emit = _BatchedEmitter(events, spec.worker)
    try:
        done = run_worker(spec, emit, stop.is_set)
    finally:
        emit.flush()  # the progress before a failure too
    events.put(done)
