"""The ways a worker gets answers from the target: the project's decode engine, transformers' continuous
batching, or static batches.

All take prompts as they become ready (``submit``) and hand back finished answers (``poll``), so the
conversation driver (``driver.py``) is the same for all and a multi-turn conversation's next turn joins
as soon as its previous answer is back.

``SlotEngine`` (the default, ``--engine slots``) is ``dflash_offline.decode``'s continuous batching: a
slot KV cache read in place by one attention call per layer, chunked prefill, CUDA-graph decode steps
(bench/RESULTS.md, "Decode engine", for its speed against the two below). Sampled answers depend only on
(--seed, the request, the token's index), not on the batch.
``ContinuousEngine`` (CUDA default) drives ``ContinuousBatchingManager`` from
``model.init_continuous_batching``: paged attention (transformers switches the model to its paged
implementation of the loaded attention), a finished sequence leaves the batch at once and a waiting
prompt takes its place. ``StaticEngine`` (CPU default, and the fallback) runs left-padded ``generate``
batches of the shortest waiting prompts, so a batch holds prompts of similar length (little padding).
Greedy answers are the same on both (tests/regenerate/test_engines.py); sampled ones are not (one
random stream per batch).
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Sequence
from typing import Any, Literal

import torch

from dflash_offline.regenerate.engine_protocol import (
    KV_FIX,
    Engine,
    EngineError,
    EngineName,
    EngineOptions,
    Finished,
)
from dflash_offline.regenerate.generation import (
    GenerationSettings,
    generate_batch,
    generation_config,
    split_at_stop,
)
from dflash_offline.regenerate.slot_engine import SlotEngine
from dflash_offline.target_model.loader import quiet_transformers

STALL_SECONDS = 600.0
"""CB: no answer for this long with requests in flight fails the engine (``auto`` then hands over)."""


def _kv_error(e: BaseException, where: str) -> EngineError:
    return EngineError(f"the target ran out of memory ({where}: {type(e).__name__}: {e}); lower {KV_FIX}")


class StaticEngine:
    """Left-padded ``generate`` batches, shortest prompts first (one batch per ``poll``)."""

    name: EngineName = "static"

    def __init__(self, model: Any, settings: GenerationSettings, options: EngineOptions) -> None:
        self._model = model
        self._settings = settings
        self._options = options
        self._queue: dict[str, tuple[int, ...]] = {}

    def submit(self, key: str, prompt: Sequence[int]) -> None:
        assert key not in self._queue
        self._queue[key] = tuple(prompt)

    def pending(self) -> int:
        return len(self._queue)

    def next_batch(self) -> list[str]:
        """The keys of the next batch: the shortest prompts, as many as --batch-size and --kv-tokens allow
        (at least one)."""
        by_length = sorted(self._queue, key=lambda k: len(self._queue[k]))
        batch: list[str] = []
        for key in by_length:
            rows = len(batch) + 1
            width = len(self._queue[key]) + self._settings.max_new_tokens  # the longest row so far
            if batch and (rows > self._options.batch_size or rows * width > self._options.kv_budget):
                break
            batch.append(key)
        return batch

    def poll(self, timeout: float) -> list[Finished]:
        if not self._queue:
            time.sleep(min(timeout, 0.01))
            return []
        keys = self.next_batch()
        prompts = [self._queue.pop(k) for k in keys]
        try:
            results = generate_batch(self._model, prompts, self._settings)
        except torch.OutOfMemoryError as e:
            raise _kv_error(
                e, f"static batch of {len(prompts)} prompts up to {len(prompts[-1])} tokens"
            ) from None
        return [Finished(key=k, tokens=r) for k, r in zip(keys, results)]

    def close(self, *, abort: bool = False) -> None:
        self._queue.clear()


# The transformers API the CB path uses; checked at run time (continuous_batching_support) because it
# moves between releases (verified present with these names in 5.17.0 and 5.24.0).
_CB_CONFIG_FIELDS = ("num_blocks", "max_batch_tokens", "max_requests_per_batch", "use_cuda_graph", "seed")
_CB_ADD_REQUEST_ARGS = ("input_ids", "request_id", "max_new_tokens", "eos_token_id")
_CB_MANAGER_METHODS = ("add_request", "get_result", "start", "stop", "warmup", "is_running")


def continuous_batching_support(model: Any) -> str | None:
    """None when this transformers offers the continuous-batching API the CB engine uses, else why not."""
    try:
        import transformers
        from transformers import ContinuousBatchingConfig
        from transformers.generation.continuous_batching import ContinuousBatchingManager
    except ImportError as e:
        return f"transformers has no continuous batching ({e})"
    version = transformers.__version__
    if not callable(getattr(model, "init_continuous_batching", None)):
        return f"transformers {version}: the model has no init_continuous_batching"
    fields = inspect.signature(ContinuousBatchingConfig).parameters
    missing = [f for f in _CB_CONFIG_FIELDS if f not in fields]
    missing += [m for m in _CB_MANAGER_METHODS if not callable(getattr(ContinuousBatchingManager, m, None))]
    add_args = inspect.signature(ContinuousBatchingManager.add_request).parameters
    missing += [f"add_request({a})" for a in _CB_ADD_REQUEST_ARGS if a not in add_args]
    if missing:
        return f"transformers {version}: the continuous-batching API lacks {', '.join(missing)}"
    return None


class ContinuousEngine:
    """transformers' ``ContinuousBatchingManager``: requests join and leave the running batch one by one."""

    name: EngineName = "cb"

    def __init__(self, model: Any, settings: GenerationSettings, options: EngineOptions) -> None:
        from transformers import ContinuousBatchingConfig

        self._settings = settings
        self._eos = sorted(settings.stop_ids) or [-1]
        self._pending: set[str] = set()
        self._last_answer = time.monotonic()
        defaults = ContinuousBatchingConfig()  # tokens per block: block_size in 5.17, page_size from 5.18 on
        block_size = int(getattr(defaults, "page_size", None) or getattr(defaults, "block_size", None) or 256)
        graphs = {"auto": None, "on": True, "off": False}[options.cuda_graphs]
        cb_config = ContinuousBatchingConfig(
            num_blocks=max(1, math.ceil(options.kv_budget / block_size)),
            max_batch_tokens=options.max_batch_tokens,
            max_requests_per_batch=min(options.batch_size, options.max_batch_tokens),
            use_cuda_graph=graphs,
            seed=options.seed,
            # No KV reuse across requests: every answer is computed from its own prompt alone.
            allow_block_sharing=False,
        )
        self._quiet = quiet_transformers()
        self._quiet.__enter__()  # the manager's thread logs per request; our knobs are explicit
        try:
            self._manager = model.init_continuous_batching(
                generation_config=generation_config(settings), continuous_batching_config=cb_config
            )
            if not self._manager.warmed_up:
                self._manager.warmup()  # captures the CUDA graphs when they are on; else builds the cache
            self._manager.start()
        except (MemoryError, torch.OutOfMemoryError) as e:
            self._quiet.__exit__(None, None, None)
            raise _kv_error(e, "allocating the paged KV cache") from None
        except BaseException:
            self._quiet.__exit__(None, None, None)
            raise

    def submit(self, key: str, prompt: Sequence[int]) -> None:
        assert key not in self._pending
        request_id = self._manager.add_request(
            input_ids=list(prompt),
            request_id=key,
            max_new_tokens=self._settings.max_new_tokens,
            eos_token_id=self._eos,
        )
        if request_id is None:
            raise self._dead("it refused a request")
        self._pending.add(key)

    def pending(self) -> int:
        return len(self._pending)

    def _dead(self, what: str) -> EngineError:
        fatal = getattr(getattr(self._manager, "background_thread_status", None), "fatal_error", None)
        text = f"{type(fatal).__name__}: {fatal}" if fatal is not None else "no error recorded"
        hint = f"; lower {KV_FIX}" if "memory" in text.lower() or "schedul" in text.lower() else ""
        return EngineError(f"continuous batching stopped ({what}; {text}){hint}")

    def poll(self, timeout: float) -> list[Finished]:
        done: list[Finished] = []
        wait = timeout
        while True:
            result = self._manager.get_result(timeout=wait)
            if result is None:
                break
            wait = 0.0  # drain what is ready without waiting again
            if not result.is_finished() or result.request_id not in self._pending:
                continue
            self._pending.discard(result.request_id)
            if result.error is not None:
                hint = f"; lower {KV_FIX}" if "memory" in str(result.error).lower() else ""
                raise EngineError(
                    f"continuous batching failed request {result.request_id}: {result.error}{hint}"
                )
            done.append(
                Finished(key=result.request_id, tokens=split_at_stop(result.generated_tokens, self._settings))
            )
        now = time.monotonic()
        if done or not self._pending:
            self._last_answer = now
        elif not self._manager.is_running():
            raise self._dead(f"{len(self._pending)} requests unanswered")
        elif now - self._last_answer > STALL_SECONDS:
            # A step takes milliseconds: minutes without any answer is a hung loop, not a slow one.
            raise self._dead(
                f"no answer in {STALL_SECONDS:.0f} s with {len(self._pending)} requests in flight"
            )
        return done

    def close(self, *, abort: bool = False) -> None:
        try:
            # hard_stop drops the requests in flight (an interrupted run redoes those conversations).
            self._manager.stop(block=True, timeout=60, hard_stop=abort or bool(self._pending))
            destroy = getattr(self._manager, "destroy", None)
            if callable(destroy):
                destroy()
        finally:
            self._pending.clear()
            self._quiet.__exit__(None, None, None)


