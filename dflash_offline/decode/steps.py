"""The two forwards of the engine: a decode step over slots 0..N−1, and a prefill chunk over any slots.

Legend: N rows, S tokens per row, Lb attended positions, P prompt tokens, M rows completing their prompt.

Per-slot state lives on the device (``SlotState``) so a decode step needs nothing from the host: the
next input token, the live length (positions held in the cache), whether the slot is decoding, the
request's sampling key and the index of its next token. A decode step over slots 0..N−1 feeds each live
row its token at position ``lens``, samples the next one, and advances the live rows; idle rows (free
slots, or prompts still in prefill) run too, so that N is a fixed bucket, but write only to the scratch
position and read only position 0 (a masked-out key contributes nothing; a row seeing none is NaN).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dflash_offline.decode.attention import LiveKeys
from dflash_offline.decode.forward import SlotForward
from dflash_offline.decode.host_copy import int64_on, to_device
from dflash_offline.decode.sampling import Sampler
from dflash_offline.decode.slot_cache import ForwardRows, SlotCache


class SlotState:
    """Per-slot decode state on the device (persistent: CUDA graphs read these very tensors)."""

    def __init__(self, num_slots: int, device: torch.device) -> None:
        def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.tokens = zeros(num_slots)
        """int64: the next input token (the last one sampled)."""
        self.lens = zeros(num_slots)
        """int64: positions held in the cache (the next token goes at this position)."""
        self.live = zeros(num_slots, dtype=torch.bool)
        """Whether the slot is decoding."""
        self.keys = zeros(num_slots, 2)
        """int64 [slots, 2]: the request's sampling key (``request_key_hash``)."""
        self.steps = zeros(num_slots)
        """int64: index in the answer of the token sampled next."""
        self.sampled = zeros(num_slots)
        """int64: the tokens sampled by the latest decode step."""

    def mutated(self) -> list[Tensor]:
        """What a decode step changes (restored after a graph's warm-up runs)."""
        return [self.tokens, self.lens, self.steps, self.sampled]


def decode_mask(lens_N: Tensor, live_N: Tensor, attend_len: int) -> Tensor:
    """bool [N, 1, 1, Lb]: a live row sees positions 0..lens (its new token included); an idle one only 0."""
    p_L = torch.arange(attend_len, device=lens_N.device)
    mask_NL = torch.where(live_N[:, None], p_L[None, :] <= lens_N[:, None], p_L[None, :] == 0)
    return mask_NL[:, None, None, :]


def block_mask(start_N: Tensor, num_tokens: int, attend_len: int) -> Tensor:
    """bool [N, 1, S, Lb]: token q of a block starting at ``start`` sees positions 0..start+q (causal)."""
    p_L = torch.arange(attend_len, device=start_N.device)
    q_S = torch.arange(num_tokens, device=start_N.device)
    return (p_L[None, None, :] <= (start_N[:, None] + q_S[None, :])[:, :, None])[:, None]


def decode_step(fwd: SlotForward, state: SlotState, sampler: Sampler, num_rows: int, attend_len: int) -> None:
    """One token for every live slot among 0..N−1; the tokens land in ``state.sampled[:N]``."""
    n = num_rows
    live_N, lens_N = state.live[:n], state.lens[:n]
    write_N1 = torch.where(live_N, lens_N, fwd.cache.scratch)[:, None]
    if fwd.cache.reads_live_lengths:
        # A live row sees positions 0..lens (its new token included), an idle one position 0 alone.
        live = fwd.cache.live_keys(None, torch.where(live_N, lens_N + 1, 1), queries=1)
        rows = ForwardRows(num_rows=n, slots_N=None, write_NS=write_N1, attend_len=attend_len, live_keys=live)
        mask = None
    else:
        rows = ForwardRows(num_rows=n, slots_N=None, write_NS=write_N1, attend_len=attend_len)
        mask = decode_mask(lens_N, live_N, attend_len)
    hidden, _ = fwd.hidden(state.tokens[:n, None], write_N1, mask, rows)
    next_N = sampler(fwd.logits(hidden[:, -1]), state.keys[:n], state.steps[:n])
    state.sampled[:n].copy_(next_N)
    state.tokens[:n].copy_(torch.where(live_N, next_N, state.tokens[:n]))
    advance_N = live_N.to(torch.int64)
    state.lens[:n].add_(advance_N)
    state.steps[:n].add_(advance_N)


@dataclass(frozen=True, kw_only=True, slots=True)
class PrefillChunk:
    """Part of one prompt to run through the target."""

    slot: int
    token_ids: tuple[int, ...]
    """The prompt's tokens at positions start..start+len−1."""
    start: int
    completes: bool
    """The chunk ends the prompt: its last token's logits give the answer's first token."""
    prompt_len: int


