"""Batch-1 greedy decoding on a one-slot cache: the one decode loop of ``dflash eval``.

Legend: P prompt tokens, B block size, K = B − 1 drafted tokens, F feature width, Lb attended positions.

Prefill: one target forward over the prompt gives the first new token (the first anchor) and, for a
drafter, the captured features of positions 0..P−1. Then one cycle after another, with n the position of
the anchor (the newest token, not yet run through the target):
  1. the drafter writes the previous verify block's features into its context (positions at or past n are
     hidden from it and overwritten later) and proposes d_1..d_K from [anchor, MASK × K];
  2. the target runs ONE forward over [anchor, d_1..d_K] at positions n..n+K on the slot cache, its
     captured layer features going to a static buffer; p_i is its greedy prediction for position n+i+1;
  3. a = the longest run with d_i == p_{i−1}; the new tokens are p_0..p_a (τ_cycle = a + 1); the new
     anchor is p_a and n ← n + a + 1.
All of a cycle runs on the device, as one CUDA graph per attended-length bucket; the host reads
(a, p_0..p_K) once per cycle, for the stop check. The rejected positions n+a+1.. stay in both caches,
past the new length: the next cycle overwrites them, so a rollback is a position, never a copy.

Target-only decoding is the same loop with a drafter that proposes nothing (``TARGET_ONLY``, B = 1): each
cycle is one decode step and its token, so speedup compares the same loop, clock and graphs.

A drafter that syncs with the host (``Drafter.capturable`` False: the tests' scripted drafters) runs the
same cycle eagerly.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, Protocol

import torch
from torch import Tensor

from dflash_offline.decode.drafting import StaticDrafter
from dflash_offline.decode.forward import SlotForward
from dflash_offline.decode.graphs import StepGraphs
from dflash_offline.decode.sampling import Sampler, Sampling
from dflash_offline.decode.slot_cache import ForwardRows, SlotCache, shape_for
from dflash_offline.decode.steps import PrefillChunk, SlotState, block_mask, prefill
from dflash_offline.drafter.model import DFlashDrafter
from dflash_offline.errors import ConfigError

StopReason = Literal["stop_token", "length"]


class Drafter(Protocol):
    """What the cycle asks of a drafter (``StaticDrafter``, ``TARGET_ONLY``, or a test's fake)."""

    block_size: int
    """B: the anchor plus K = B − 1 drafted tokens."""
    capturable: bool
    """Whether ``ingest`` and ``draft`` run without a host sync, so that a cycle can be a CUDA graph."""

    def ingest(self, features_CF: Tensor, start_1: Tensor) -> None:
        """Context features of positions start..start+C−1 (``start``: int64 [1]; 0 starts a prompt)."""
        ...

    def draft(self, anchor_1: Tensor, anchor_position_1: Tensor, attend_len: int) -> Tensor:
        """int64 [K] for positions anchor+1..anchor+K, from the context at positions < anchor."""
        ...


class _NoDraft:
    """Target-only decoding: a block of the anchor alone."""

    block_size = 1
    capturable = True

    def ingest(self, features_CF: Tensor, start_1: Tensor) -> None:
        pass

    def draft(self, anchor_1: Tensor, anchor_position_1: Tensor, attend_len: int) -> Tensor:
        return anchor_1[:0]


TARGET_ONLY: Drafter = _NoDraft()


@dataclass(frozen=True, kw_only=True, slots=True)
class DecodeResult:
    """The outcome of one prompt's decoding (speculative or target-only)."""

    tokens: tuple[int, ...]
    """New token ids (prompt excluded), cut after the first stop token and to max_new_tokens."""
    accepted_per_cycle: tuple[int, ...]
    """Speculative decoding: accepted draft tokens a (0..B−1) of each draft–verify cycle, in order.
    Target-only: empty."""
    stop_reason: StopReason
    """``stop_token`` when the output ends with a stop token, else ``length``."""
    prefill_seconds: float
    """Wall time of the prefill forward (excluded from the decode time)."""
    decode_seconds: float
    """Wall time from the end of the prefill to the last token (drafting included)."""
    num_target_forwards: int
    """Target forward calls after the prefill."""

    @property
    def num_cycles(self) -> int:
        return len(self.accepted_per_cycle)

    @property
    def tau(self) -> float | None:
        """Mean over cycles of (accepted + 1); None without a cycle."""
        if not self.accepted_per_cycle:
            return None
        return sum(a + 1 for a in self.accepted_per_cycle) / len(self.accepted_per_cycle)


class Clock:
    """perf_counter, synchronized with the device first so that queued kernels are counted."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._device = device

    def now(self) -> float:
        if self._cuda:
            torch.cuda.synchronize(self._device)
        return time.perf_counter()


def finish_tokens(
    tokens: list[int], *, max_new_tokens: int, stop_ids: frozenset[int]
) -> tuple[list[int], bool]:
    """Cut after the first stop token and to max_new_tokens; True when a stop token ends the output."""
    for i, t in enumerate(tokens):
        if t in stop_ids:
            tokens = tokens[: i + 1]
            break
    tokens = tokens[:max_new_tokens]
    return tokens, bool(tokens) and tokens[-1] in stop_ids


class SingleSequence:
    """Greedy batch-1 decoding of ``model`` over a one-slot cache of ``max_len`` positions."""

    def __init__(
        self,
        model: Any,
        *,
        max_len: int,
        cuda_graphs: bool = True,
        attend_granule: int | None = None,
        compile_backend: str | None = None,
    ) -> None:
        param = next(model.parameters())
        self.device = param.device
        shape = shape_for(model.config, num_slots=1, max_len=max_len, dtype=param.dtype, device=param.device)
        self.cache = SlotCache(shape, attend_granule=attend_granule)
        self.fwd = SlotForward(model, self.cache, compile_backend=compile_backend)
        self.state = SlotState(1, param.device)
        self.sampler = Sampler(Sampling())
        self.graphs = StepGraphs(param.device, enabled=cuda_graphs)
        self._static: StaticDrafter | None = None
        self._buffers: dict[tuple[int, int, torch.dtype], _CycleBuffers] = {}
        self.compile_backend = compile_backend
        """The target's decoder layers (``SlotForward``) and the drafter's layers (``StaticDrafter``)
        through ``torch.compile`` with this backend; None: eager."""

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    @property
    def target_compiled(self) -> bool:
        """Whether the target's layers run compiled (asked for, and no compiled forward has failed)."""
        return self.fwd.compiled

    @property
    def drafter_compiled(self) -> bool:
        """Whether the drafter runs compiled (False before any speculative decode)."""
        return self._static is not None and self._static.compiled

    def drafter_for(self, model: DFlashDrafter) -> StaticDrafter:
        """``model`` drafting on the device over a context cache of this cache's capacity (one at a time:
        graphs captured with another drafter are dropped)."""
        if self._static is None or self._static.model is not model:
            self._static = StaticDrafter(model, self.cache.capacity, compile_backend=self.compile_backend)
            self.graphs.clear()
        return self._static

    def target_only(
        self, prompt_ids: Sequence[int], *, max_new_tokens: int, stop_ids: frozenset[int]
    ) -> DecodeResult:
        """Plain greedy decoding: the loop with a drafter that proposes nothing."""
        return self.decode(
            prompt_ids, TARGET_ONLY, layer_ids=(), max_new_tokens=max_new_tokens, stop_ids=stop_ids
        )

    def speculative(
        self,
        prompt_ids: Sequence[int],
        drafter: DFlashDrafter | Drafter,
        *,
        layer_ids: Sequence[int],
        max_new_tokens: int,
        stop_ids: frozenset[int],
    ) -> DecodeResult:
        """Greedy speculative decoding (a ``DFlashDrafter`` drafts on the device, ``drafter_for``)."""
        on_device = self.drafter_for(drafter) if isinstance(drafter, DFlashDrafter) else drafter
        return self.decode(
            prompt_ids, on_device, layer_ids=layer_ids, max_new_tokens=max_new_tokens, stop_ids=stop_ids
        )

    @torch.inference_mode()
    def decode(
        self,
        prompt_ids: Sequence[int],
        drafter: Drafter,
        *,
        layer_ids: Sequence[int],
        max_new_tokens: int,
        stop_ids: frozenset[int],
    ) -> DecodeResult:
        """Greedy decoding of one prompt, a draft–verify cycle at a time (the module docstring)."""
        layers = tuple(int(i) for i in layer_ids)
        B, P = drafter.block_size, len(prompt_ids)
        self._check_fits(P, max_new_tokens, B)
        clock = Clock(self.device)
        t0 = clock.now()
        chunk = PrefillChunk(
            slot=0, token_ids=tuple(int(t) for t in prompt_ids), start=0, completes=True, prompt_len=P
        )
        first_1, features_1PF = prefill(self.fwd, self.state, self.sampler, [chunk], capture=layers)
        assert first_1 is not None
        width = 0 if features_1PF is None else int(features_1PF.shape[-1])
        buf = self._cycle_buffers(B, width, torch.float32 if features_1PF is None else features_1PF.dtype)
        buf.start(first_1, P)

        def step(attend_len: int) -> tuple[Hashable, Callable[[], None]]:
            key = ("cycle", id(drafter), B, width, attend_len)
            return key, partial(self._cycle, drafter, buf, layers, attend_len)

        if drafter.capturable:
            for lb in sorted({self.cache.attend_len(p) for p in range(1, P + max_new_tokens + B)}):
                self.graphs.capture(*step(lb), buf.mutated())
        t1 = clock.now()
        if features_1PF is not None:
            drafter.ingest(features_1PF[0], torch.zeros(1, dtype=torch.int64, device=self.device))
        tokens, accepted, n, checked = [int(first_1[0])], [], P, 0
        while len(tokens) < max_new_tokens and not stop_ids.intersection(tokens[checked:]):
            checked = len(tokens)
            key, run = step(self.cache.attend_len(n + B))
            if drafter.capturable:
                self.graphs.run(key, run, buf.mutated())
            else:
                run()
            a, *predictions = buf.out_1B1.tolist()  # the cycle's one host sync
            accepted.append(a)
            tokens.extend(predictions[: a + 1])
            n += a + 1
        t2 = clock.now()
        out, stopped = finish_tokens(tokens, max_new_tokens=max_new_tokens, stop_ids=stop_ids)
        return DecodeResult(
            tokens=tuple(out),
            accepted_per_cycle=tuple(accepted) if B > 1 else (),
            stop_reason="stop_token" if stopped else "length",
            prefill_seconds=t1 - t0,
            decode_seconds=t2 - t1,
            num_target_forwards=len(accepted),
        )

    def _cycle(
        self, drafter: Drafter, buf: _CycleBuffers, layer_ids: tuple[int, ...], attend_len: int
    ) -> None:
        """One draft–verify cycle on the device: draft; the target forward over [anchor, drafts] at n..n+K;
        acceptance; the next anchor and n."""
        drafter.ingest(buf.features_BF, buf.previous_n_1)
        buf.draft_K.copy_(drafter.draft(buf.anchor_1, buf.n_1, attend_len))
        B = buf.block_size
        block_1B = torch.cat([buf.anchor_1, buf.draft_K])[None]
        positions_1B = (buf.n_1 + buf.offsets_B)[None]
        rows = ForwardRows(num_rows=1, slots_N=None, write_NS=positions_1B, attend_len=attend_len)
        hidden, features = self.fwd.hidden(
            block_1B, positions_1B, block_mask(buf.n_1, B, attend_len), rows, capture=layer_ids
        )
        if features is not None:
            buf.features_BF.copy_(features[0])
        predictions_B = self.fwd.logits(hidden[0]).argmax(dim=-1)
        accepted_1 = (buf.draft_K == predictions_B[:-1]).to(torch.int64).cumprod(dim=0).sum().reshape(1)
        buf.anchor_1.copy_(predictions_B.gather(0, accepted_1))
        buf.previous_n_1.copy_(buf.n_1)
        buf.n_1.add_(accepted_1 + 1)
        buf.out_1B1.copy_(torch.cat([accepted_1, predictions_B]))

    def _check_fits(self, prompt_len: int, max_new_tokens: int, block_size: int) -> None:
        if prompt_len < 1 or max_new_tokens < 1:
            raise ConfigError(f"a prompt of {prompt_len} tokens with max_new_tokens {max_new_tokens}")
        if prompt_len + max_new_tokens + block_size > self.max_len:
            raise ConfigError(
                f"a prompt of {prompt_len} tokens + {max_new_tokens} new + a block of {block_size} exceed "
                f"the {self.max_len} positions of the decode cache"
            )

    def _cycle_buffers(self, block_size: int, feature_width: int, dtype: torch.dtype) -> _CycleBuffers:
        """One set per block size and feature width (target-only and speculative turns alternate in eval,
        each keeping its graphs)."""
        key = (block_size, feature_width, dtype)
        if key not in self._buffers:
            self._buffers[key] = _CycleBuffers(block_size, feature_width, dtype, self.device)
        return self._buffers[key]


class _CycleBuffers:
    """The cycle's device state (persistent: the cycle graphs read these very tensors)."""

    def __init__(self, block_size: int, feature_width: int, dtype: torch.dtype, device: torch.device) -> None:
        self.block_size = block_size
        self.anchor_1 = torch.zeros(1, dtype=torch.int64, device=device)
        """The newest token (not yet run through the target)."""
        self.n_1 = torch.zeros(1, dtype=torch.int64, device=device)
        """Its position: the target cache and the drafter context hold positions < n."""
        self.previous_n_1 = torch.zeros(1, dtype=torch.int64, device=device)
        """The previous cycle's anchor position, where ``features_BF`` row 0 belongs."""
        self.features_BF = torch.zeros((block_size, feature_width), dtype=dtype, device=device)
        """The latest verify block's captured features (rows past the accepted ones are stale)."""
        self.draft_K = torch.zeros(block_size - 1, dtype=torch.int64, device=device)
        self.offsets_B = torch.arange(block_size, device=device)
        self.out_1B1 = torch.zeros(block_size + 1, dtype=torch.int64, device=device)
        """What the host reads per cycle: [a, p_0..p_K]."""

    def start(self, first_1: Tensor, prompt_len: int) -> None:
        """A new prompt: anchor = its first token at position P (features of nothing pending)."""
        self.anchor_1.copy_(first_1)
        self.n_1.fill_(prompt_len)
        self.previous_n_1.fill_(prompt_len)

    def mutated(self) -> list[Tensor]:
        return [self.anchor_1, self.n_1, self.previous_n_1, self.features_BF, self.draft_K, self.out_1B1]
