"""What every regenerate engine shares: the ``Engine`` protocol the conversation driver calls, the records
across it (``EngineOptions`` in, ``Finished`` / ``RequestFailure`` out), ``EngineError`` and the KV budget
default. The engines themselves are in ``engines.py`` (static batches, transformers' continuous batching),
``slot_engine.py`` (the decode engine) and ``openai_engine.py`` (a server).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from dflash_offline.errors import DflashError
from dflash_offline.regenerate.generation import GeneratedTokens

EngineName = Literal["slots", "cb", "static", "openai"]

DEFAULT_KV_TOKENS = 262144
"""cb and static: the KV budget in tokens when --kv-tokens is not given."""

KV_FIX = "--kv-tokens (KV-cache size), --batch-size, --max-batch-tokens or --max-new-tokens"


class EngineError(DflashError):
    """The target could not answer (out of memory, a request the KV cache cannot hold, a dead loop)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineOptions:
    """Batching knobs of both engines (sampling is in ``GenerationSettings``)."""

    batch_size: int
    """slots: requests decoded at once; CB: requests scheduled per forward step; static: rows per
    ``generate`` call."""
    kv_tokens: int | None
    """KV-cache budget in tokens: slots × (longest prompt + new tokens + 1) (slots); the paged cache (CB);
    rows × (longest prompt + new tokens) (static). None: the free GPU memory (slots), else
    ``DEFAULT_KV_TOKENS``."""
    max_batch_tokens: int
    """slots: prompt tokens per prefill forward; CB: query tokens per forward step (decode tokens + prefill
    chunks)."""
    cuda_graphs: Literal["auto", "on", "off"] = "auto"
    """slots: decode steps as CUDA graphs (auto: on); CB: ``auto`` leaves the choice to transformers."""
    seed: int = 0
    max_prompt_tokens: int | None = None
    """slots: the longest prompt a slot holds (with max_new_tokens); required by that engine."""

    @property
    def kv_budget(self) -> int:
        """cb and static: --kv-tokens or its default."""
        return DEFAULT_KV_TOKENS if self.kv_tokens is None else self.kv_tokens


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

    def submit(self, key: str, prompt: Sequence[int]) -> None: ...

    def poll(self, timeout: float) -> list[Finished]:
        """Answers finished since the last call (waits up to ``timeout`` s for one when none is ready)."""
        ...

    def pending(self) -> int: ...

    def close(self, *, abort: bool = False) -> None: ...