@dataclass(frozen=True, kw_only=True, slots=True)
class PrefillShape:
    """The shape of one prefill forward's attention (what a kernel may plan per shape for)."""

    rows: int
    """N, idle rows included."""
    width: int
    """S: tokens per row, padding included."""
    attend_len: int
    """Lb: the bucket of positions the rows attend over (unused when ``fresh``: they attend over their own
    S keys)."""
    fresh: bool
    """Every row starts at position 0: causal over its own keys, no mask, no gather of the cache."""


def prefill_shape(cache: SlotCache, chunks: Sequence[PrefillChunk]) -> PrefillShape:
    """The shape ``prefill`` runs ``chunks`` at."""
    return PrefillShape(
        rows=len(chunks),
        width=max(len(c.token_ids) for c in chunks),
        attend_len=cache.attend_len(max(c.start + len(c.token_ids) for c in chunks)),
        fresh=all(c.start == 0 for c in chunks),
    )


def padded_ids(chunks: Sequence[PrefillChunk], rows: int, width: int) -> Tensor:
    """int64 [rows, width] on the host: each chunk's tokens from the row's start, zeros after them and in
    the rows past the chunks."""
    ids = torch.zeros((rows, width), dtype=torch.int64)
    for r, c in enumerate(chunks):
        ids[r, : len(c.token_ids)] = torch.tensor(c.token_ids, dtype=torch.int64)
    return ids


def reads_in_place(cache: SlotCache, chunks: Sequence[PrefillChunk], width: int) -> bool:
    """Whether a prefill of ``chunks`` over the cache, ``width`` tokens a row, attends over the rows' slots
    in place (``over_cache_keys``): where the live attention runs, and every row's start + width fits its
    slot."""
    return cache.reads_live_lengths and max(c.start for c in chunks) + width <= cache.capacity


def over_cache_keys(
    cache: SlotCache, slots_N: Tensor, start_N: Tensor, length_N: Tensor, width: int
) -> LiveKeys:
    """``LiveKeys`` of a prefill over the cache, W = ``width`` queries a row, causal aligned to the end of
    start + W keys: a real query q sees positions 0..start+q, its row's own; the padding queries see stale
    positions inside the slot's plane (their outputs are dropped); an idle row (``length_N`` 0) reads W keys
    of its slot."""
    return cache.live_keys(slots_N, torch.where(length_N > 0, start_N + width, width), queries=width)


def prefill(
    fwd: SlotForward,
    state: SlotState,
    sampler: Sampler,
    chunks: Sequence[PrefillChunk],
    *,
    shape: PrefillShape | None = None,
    capture: Sequence[int] = (),
) -> tuple[Tensor | None, Tensor | None]:
    """Run the chunks (right-padded into one forward; padding comes after each row's tokens, so a causal
    query never sees it). ``shape``: run at these rows and width, at least the chunks' own
    (``prefill_shape``, the default); idle rows after the chunks' write nothing and see position 0 of the
    first chunk's slot, like a decode step's idle rows. The prompts they complete become live: their first
    token is sampled into ``state.tokens`` and returned (int64 [M], in chunk order; None when none
    completes). With ``capture``, also the features [N, S, F] of every token run (padding too)."""
    device = state.tokens.device
    cache = fwd.cache
    exact = prefill_shape(cache, chunks)
    shape = exact if shape is None else shape
    assert shape.rows >= exact.rows, (shape, exact)
    assert shape.width >= exact.width, (shape, exact)
    assert (shape.attend_len, shape.fresh) == (exact.attend_len, exact.fresh), (shape, exact)
    width, idle = shape.width, [0] * (shape.rows - exact.rows)
    ids = padded_ids(chunks, shape.rows, width)
    start_N = int64_on([c.start for c in chunks] + idle, device)
    length_N = int64_on([len(c.token_ids) for c in chunks] + idle, device)
    slot_list = [c.slot for c in chunks]
    slots_N = int64_on(slot_list + [slot_list[0]] * len(idle), device)
    q_S = torch.arange(width, device=device)
    positions_NS = start_N[:, None] + q_S[None, :]
    fresh = shape.fresh  # causal over the chunk itself: no mask, no gather
    write_NS = torch.where(q_S[None, :] < length_N[:, None], positions_NS, cache.scratch)
    live: LiveKeys | None = None
    mask: Tensor | None = None
    if not fresh and reads_in_place(cache, chunks, width):
        live = over_cache_keys(cache, slots_N, start_N, length_N, width)
    elif not fresh:
        mask = block_mask(start_N, width, shape.attend_len)
    rows = ForwardRows(
        num_rows=shape.rows, slots_N=slots_N, write_NS=write_NS, attend_len=shape.attend_len,
        own_keys_only=fresh, live_keys=live,
    )  # fmt: skip
    hidden, features = fwd.hidden(to_device(ids, device), positions_NS, mask, rows, capture=capture)
    done = [r for r, c in enumerate(chunks) if c.completes]
    if not done:
        return None, features
    done_M = int64_on(done, device)
    last_M = length_N[done_M] - 1
    slot_M = slots_N[done_M]
    first_M = sampler(fwd.logits(hidden[done_M, last_M]), state.keys[slot_M], torch.zeros_like(slot_M))
    start_decoding(state, slot_M, first_M, int64_on([chunks[r].prompt_len for r in done], device))
    return first_M, features


