"""The decode engine's KV cache: a fixed set of slots, each holding one request's keys and values.

Legend: N rows of one forward, S new tokens per row, Hk key/value heads, D head dim, L slot capacity
(positions, the last one a scratch position), Lb positions a forward attends over (``attend_len``).

Per layer, K and V are preallocated ``[num_slots, Hk, L, D]`` once: their addresses never change, so a
decode step can be replayed as a CUDA graph. A request owns a slot from its prefill to its last token
(or, parked, until the request continuing it takes the slot over with its keys: ``parked.py``);
its live length lives with the scheduler (a device tensor for the steps, a host mirror for planning),
never here: a finished row's slot is reused at once by overwriting, and a speculative rollback is a
shorter length, never a copy.

The model's attention modules hand each layer's new keys and values to ``attend`` (``layer_attention``):
before each forward the caller sets ``rows`` (which slots the forward's rows are, and at which positions
each new token's key and value go); ``attend`` writes them there and attends over what the rows see.
Decode rows are slots 0..N−1 (a view, no copy); prefill rows are any slots (gathered, positions < Lb),
and a prefill of fresh prompts attends over its own new keys alone.
Rows that must not write anything real (a batch's idle slots, padding tokens) write at the scratch
position L − 1, which no mask ever shows.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dflash_offline.decode.attention import (
    LiveKeys,
    attend,
    attend_live,
    cudnn_reads_slices,
    flash_reads_live_lengths,
    live_keys,
)

CUDA_ATTEND_GRANULE = 256
"""Smallest attended length on CUDA; buckets double from it up to the capacity (each one a CUDA graph)."""

CPU_ATTEND_GRANULE = 32
"""On the CPU (no graphs to capture, the math kernel's cost grows with the attended length): finer."""


class LiveAttentionWarning(RuntimeWarning):
    """The live attention was asked for where its kernel does not run: the masked path runs instead (same
    answers, the padding attended over)."""


def default_attend_granule(device: torch.device) -> int:
    return CUDA_ATTEND_GRANULE if device.type == "cuda" else CPU_ATTEND_GRANULE


@dataclass(frozen=True, kw_only=True, slots=True)
class ForwardRows:
    """Where the rows of the next forward live in the cache."""

    num_rows: int
    """N."""
    slots_N: Tensor | None
    """int64 [N]: the slot of each row; None when the rows are slots 0..N−1 (decode: read as a view)."""
    write_NS: Tensor
    """int64 [N, S]: the cache position of each new token (the scratch position for tokens to discard)."""
    attend_len: int
    """Lb: the rows attend over positions 0..Lb−1 (every live key of every row is below it)."""
    own_keys_only: bool = False
    """Every row starts at position 0 (a prefill of fresh prompts): the rows attend causally over their own
    new keys, handed back as they are (no gather of the cache)."""
    live_keys: LiveKeys | None = None
    """The rows attend over their live keys alone, read in place (``SlotCache.live_keys``): no mask, no
    gather, no attention over the bucket's padding."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CacheShape:
    """The geometry of a slot cache."""

    num_layers: int
    num_slots: int
    num_heads: int
    """Query heads (the attention kernel's capabilities depend on the group size)."""
    num_kv_heads: int
    head_dim: int
    capacity: int
    """L: positions per slot, the scratch position included (longest request + 1)."""
    dtype: torch.dtype
    device: torch.device

    @property
    def bytes(self) -> int:
        return (
            2
            * self.num_layers
            * self.num_slots
            * self.num_kv_heads
            * self.capacity
            * self.head_dim
            * (torch.empty((), dtype=self.dtype).element_size())
        )


def kv_bytes_per_token(model_config: Any, dtype: torch.dtype) -> int:
    """Bytes of K and V one token takes in every layer of a transformers decoder config."""
    heads = int(getattr(model_config, "num_key_value_heads", None) or model_config.num_attention_heads)
    head_dim = int(
        getattr(model_config, "head_dim", None)
        or model_config.hidden_size // model_config.num_attention_heads
    )
    size = torch.empty((), dtype=dtype).element_size()
    return 2 * int(model_config.num_hidden_layers) * heads * head_dim * size


def shape_for(
    model_config: Any, *, num_slots: int, max_len: int, dtype: torch.dtype, device: torch.device
) -> CacheShape:
    """The cache for ``num_slots`` requests of at most ``max_len`` positions each (prompt + new tokens)."""
    heads = int(getattr(model_config, "num_key_value_heads", None) or model_config.num_attention_heads)
    head_dim = int(
        getattr(model_config, "head_dim", None)
        or model_config.hidden_size // model_config.num_attention_heads
    )
    return CacheShape(
        num_layers=int(model_config.num_hidden_layers),
        num_slots=num_slots,
        num_heads=int(model_config.num_attention_heads),
        num_kv_heads=heads,
        head_dim=head_dim,
        capacity=max_len + 1,
        dtype=dtype,
        device=device,
    )


class SlotCache:
    """Per-layer K/V of every slot, in place; the ``update`` target of the model's attention modules."""

    def __init__(
        self, shape: CacheShape, *, attend_granule: int | None = None, live_attention: bool = False
    ) -> None:
        self.shape = shape
        s = shape
        dims = (s.num_slots, s.num_kv_heads, s.capacity, s.head_dim)
        # Zeros, not empty: an idle row reads position 0 of its slot, which must be finite.
        self.keys = [torch.zeros(dims, dtype=s.dtype, device=s.device) for _ in range(s.num_layers)]
        self.values = [torch.zeros(dims, dtype=s.dtype, device=s.device) for _ in range(s.num_layers)]
        self.reads_slices = cudnn_reads_slices(
            s.device, s.dtype, num_heads=s.num_heads, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim
        )
        # A kernel that refuses a strided slice of the cache reads all of it (still a view, no copy).
        granule = default_attend_granule(s.device) if attend_granule is None else attend_granule
        self.attend_granule = granule if self.reads_slices else s.capacity
        self.reads_live_lengths = live_attention and flash_reads_live_lengths(
            s.device, s.dtype, num_heads=s.num_heads, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim
        )
        """Decode steps and prefills over the cache attend over each row's live keys alone, read in place
        (the flash kernel, ``attend_live``); else over the forward's bucket of positions with a mask (a
        prefill's rows gathered). Asked for with ``live_attention``, and only where the kernel runs and
        agrees with the masked one (CUDA, half precision)."""
        if live_attention and not self.reads_live_lengths:
            warnings.warn(
                LiveAttentionWarning(
                    f"the live attention over the KV cache needs the flash kernel (CUDA, half precision) "
                    f"and it does not run here ({s.device.type}, {s.dtype}): the engine attends over "
                    "buckets of positions with a mask instead (--decode-attention padded)"
                ),
                stacklevel=2,
            )
        self._rows: ForwardRows | None = None
        self._slot_NS: Tensor | None = None

    @property
    def rows(self) -> ForwardRows | None:
        """Where the next forward's rows live; set by the caller before each forward (``SlotForward``)."""
        return self._rows

    @rows.setter
    def rows(self, rows: ForwardRows | None) -> None:
        self._rows = rows
        # The slot of each new token [N, S], once a forward rather than once a layer.
        self._slot_NS = None
        if rows is not None:
            n, s = rows.write_NS.shape
            if rows.slots_N is None:
                self._slot_NS = torch.arange(n, device=rows.write_NS.device)[:, None].expand(n, s)
            else:
                self._slot_NS = rows.slots_N[:, None].expand(n, s)

    @property
    def capacity(self) -> int:
        return self.shape.capacity

    @property
    def scratch(self) -> int:
        """The position that discarded writes go to."""
        return self.shape.capacity - 1

    @property
    def max_len(self) -> int:
        """Longest request (prompt + new tokens) a slot holds."""
        return self.shape.capacity - 1

    def attend_len(self, needed: int) -> int:
        """The bucket of attended positions for keys 0..needed−1: granule × 2^k, at most the capacity."""
        assert 0 < needed <= self.max_len + 1, (needed, self.max_len)
        bucket = self.attend_granule
        while bucket < needed:
            bucket *= 2
        return min(bucket, self.capacity)

    def live_keys(self, slots_N: Tensor | None, key_counts_N: Tensor, *, queries: int) -> LiveKeys:
        """``LiveKeys`` of rows in slots ``slots_N`` (None: slots 0..N−1) seeing positions 0..count−1 of
        their slots, ``queries`` tokens a row (causal, the last one seeing count−1)."""
        return live_keys(
            slots_N, key_counts_N, queries=queries, num_kv_heads=self.shape.num_kv_heads,
            capacity=self.capacity,
        )  # fmt: skip

    def attend(
        self, layer_idx: int, q_NHSD: Tensor, k_NHSD: Tensor, v_NHSD: Tensor, mask: Tensor | None,
        *, scale: float | None = None,
    ) -> Tensor:  # fmt: skip
        """Write the forward's new keys/values [N, Hk, S, D] of layer ``layer_idx`` into their slots, and
        attend: [N, S, Hq, D]. ``mask`` is the forward's boolean mask over the attended positions (None: a
        prefill of fresh prompts, causal over their own keys, or every row over its live keys)."""
        keys, values = self._write(layer_idx, k_NHSD, v_NHSD)
        rows = self.rows
        assert rows is not None
        if rows.live_keys is not None:
            return attend_live(q_NHSD, keys, values, rows.live_keys, scale=scale)
        assert mask is None or mask.dtype == torch.bool, mask.dtype
        return attend(q_NHSD, keys, values, mask, scale=scale).transpose(1, 2).contiguous()

    def _write(self, layer_idx: int, key_states: Tensor, value_states: Tensor) -> tuple[Tensor, Tensor]:
        """Write the new keys/values into their slots; return what the rows attend over: their own new
        keys, the whole cache (live keys), or [N, Hk, Lb, D] of the rows' slots."""
        rows, slot_NS = self._rows, self._slot_NS
        assert rows is not None, "SlotCache.attend outside a slot forward"
        assert slot_NS is not None
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        # [slots, L, Hk, D] views: advanced indices (slot, position) pick one [Hk, D] row per new token.
        keys.transpose(1, 2).index_put_((slot_NS, rows.write_NS), key_states.transpose(1, 2))
        values.transpose(1, 2).index_put_((slot_NS, rows.write_NS), value_states.transpose(1, 2))
        if rows.own_keys_only:
            return key_states, value_states
        if rows.live_keys is not None:
            return keys, values
        n, lb = rows.write_NS.shape[0], rows.attend_len
        if rows.slots_N is None:
            return keys[:n, :, :lb], values[:n, :, :lb]
        return keys[:, :, :lb].index_select(0, rows.slots_N), values[:, :, :lb].index_select(0, rows.slots_N)

    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Copy a request's first ``length`` positions from slot ``src`` to slot ``dst`` (compaction)."""
        for keys, values in zip(self.keys, self.values, strict=True):
            keys[dst, :, :length] = keys[src, :, :length]
            values[dst, :, :length] = values[src, :, :length]
