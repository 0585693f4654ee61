"""Batch-1 greedy decoding on a one-slot cache: the target-only loop and the speculative cycle of eval.

Legend: P prompt tokens, B block size, K = B − 1 drafted tokens, F feature width, Lb attended positions.

Target-only: one prefill forward over the prompt gives the first token; then one decode step per token
(a CUDA graph per attended-length bucket), one host read per token for the stop check.

Speculative (the cycle ``eval/speculative.py`` describes), with n the position of the anchor (the newest
token, not yet run through the target): the drafter writes the previous block's features into its
static context and proposes d_1..d_K from [anchor, MASK × K]; the target runs ONE forward over
[anchor, d_1..d_K] at positions n..n+K on the slot cache, its captured layer features going to a static
buffer; a = the longest run with d_i == p_{i−1}; the new anchor is p_a and n ← n + a + 1. All of it runs
on the device, as one CUDA graph per bucket; the host reads (a, p_0..p_K) once per cycle. The rejected
positions n+a+1.. stay in both caches, past the new length: the next cycle overwrites them.

A host-side drafter (``BlockDrafter``: the tests' scripted drafters) gets the accepted positions'
features and proposes on the host; the verify half still runs on the device.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, Protocol, cast

import torch
from torch import Tensor

from dflash_offline.decode.drafting import StaticDrafter
from dflash_offline.decode.forward import SlotForward
from dflash_offline.decode.graphs import StepGraphs
from dflash_offline.decode.sampling import Sampler, Sampling
from dflash_offline.decode.slot_cache import ForwardRows, SlotCache, shape_for
from dflash_offline.decode.steps import PrefillChunk, SlotState, block_mask, decode_step, prefill
from dflash_offline.drafter.model import DFlashDrafter
from dflash_offline.errors import ConfigError

StopReason = Literal["stop_token", "length"]


class BlockDrafter(Protocol):
    """A drafter proposing on the host (``eval.speculative.DFlashBlockDrafter``, or a test's fake)."""

    @property
    def block_size(self) -> int:
        """B: the anchor plus K = B − 1 drafted tokens."""
        ...

    def reset(self) -> None:
        """Forget the context of the previous prompt."""
        ...

    def propose(self, *, new_features_CF: Tensor, anchor_token: int, anchor_position: int) -> Tensor:
        """int64 [K]: draft tokens for positions anchor_position+1..anchor_position+K.

        ``new_features_CF`` are the features of the positions the drafter has not seen yet; together
        with the earlier calls since ``reset`` they cover positions 0..anchor_position−1 exactly."""
        ...


@dataclass(frozen=True, kw_only=True, slots=True)
class DecodeResult:
    """The outcome of one prompt's decoding (speculative or target-only)."""

    tokens: tuple[int, ...]
    """New token ids (prompt excluded), cut after the first stop token and to max_new_tokens."""
    accepted_per_cycle: tuple[int, ...]
    """Speculative loop: accepted draft tokens a (0..B−1) of each draft–verify cycle, in order.
    Target-only loop: empty."""
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


def is_done(tokens: list[int], *, max_new_tokens: int, stop_ids: frozenset[int], checked: int) -> bool:
    return len(tokens) >= max_new_tokens or any(t in stop_ids for t in tokens[checked:])


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
        self._drafters: dict[int, StaticDrafter] = {}
        self._spec: _SpecBuffers | None = None
        self.compile_backend = compile_backend
        """The target's decoder layers (``SlotForward``) and the speculative cycle's drafter layers
        (``StaticDrafter``) through ``torch.compile`` with this backend; None: eager."""

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    @property
    def target_compiled(self) -> bool:
        """Whether the target's layers run compiled (asked for, and no compiled forward has failed)."""
        return self.fwd.compiled

    @property
    def drafter_compiled(self) -> bool:
        """Whether the speculative cycle's drafter runs compiled (False before any speculative decode)."""
        return any(d.compiled for d in self._drafters.values())

    def _check_fits(self, prompt_len: int, max_new_tokens: int, block_size: int = 1) -> None:
        if prompt_len < 1 or max_new_tokens < 1:
            raise ConfigError(f"a prompt of {prompt_len} tokens with max_new_tokens {max_new_tokens}")
        if prompt_len + max_new_tokens + block_size > self.max_len:
            raise ConfigError(
                f"a prompt of {prompt_len} tokens + {max_new_tokens} new + a block of {block_size} exceed "
                f"the {self.max_len} positions of the decode cache"
            )

    def _buckets(self, longest: int) -> list[int]:
        """Every attended-length bucket of the steps that attend over at most ``longest`` positions."""
        return sorted({self.cache.attend_len(p) for p in range(1, longest + 1)})

    def _prefill(
        self, prompt_ids: Sequence[int], capture: Sequence[int] = ()
    ) -> tuple[Tensor, Tensor | None]:
        chunk = PrefillChunk(
            slot=0, token_ids=tuple(int(t) for t in prompt_ids), start=0, completes=True,
            prompt_len=len(prompt_ids),
        )  # fmt: skip
        first_M, features = prefill(self.fwd, self.state, self.sampler, [chunk], capture=capture)
        assert first_M is not None
        return first_M, features

    # ----- target only ----------------------------------------------------------------------------

    def _decode_body(self, attend_len: int) -> None:
        decode_step(self.fwd, self.state, self.sampler, 1, attend_len)

    @torch.inference_mode()
    def target_only(
        self, prompt_ids: Sequence[int], *, max_new_tokens: int, stop_ids: frozenset[int]
    ) -> DecodeResult:
        """Plain greedy decoding: the speculative loop with a block of one token."""
        P = len(prompt_ids)
        self._check_fits(P, max_new_tokens)
        clock = Clock(self.device)
        t0 = clock.now()
        first_M, _ = self._prefill(prompt_ids)
        tokens = [int(first_M[0])]
        for lb in self._buckets(P + max_new_tokens):
            self.graphs.capture(("decode", lb), partial(self._decode_body, lb), self.state.mutated())
        t1 = clock.now()
        length, forwards = P, 0
        while not is_done(tokens, max_new_tokens=max_new_tokens, stop_ids=stop_ids, checked=len(tokens) - 1):
            lb = self.cache.attend_len(length + 1)
            self.graphs.run(("decode", lb), partial(self._decode_body, lb), self.state.mutated())
            tokens.append(int(self.state.sampled[0]))  # the token's one host sync
            length += 1
            forwards += 1
        t2 = clock.now()
        out, stopped = finish_tokens(tokens, max_new_tokens=max_new_tokens, stop_ids=stop_ids)
        return DecodeResult(
            tokens=tuple(out),
            accepted_per_cycle=(),
            stop_reason="stop_token" if stopped else "length",
            prefill_seconds=t1 - t0,
            decode_seconds=t2 - t1,
            num_target_forwards=forwards,
        )

    # ----- speculative ----------------------------------------------------------------------------

    def _spec_buffers(self, block_size: int, feature_width: int, dtype: torch.dtype) -> _SpecBuffers:
        spec = self._spec
        if spec is None or spec.block_size != block_size or spec.features_BF.shape[1] != feature_width:
            spec = _SpecBuffers(block_size, feature_width, dtype, self.device)
            self._spec = spec
            self.graphs.clear()  # graphs of another block size read other buffers
        return spec

    def _verify(self, spec: _SpecBuffers, layer_ids: tuple[int, ...], attend_len: int) -> None:
        """Target forward over [anchor, drafts] at n..n+K; acceptance; the next anchor and n."""
        B = spec.block_size
        block_1B = torch.cat([spec.anchor_1, spec.draft_K])[None]
        positions_1B = (spec.n_1 + spec.offsets_B)[None]
        rows = ForwardRows(num_rows=1, slots_N=None, write_NS=positions_1B, attend_len=attend_len)
        hidden, features = self.fwd.hidden(
            block_1B, positions_1B, block_mask(spec.n_1, B, attend_len), rows, capture=layer_ids
        )
        assert features is not None
        spec.features_BF.copy_(features[0])
        predictions_B = self.fwd.logits(hidden[0]).argmax(dim=-1)
        accepted_1 = (spec.draft_K == predictions_B[:-1]).to(torch.int64).cumprod(dim=0).sum().reshape(1)
        spec.anchor_1.copy_(predictions_B.gather(0, accepted_1))
        spec.previous_n_1.copy_(spec.n_1)
        spec.n_1.add_(accepted_1 + 1)
        spec.out_1B1.copy_(torch.cat([accepted_1, predictions_B]))

    def _cycle(
        self, drafter: StaticDrafter, spec: _SpecBuffers, layer_ids: tuple[int, ...], attend_len: int
    ) -> None:
        """One whole draft–verify cycle on the device."""
        drafter.ingest(spec.features_BF, spec.previous_n_1)
        spec.draft_K.copy_(drafter.draft(spec.anchor_1, spec.n_1, attend_len))
        self._verify(spec, layer_ids, attend_len)

    def _static_drafter(self, model: DFlashDrafter) -> StaticDrafter:
        drafter = self._drafters.get(id(model))
        if drafter is None:
            drafter = StaticDrafter(model, self.cache.capacity, compile_backend=self.compile_backend)
            self._drafters = {id(model): drafter}
            self.graphs.clear()
        return drafter

    @torch.inference_mode()
    def speculative(
        self,
        prompt_ids: Sequence[int],
        drafter: DFlashDrafter | BlockDrafter,
        *,
        layer_ids: Sequence[int],
        max_new_tokens: int,
        stop_ids: frozenset[int],
    ) -> DecodeResult:
        """Greedy speculative decoding of one prompt (see the module docstring)."""
        layers = tuple(int(i) for i in layer_ids)
        host: BlockDrafter | None = None if isinstance(drafter, DFlashDrafter) else drafter
        static = self._static_drafter(drafter) if isinstance(drafter, DFlashDrafter) else None
        B = static.block_size if static is not None else cast(BlockDrafter, host).block_size
        P = len(prompt_ids)
        self._check_fits(P, max_new_tokens, B)
        clock = Clock(self.device)
        t0 = clock.now()
        first_M, features_1PF = self._prefill(prompt_ids, capture=layers)
        assert features_1PF is not None
        spec = self._spec_buffers(B, int(features_1PF.shape[-1]), features_1PF.dtype)
        spec.start(first_M, P)
        tokens = [int(first_M[0])]

        def step_for(attend_len: int) -> tuple[tuple[object, ...], Callable[[], None]]:
            if static is not None:
                return ("cycle", B, attend_len), partial(self._cycle, static, spec, layers, attend_len)
            return ("verify", B, attend_len), partial(self._verify, spec, layers, attend_len)

        for lb in self._buckets(P + max_new_tokens + B - 1):
            self.graphs.capture(*step_for(lb), spec.mutated())
        t1 = clock.now()
        if static is not None:
            static.ingest(features_1PF[0], torch.zeros(1, dtype=torch.int64, device=self.device))
        if host is not None:
            host.reset()
        new_features_CF = features_1PF[0]
        n, accepted, checked = P, [], 0
        while not is_done(tokens, max_new_tokens=max_new_tokens, stop_ids=stop_ids, checked=checked):
            checked = len(tokens)
            if host is not None:
                _host_draft(host, spec, new_features_CF, anchor_token=tokens[-1], anchor_position=n)
            self.graphs.run(*step_for(self.cache.attend_len(n + B)), spec.mutated())
            a, *predictions = spec.out_1B1.tolist()  # the cycle's one host sync
            accepted.append(a)
            tokens.extend(predictions[: a + 1])
            if host is not None:
                new_features_CF = spec.features_BF[: a + 1].clone()
            n += a + 1
        t2 = clock.now()
        out, stopped = finish_tokens(tokens, max_new_tokens=max_new_tokens, stop_ids=stop_ids)
        return DecodeResult(
            tokens=tuple(out),
            accepted_per_cycle=tuple(accepted),
            stop_reason="stop_token" if stopped else "length",
            prefill_seconds=t1 - t0,
            decode_seconds=t2 - t1,
            num_target_forwards=len(accepted),
        )


def _host_draft(
    host: BlockDrafter,
    spec: _SpecBuffers,
    new_features_CF: torch.Tensor,
    *,
    anchor_token: int,
    anchor_position: int,
) -> None:
    """A host drafter's proposal for the block at ``anchor_position``, into the cycle's draft buffer."""
    B = spec.block_size
    draft_K = host.propose(
        new_features_CF=new_features_CF, anchor_token=anchor_token, anchor_position=anchor_position
    )
    assert draft_K.shape == (B - 1,), f"the drafter proposed {tuple(draft_K.shape)}, expected {B - 1}"
    spec.draft_K.copy_(draft_K)


class _SpecBuffers:
    """The speculative cycle's device state (persistent: the cycle graphs read these very tensors)."""

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