def start_decoding(state: SlotState, slot_M: Tensor, first_M: Tensor, prompt_len_M: Tensor) -> None:
    """The slots whose prompts a prefill completed decode from the next step: their first token is the
    next input, at position ``prompt_len``."""
    state.tokens.index_copy_(0, slot_M, first_M)
    state.lens.index_copy_(0, slot_M, prompt_len_M)
    state.steps.index_fill_(0, slot_M, 1)
    state.live.index_fill_(0, slot_M, True)


class StaticPrefillBuffers:
    """The inputs and output of a prefill at one static shape [R, W] (persistent: the shape's CUDA graph
    reads and writes these very tensors; the caller fills the inputs before each run)."""

    def __init__(self, rows: int, width: int, device: torch.device) -> None:
        self.ids_RW = torch.zeros((rows, width), dtype=torch.int64, device=device)
        """Each row's chunk tokens from its start, padding after them."""
        self.start_R = torch.zeros((rows,), dtype=torch.int64, device=device)
        """The position of each row's first token (0 for fresh prompts and idle rows)."""
        self.length_R = torch.zeros((rows,), dtype=torch.int64, device=device)
        """Real tokens per row (0: an idle row, which writes only the scratch position)."""
        self.slots_R = torch.zeros((rows,), dtype=torch.int64, device=device)
        """The slot each row writes (an idle row: any real row's slot)."""
        self.first_R = torch.zeros((rows,), dtype=torch.int64, device=device)
        """Output: the token sampled after each row's last real token (meaningless for idle rows and for
        rows whose prompt goes on in a later chunk)."""


def static_prefill_step(
    fwd: SlotForward, state: SlotState, sampler: Sampler, buf: StaticPrefillBuffers, *, over_cache: bool
) -> None:
    """A prefill forward whose shapes are fixed by ``buf``, so that it can be replayed as a CUDA graph:
    writes the rows' keys and values into their slots and samples a token after each row's last real token
    into ``buf.first_R``. Fresh prompts (``over_cache`` False: every row from position 0) attend causally
    over their own keys; continuations (``over_cache``: rows from ``buf.start_R``, which needs the cache's
    live attention, ``SlotCache.reads_live_lengths``, and every row's start + W within its slot) attend over
    their slots in place, as ``prefill`` does. The slot state is left to the caller (``start_decoding`` for
    the rows that complete their prompt)."""
    rows, width = buf.ids_RW.shape
    cache = fwd.cache
    q_W = torch.arange(width, device=buf.ids_RW.device)
    if over_cache:
        positions_RW = buf.start_R[:, None] + q_W[None, :]
    else:
        positions_RW = q_W[None, :].expand(rows, width)
    write_RW = torch.where(q_W[None, :] < buf.length_R[:, None], positions_RW, cache.scratch)
    if over_cache:
        forward_rows = ForwardRows(
            num_rows=rows, slots_N=buf.slots_R, write_NS=write_RW, attend_len=cache.capacity,
            live_keys=over_cache_keys(cache, buf.slots_R, buf.start_R, buf.length_R, width),
        )  # fmt: skip
    else:
        forward_rows = ForwardRows(
            num_rows=rows, slots_N=buf.slots_R, write_NS=write_RW,
            attend_len=cache.attend_len(min(width, cache.max_len + 1)), own_keys_only=True,
        )  # fmt: skip
    hidden, _ = fwd.hidden(buf.ids_RW, positions_RW, None, forward_rows)
    last_R = (buf.length_R - 1).clamp(min=0)
    hidden_RH = hidden[torch.arange(rows, device=q_W.device), last_R]
    keys_R2 = state.keys[buf.slots_R]
    buf.first_R.copy_(sampler(fwd.logits(hidden_RH), keys_R2, torch.zeros_like(buf.slots_R)))