class FallbackEngine:
    """Continuous batching that hands over to static batches if it fails (``--engine auto`` on a GPU): the
    prompts in flight are resubmitted, so no conversation is lost or answered twice. Out-of-memory errors
    are not handed over (static batches would need the same memory): they stop the run with the fix."""

    def __init__(self, primary: Engine, fallback: Any, note: Any) -> None:
        self._engine: Engine = primary
        self._make_fallback = fallback
        self._note = note
        self._prompts: dict[str, tuple[int, ...]] = {}
        self.name: EngineName = primary.name

    def _hand_over(self, error: BaseException) -> None:
        if self._engine.name == "static" or "out of memory" in str(error):
            raise error
        self._note(f"regenerate: continuous batching failed ({type(error).__name__}: {error}); "
                   f"continuing with static batches ({len(self._prompts)} prompts resubmitted)")  # fmt: skip
        try:
            self._engine.close(abort=True)
        except Exception as e:  # the failed engine may fail to close too; the run goes on without it
            self._note(f"regenerate: closing continuous batching failed too ({type(e).__name__}: {e})")
        self._engine = self._make_fallback()
        self.name = self._engine.name
        for key, prompt in self._prompts.items():
            self._engine.submit(key, prompt)

    def submit(self, key: str, prompt: Sequence[int]) -> None:
        self._prompts[key] = tuple(prompt)
        try:
            self._engine.submit(key, prompt)
        except Exception as e:
            self._hand_over(e)

    def pending(self) -> int:
        return len(self._prompts)

    def poll(self, timeout: float) -> list[Finished]:
        try:
            done = self._engine.poll(timeout)
        except Exception as e:
            self._hand_over(e)
            return []
        for f in done:
            self._prompts.pop(f.key, None)
        return done

    def close(self, *, abort: bool = False) -> None:
        self._prompts.clear()
        self._engine.close(abort=abort)


def make_engine(
    name: Literal["auto", "slots", "cb", "static"],
    model: Any,
    settings: GenerationSettings,
    options: EngineOptions,
    *,
    note: Any = print,
) -> Engine:
    """The engine ``name`` asks for; ``auto`` is the decode engine (``slots``), the fastest measured on a
    GPU and the CPU alike (bench/RESULTS.md, "Decode engine"). ``cb`` hands over to static batches if it
    fails, with a ``note`` saying why."""
    if name in ("auto", "slots"):
        return SlotEngine(model, settings, options)
    if name == "static":
        return StaticEngine(model, settings, options)
    reason = continuous_batching_support(model)
    if reason is not None:
        raise EngineError(f"--engine cb: {reason}; use --engine slots or static")
    try:
        primary = ContinuousEngine(model, settings, options)
    except EngineError:
        raise  # out of memory: static batches would not fit either; the message names the fix
    return FallbackEngine(primary, lambda: StaticEngine(model, settings, options), note)
