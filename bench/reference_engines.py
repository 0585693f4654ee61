"""transformers' own ways to answer many prompts, as references for the decode engine in the benches
(``bench/regenerate.py``, ``bench/decode.py``); ``dflash regenerate`` uses neither (the decode engine is
faster: bench/RESULTS.md, "Decode engine").

Both keep regenerate's engine surface (``submit`` / ``poll`` / ``pending`` / ``close``, ``Finished`` out), so
a bench drives them and ``SlotEngine`` with one loop:

- ``GenerateBatches`` (``static``): left-padded ``model.generate`` batches of the shortest waiting prompts
  (similar lengths, little padding), one batch per ``poll``, at most ``batch_size`` rows and ``kv_tokens``
  tokens (rows × (longest prompt + new tokens)).
- ``TransformersCB`` (``cb``): ``ContinuousBatchingManager`` from ``model.init_continuous_batching``:
  paged attention, a finished sequence leaves the batch at once and a waiting prompt takes its place.

Shape legend: N prompts in the batch, L longest prompt.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from dflash_offline.regenerate.engine_protocol import Finished
from dflash_offline.regenerate.generation import GenerationSettings, split_at_stop
from dflash_offline.target_model.loader import quiet_transformers

DEFAULT_KV_TOKENS = 262144
"""The KV budget in tokens when a bench gives none."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ReferenceOptions:
    """Batching knobs of the two references."""

    batch_size: int
    """static: rows per ``generate`` call; cb: requests scheduled per forward step."""
    kv_tokens: int = DEFAULT_KV_TOKENS
    """static: rows × (longest prompt + new tokens) per batch; cb: the paged cache."""
    max_batch_tokens: int = 2048
    """cb: query tokens per forward step (decode tokens + prefill chunks)."""
    cuda_graphs: Literal["auto", "on", "off"] = "auto"
    """cb: ``auto`` leaves the choice to transformers."""
    seed: int = 0
    pad_id: int = 0
    """static: the left-padding id (masked out)."""


def generation_config(settings: GenerationSettings, pad_id: int) -> Any:
    """Every knob explicit: nothing is filled in from the model's own generation config."""
    from transformers import GenerationConfig

    sampling = settings.temperature > 0
    return GenerationConfig(
        max_new_tokens=settings.max_new_tokens, do_sample=sampling,
        temperature=settings.temperature if sampling else 1.0, top_k=0,
        top_p=settings.top_p if sampling else 1.0, eos_token_id=sorted(settings.stop_ids),
        pad_token_id=pad_id,
    )  # fmt: skip


