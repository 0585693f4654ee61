"""What every regenerate engine shares: the ``Engine`` protocol the conversation driver calls, the records
across it (``EngineOptions`` in, ``Finished`` / ``RequestFailure`` out) and ``EngineError``. The engines
themselves are ``slot_engine.py`` (the project's decode engine, ``--engine auto|slots``) and
``openai_engine.py`` (a server, ``--engine openai``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from dflash_offline.config_fields import flag
from dflash_offline.errors import DflashError
from dflash_offline.regenerate.config import RegenerateConfig
from dflash_offline.regenerate.generation import GeneratedTokens

EngineName = Literal["slots", "openai"]

KV_FIX = (
    f"{flag(RegenerateConfig, 'kv_tokens')} (KV-cache size), {flag(RegenerateConfig, 'batch_size')}, "
    f"{flag(RegenerateConfig, 'max_batch_tokens')} or {flag(RegenerateConfig, 'max_new_tokens')}"
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
    max_prompt_tokens: int
    """The longest prompt a slot holds (with the new tokens)."""
    cuda_graphs: bool = True
    """Replay decode steps as CUDA graphs (on a GPU)."""
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
