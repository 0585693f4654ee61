"""What every regenerate engine shares: the ``Engine`` protocol the conversation driver calls, the records
across it (``EngineOptions`` in, ``Finished`` / ``RequestFailure`` out, ``EngineStats`` at the end) and
``EngineError``. The engines
themselves are ``slot_engine.py`` (the project's decode engine, ``--engine auto|slots``) and
``openai_engine.py`` (a server, ``--engine openai``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Literal, Protocol

from dflash_offline.config_fields import field_ref
from dflash_offline.errors import DflashError
from dflash_offline.regenerate.config import RegenerateConfig
from dflash_offline.regenerate.generation import GeneratedTokens

EngineName = Literal["slots", "openai"]

KV_FIX = (
    f"{field_ref(RegenerateConfig, 'kv_tokens')} (KV-cache size), "
    f"{field_ref(RegenerateConfig, 'batch_size')}, "
    f"{field_ref(RegenerateConfig, 'max_batch_tokens')} or {field_ref(RegenerateConfig, 'max_new_tokens')}"
)
"""The options that size the KV cache, for a message saying it does not fit."""


class EngineError(DflashError):
    """The target could not answer (out of memory, a request the KV cache cannot hold)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineOptions:
    """The decode engine's batching knobs (sampling is in ``GenerationSettings``)."""

    batch_size: int
    """Requests decoded at once (slots), fewer when ``kv_tokens`` cannot hold that many."""
    kv_tokens: int | None
    """KV-cache budget in tokens: slots × (max_prompt_tokens + new tokens + 1). None: what the free GPU
    memory holds after loading (on the CPU: ``batch_size`` slots)."""
    max_batch_tokens: int
    """Prompt tokens per prefill forward (a longer prompt is prefilled over several steps)."""
    prefill_wait: int = 0
    """Steps a prefill forward its prompts do not fill waits while rows decode
    (``EngineSettings.prefill_wait_steps``)."""
    max_prompt_tokens: int
    """The longest prompt a slot holds (with the new tokens)."""
    cuda_graphs: bool = True
    """Replay decode steps as CUDA graphs (on a GPU)."""
    prefill_graphs: bool = False
    """Prefill new prompts at padded static shapes, as CUDA graphs with ``cuda_graphs``
    (``EngineSettings.prefill_graphs``)."""
    live_attention: bool = False
    """The engine attends over each row's live keys alone (``EngineSettings.live_attention``)."""
    compile_backend: str | None = None
    """The target's layers through ``torch.compile`` (``EngineSettings.compile_backend``); None: eager."""
    seed: int = 0
    """Sampling seed (with the request and the token's index)."""
    reuse_kv: bool | None = None
    """Keep a turn's slot for the conversation's next turn, which then prefills only what its prompt adds
    (``decode/parked.py``). None: where it was measured faster, the CPU (``slot_engine.reuses_kv``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RequestFailure:
    """Why an engine could not answer one request (the run goes on without that conversation)."""

    reason: str
    """A short failure-row reason: ``server_error``, ``timeout``, ``prompt_mismatch``, ..."""
    detail: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Finished:
    """One answered request (or one the engine gave up on: ``failure`` set, ``tokens`` empty)."""

    key: str
    tokens: GeneratedTokens
    failure: RequestFailure | None = None
    """Set when this request failed on its own (a server engine after its retries); the driver writes
    the conversation as a failure row."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineStats:
    """What an engine's steps did over a run (the decode engine's counters), summed across workers: whether
    its slots were busy, how much prefill its answers took and how much of the run was spent in its steps.

    The split of ``step_seconds`` between prefill forwards and decode steps is not measured: a step runs
    both and ends in one host sync, and timing either apart needs CUDA events inside the step."""

    engines: int = 1
    """Engines summed into this record (one per worker)."""
    slots: int
    """Rows of the engines' largest decode step (``SlotEngine.num_slots``)."""
    steps: int
    """Engine steps: each one decode step and at most one prefill forward, then one host sync."""
    slot_steps: int
    """Steps × slots: the tokens the steps could have decoded with every slot busy."""
    decoded_tokens: int
    """Tokens the decode steps produced (``DecodeEngine.num_live_rows``: stop tokens included, and the rows
    a stop dropped; each answer's first token comes from its prefill forward instead)."""
    prefills: int
    """Prefill forwards."""
    prefill_tokens: int
    """Prompt tokens run through the target by prefill (padding excluded)."""
    reused_tokens: int
    """Prompt tokens a turn found in the slot its conversation's previous turn kept (not prefilled)."""
    evictions: int
    """Slots kept for a conversation's next turn that a waiting prompt took first."""
    step_seconds: float
    """Wall time in the engines' steps; on a GPU their forwards too (each step ends in a host sync).
    Generation time outside it is host work: prompts rendered and tokenized, answers decoded and written."""

    def __add__(self, other: EngineStats) -> EngineStats:
        return EngineStats(
            **{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(EngineStats)}
        )

    def describe(self) -> str:
        """E.g. "12,345 steps decoding a mean 612.0 of 1,024 slots (60 % busy) in 30.1 s, 2,345 prefill
        forwards of 3,100,000 prompt tokens (900,000 reused, 0 kept slots evicted)"."""
        mean_rows = self.decoded_tokens / self.steps if self.steps else 0.0
        mean_slots = self.slot_steps / self.steps if self.steps else self.slots / self.engines
        busy = self.decoded_tokens / self.slot_steps if self.slot_steps else 0.0
        per_worker = " per worker" if self.engines > 1 else ""
        return (
            f"{self.steps:,} steps decoding a mean {mean_rows:,.1f} of {mean_slots:,.0f} slots "
            f"({100 * busy:.0f} % busy) in {self.step_seconds / self.engines:.1f} s{per_worker}, "
            f"{self.prefills:,} prefill forwards of {self.prefill_tokens:,} prompt tokens "
            f"({self.reused_tokens:,} reused, {self.evictions:,} kept slots evicted)"
        )


def sum_stats(stats: Sequence[EngineStats | None]) -> EngineStats | None:
    """The workers' stats summed; None when no engine reported any (a server engine)."""
    reported = [s for s in stats if s is not None]
    return sum(reported[1:], reported[0]) if reported else None


class Engine(Protocol):
    name: EngineName

    def submit(
        self, key: str, prompt: Sequence[int], *, keep_slot: bool = False, continues: str | None = None
    ) -> None:
        """Queue a request. ``keep_slot``: a request continuing this one will follow (its prompt starts
        with this prompt and answer), so an engine may keep what it computed for it; ``continues``: the
        key of that earlier request. Hints only: the answer is the same without them. A request reported
        failed keeps nothing."""
        ...

    def release(self, key: str) -> None:
        """No request will continue ``key``: drop what was kept for it (nothing when nothing was)."""
        ...

    def poll(self, timeout: float) -> list[Finished]:
        """Answers finished since the last call (waits up to ``timeout`` s for one when none is ready)."""
        ...

    def pending(self) -> int: ...

    def close(self, *, abort: bool = False) -> None: ...

    def stats(self) -> EngineStats | None:
        """What the engine's steps did so far (also after ``close``); None: an engine that cannot tell (a
        server)."""
        ...
