"""``--engine auto`` (``slots``): regenerate's answers from the project's decode engine
(``dflash_offline.decode``), the only local engine: the fastest measured on a GPU (bench/RESULTS.md,
"Decode engine": on an H200 at batch 256, 6,658 new tok/s against 5,434 for sorted ``generate`` batches
and 1,656 for transformers' continuous batching; bench/regenerate.py measures the three side by side).

A slot holds one conversation turn: its prompt (at most --max-prompt-tokens) and its answer (at most
--max-new-tokens). The number of slots is --batch-size, or fewer when --kv-tokens (by default the free GPU
memory after loading, on the CPU --batch-size slots) cannot hold that many. Prompts wait in the engine
until a slot is free; a finished answer frees its slot for the next one at once, or, when the
conversation has another turn, keeps it with its keys and values for that turn, which then prefills only
what follows the common prefix (``decode/parked.py``), where that is the faster choice (``reuses_kv``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from dflash_offline.config_fields import field_ref
from dflash_offline.decode import DecodeEngine, DecodeError, EngineSettings, Sampling
from dflash_offline.decode.slot_cache import kv_bytes_per_token
from dflash_offline.regenerate.config import RegenerateConfig
from dflash_offline.regenerate.engine_protocol import (
    KV_FIX,
    EngineError,
    EngineName,
    EngineOptions,
    EngineStats,
    Finished,
)
from dflash_offline.regenerate.generation import GenerationSettings, split_at_stop

KV_MEMORY_FRACTION = 0.85
"""slots on CUDA without --kv-tokens: the share of the free GPU memory (after loading) the cache takes."""

ACTIVATION_RESERVE_BYTES = 4 << 30
"""Free GPU memory left beside the cache for prefill activations, logits and CUDA graphs."""


def slot_count(model: Any, options: EngineOptions, max_len: int) -> int:
    """Slots of ``max_len`` positions (+1 scratch) within the KV budget, at most --batch-size."""
    per_slot = max_len + 1
    if options.kv_tokens is not None:
        budget = options.kv_tokens
    else:
        param = next(model.parameters())
        if param.device.type != "cuda":
            return options.batch_size
        free, _ = torch.cuda.mem_get_info(param.device)
        usable = max(0, int(free * KV_MEMORY_FRACTION) - ACTIVATION_RESERVE_BYTES)
        budget = usable // kv_bytes_per_token(model.config, param.dtype)
    slots = min(options.batch_size, budget // per_slot)
    if slots < 1:
        prompt, answer = (
            field_ref(RegenerateConfig, "max_prompt_tokens"),
            field_ref(RegenerateConfig, "max_new_tokens"),
        )
        raise EngineError(
            f"the KV budget ({budget} tokens) cannot hold one slot of {per_slot} positions "
            f"({prompt} + {answer} + 1); lower {KV_FIX}"
        )
    return slots


def reuses_kv(options: EngineOptions, device: torch.device) -> bool:
    """Whether turns keep their slot for the next turn (``EngineOptions.reuse_kv``; None decides by device).

    Measured (bench/RESULTS.md): on the CPU reuse is 1.12–1.3× the conversations/s of prefilling every
    prompt whole ("Regenerate"). On an H200 with the masked attention it was 0.55× although it
    prefilled 0.16× the tokens: a continuation's chunk gathered its slot and ran the masked kernel. With the
    live attention (continuations read in place) and the prefill graphs it made 1.97× the new tok/s of the
    masked engine prefilling whole ("Regenerate"), so CUDA reuses with the live attention only."""
    if options.reuse_kv is not None:
        return options.reuse_kv
    return device.type != "cuda" or options.live_attention


class SlotEngine:
    """``DecodeEngine`` behind regenerate's ``Engine`` protocol."""

    name: EngineName = "slots"

    def __init__(self, model: Any, settings: GenerationSettings, options: EngineOptions) -> None:
        max_len = options.max_prompt_tokens + settings.max_new_tokens
        self.num_slots = slot_count(model, options, max_len)
        self._settings = settings
        self.reuses_kv = reuses_kv(options, next(model.parameters()).device)
        """Whether a turn's reuse hints are passed on (else every prompt is prefilled whole)."""
        engine_settings = EngineSettings(
            num_slots=self.num_slots,
            max_len=max_len,
            max_new_tokens=settings.max_new_tokens,
            stop_ids=settings.stop_ids,
            sampling=Sampling(temperature=settings.temperature, top_p=settings.top_p, seed=options.seed),
            prefill_tokens=options.max_batch_tokens,
            prefill_wait_steps=options.prefill_wait,
            cuda_graphs=options.cuda_graphs,
            prefill_graphs=options.prefill_graphs,
            live_attention=options.live_attention,
            compile_backend=options.compile_backend,
        )
        self._step_seconds = 0.0
        """Wall time in ``DecodeEngine.poll``, which runs the steps (``EngineStats.step_seconds``)."""
        try:
            self._engine = DecodeEngine(model, engine_settings)
        except torch.OutOfMemoryError as e:
            raise EngineError(
                f"the slot KV cache ({self.num_slots} slots of {max_len + 1} positions) does not fit "
                f"({type(e).__name__}); lower {KV_FIX}"
            ) from None

    def submit(
        self, key: str, prompt: Sequence[int], *, keep_slot: bool = False, continues: str | None = None
    ) -> None:
        if not self.reuses_kv:
            keep_slot, continues = False, None
        try:
            self._engine.submit(key, prompt, keep_slot=keep_slot, continues=continues)
        except DecodeError as e:
            raise EngineError(f"{e}; raise {field_ref(RegenerateConfig, 'max_prompt_tokens')}") from None

    def release(self, key: str) -> None:
        self._engine.release(key)

    def pending(self) -> int:
        return self._engine.pending()

    def poll(self, timeout: float) -> list[Finished]:
        start = time.perf_counter()
        try:
            done = self._engine.poll(timeout)
        except torch.OutOfMemoryError as e:
            raise EngineError(f"the target ran out of memory ({e}); lower {KV_FIX}") from None
        finally:
            self._step_seconds += time.perf_counter() - start
        return [Finished(key=d.key, tokens=split_at_stop(d.token_ids, self._settings)) for d in done]

    def close(self, *, abort: bool = False) -> None:
        self._engine.close(abort=abort)

    def stats(self) -> EngineStats:
        engine = self._engine
        return EngineStats(
            slots=self.num_slots,
            steps=engine.num_steps,
            slot_steps=engine.num_steps * self.num_slots,
            decoded_tokens=engine.num_live_rows,
            prefills=engine.num_prefills,
            prefill_tokens=engine.num_prefill_tokens,
            reused_tokens=engine.num_reused_tokens,
            evictions=engine.num_evictions,
            step_seconds=self._step_seconds,
        )