@torch.inference_mode()
def generate_batch(
    model: Any, prompts: Sequence[Sequence[int]], settings: GenerationSettings, pad_id: int
) -> list[Any]:
    """Every prompt answered in one left-padded ``generate`` call."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids_NL = torch.full((len(prompts), width), pad_id, dtype=torch.int64)
    mask_NL = torch.zeros((len(prompts), width), dtype=torch.int64)
    for row, prompt in enumerate(prompts):
        ids_NL[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.int64)
        mask_NL[row, width - len(prompt) :] = 1
    with quiet_transformers():
        out_NS = model.generate(
            input_ids=ids_NL.to(device), attention_mask=mask_NL.to(device),
            generation_config=generation_config(settings, pad_id),
        )  # fmt: skip
    return [split_at_stop(row, settings) for row in out_NS[:, width:].tolist()]


class GenerateBatches:
    """Left-padded ``generate`` batches, shortest prompts first (one batch per ``poll``)."""

    name = "static"

    def __init__(self, model: Any, settings: GenerationSettings, options: ReferenceOptions) -> None:
        self._model = model
        self._settings = settings
        self._options = options
        self._queue: dict[str, tuple[int, ...]] = {}

    def submit(self, key: str, prompt: Sequence[int]) -> None:
        self._queue[key] = tuple(prompt)

    def pending(self) -> int:
        return len(self._queue)

    def next_batch(self) -> list[str]:
        """The shortest prompts, as many as ``batch_size`` and ``kv_tokens`` allow (at least one)."""
        batch: list[str] = []
        for key in sorted(self._queue, key=lambda k: len(self._queue[k])):
            rows = len(batch) + 1
            width = len(self._queue[key]) + self._settings.max_new_tokens  # the longest row so far
            if batch and (rows > self._options.batch_size or rows * width > self._options.kv_tokens):
                break
            batch.append(key)
        return batch

    def poll(self, timeout: float) -> list[Finished]:
        if not self._queue:
            time.sleep(min(timeout, 0.01))
            return []
        keys = self.next_batch()
        prompts = [self._queue.pop(k) for k in keys]
        results = generate_batch(self._model, prompts, self._settings, self._options.pad_id)
        return [Finished(key=k, tokens=r) for k, r in zip(keys, results, strict=True)]

    def close(self, *, abort: bool = False) -> None:
        self._queue.clear()


class TransformersCB:
    """transformers' ``ContinuousBatchingManager``: requests join and leave the running batch one by one."""

    name = "cb"

    def __init__(self, model: Any, settings: GenerationSettings, options: ReferenceOptions) -> None:
        from transformers import ContinuousBatchingConfig

        self._settings = settings
        self._eos = sorted(settings.stop_ids) or [-1]
        self._pending: set[str] = set()
        defaults = ContinuousBatchingConfig()  # tokens per block: block_size in 5.17, page_size from 5.18 on
        block_size = int(getattr(defaults, "page_size", None) or getattr(defaults, "block_size", None) or 256)
        cb_config = ContinuousBatchingConfig(
            num_blocks=max(1, math.ceil(options.kv_tokens / block_size)),
            max_batch_tokens=options.max_batch_tokens,
            max_requests_per_batch=min(options.batch_size, options.max_batch_tokens),
            use_cuda_graph={"auto": None, "on": True, "off": False}[options.cuda_graphs],
            seed=options.seed,
            allow_block_sharing=False,  # no KV reuse across requests: each answer from its own prompt
        )
        self._quiet = quiet_transformers()
        self._quiet.__enter__()  # the manager's thread logs per request
        try:
            self._manager = model.init_continuous_batching(
                generation_config=generation_config(settings, options.pad_id),
                continuous_batching_config=cb_config,
            )
            if not self._manager.warmed_up:
                self._manager.warmup()  # captures the CUDA graphs when they are on; else builds the cache
            self._manager.start()
        except BaseException:
            self._quiet.__exit__(None, None, None)
            raise

    def submit(self, key: str, prompt: Sequence[int]) -> None:
        self._manager.add_request(
            input_ids=list(prompt), request_id=key, max_new_tokens=self._settings.max_new_tokens,
            eos_token_id=self._eos,
        )  # fmt: skip
        self._pending.add(key)

    def pending(self) -> int:
        return len(self._pending)

    def poll(self, timeout: float) -> list[Finished]:
        done: list[Finished] = []
        wait = timeout
        while (result := self._manager.get_result(timeout=wait)) is not None:
            wait = 0.0  # drain what is ready without waiting again
            if not result.is_finished() or result.request_id not in self._pending:
                continue
            self._pending.discard(result.request_id)
            if result.error is not None:
                raise RuntimeError(f"continuous batching failed request {result.request_id}: {result.error}")
            tokens = split_at_stop(result.generated_tokens, self._settings)
            done.append(Finished(key=result.request_id, tokens=tokens))
        if not done and self._pending and not self._manager.is_running():
            raise RuntimeError(f"continuous batching stopped with {len(self._pending)} requests unanswered")
        return done

    def close(self, *, abort: bool = False) -> None:
        try:
            self._manager.stop(block=True, timeout=60, hard_stop=abort or bool(self._pending))
            destroy = getattr(self._manager, "destroy", None)
            if callable(destroy):
                destroy()
        finally:
            self._pending.clear()
            self._quiet.__exit__(None, None, None)


def reference_engine(
    name: str, model: Any, settings: GenerationSettings, options: ReferenceOptions
) -> GenerateBatches | TransformersCB:
    """``static`` or ``cb``."""
    if name == "static":
        return GenerateBatches(model, settings, options)
    if name == "cb":
        return TransformersCB(model, settings, options)
    raise ValueError(f"no reference engine {name!r}: static or cb")
