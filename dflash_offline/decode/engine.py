"""The continuous-batching decode engine: prompts join whenever they come, finished rows leave at once.

Each ``step``: slots freed by the last step are marked idle; waiting prompts take the lowest free slots;
one decode step (a CUDA graph per bucket of rows and attended length) gives every decoding slot its next
token; while the device runs it, the host builds and launches one prefill forward of a chunk of the
prompts in prefill (at most ``prefill_tokens`` tokens, padding included, so a long prompt is spread over
several steps instead of stalling the decoding rows; a forward that attends over the cache runs at rows
and width rounded up to powers of two, ``_run_shape``), or, with ``prefill_wait_steps`` K > 0, only once
it is due (``_prefill_due``: the prompts fill it, no row decodes, a prompt's later chunk, or the oldest
prompt admitted K steps ago), so that a few freed slots idle for a few steps rather than every step
paying a mostly empty forward's fixed cost (with ``prefill_graphs``, fresh prompts' forwards are padded
too and replayed as CUDA graphs, ``_static_prefill``, and so are continuations over the cache with
``live_attention``); then the tokens of both come to the host in one
read, the only host sync of the step. A row ends
at a stop token or at its ``max_new_tokens``; its slot takes the next waiting prompt in the next step.
When the queue has drained and the live rows are scattered over the slots, the highest ones are moved
down (one copy of their keys and values) so that the decode steps shrink to a smaller bucket.

A conversation's next turn can reuse the keys and values its previous turn left in its slot
(``parked.py``): ``submit(..., keep_slot=True)`` parks the slot when the answer ends, and ``submit(...,
continues=key)`` takes it and prefills only the prompt after the common prefix. A continuation needs no
free slot, so it starts at the next step whatever waits before it; parked slots whose continuation never
comes are freed by ``release`` or, oldest first, when the free slots run out while prompts wait.

``poll`` runs steps until an answer is finished (or its timeout passes), so the caller keeps control
between steps: ``close(abort=True)`` from the same thread returns at once, dropping the rows in flight.
Before it returns answers, ``poll`` launches the next step (``_launch``; ``_collect`` reads it back in the
next call), so the device decodes while the caller renders and tokenizes the next turns: on an H200 that
host work was a quarter of regenerate's time with the device idle (bench/RESULTS.md, "Regenerate's engine
step"). That step admits waiting prompts into free slots only: a turn that just ended keeps its parked
slot until its continuation, submitted after ``poll`` returns, takes it.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from dflash_offline.decode.forward import SlotForward
from dflash_offline.decode.graphs import StepGraphs
from dflash_offline.decode.host_copy import copy_into, int64_on
from dflash_offline.decode.parked import ParkedSlot, ParkedSlots, common_prefix_len
from dflash_offline.decode.sampling import Sampler, Sampling, request_key_hash
from dflash_offline.decode.slot_cache import SlotCache, shape_for
from dflash_offline.decode.steps import (
    PrefillChunk,
    PrefillShape,
    SlotState,
    StaticPrefillBuffers,
    decode_step,
    padded_ids,
    prefill,
    prefill_shape,
    reads_in_place,
    start_decoding,
    static_prefill_step,
)
from dflash_offline.errors import DflashError

GREEDY = Sampling()


class DecodeError(DflashError):
    """A request the engine cannot hold, or an engine used after ``close``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineSettings:
    """Size and behaviour of a ``DecodeEngine``."""

    num_slots: int
    """Requests decoded at once (rows of the largest decode step)."""
    max_len: int
    """Longest request: prompt + new tokens (positions per slot)."""
    max_new_tokens: int
    """New tokens per request unless ``submit`` says otherwise."""
    stop_ids: frozenset[int]
    """Tokens that end an answer (kept as its last token)."""
    sampling: Sampling = GREEDY
    prefill_tokens: int = 2048
    """Tokens (padding included) per prefill forward."""
    prefill_wait_steps: int = 0
    """While rows decode, a prefill forward that its prompts do not fill waits until the oldest of them
    was admitted this many steps ago (0: a prefill forward in every step with a prompt to prefill)."""
    cuda_graphs: bool = True
    """Replay decode steps as CUDA graphs (CUDA only)."""
    prefill_graphs: bool = False
    """Run prefill forwards of fresh prompts at rows and width rounded up to powers of two, replayed as
    CUDA graphs with ``cuda_graphs`` on CUDA (one per shape): the eager forward's Python and launches were
    most of a regenerate step's host time on an H200. On the CPU the same padded forwards run eagerly."""
    live_attention: bool = False
    """Decode steps and prefill chunks over the cache attend over each row's live keys alone, read in place,
    where the flash kernel runs (CUDA, half precision: ``SlotCache.reads_live_lengths``), instead of over a
    bucket of positions with a mask (a prefill's rows gathered first): the padded decode attention was 10.8
    of a regenerate step's 23.9 ms of kernels on an H200, and a continuation's masked prefill what made KV
    reuse across turns slower there than prefilling whole prompts."""
    attend_granule: int | None = None
    """Smallest attended length (steps attend over granule × 2^k positions); None: 256 on CUDA, 32 on
    the CPU."""
    compile_backend: str | None = None
    """The target's decoder layers through ``torch.compile`` with this backend (``SlotForward``: their
    small elementwise kernels fused; a failure falls back to eager with a warning); None: eager."""

    def __post_init__(self) -> None:
        sizes = (self.num_slots, self.max_len - 1, self.max_new_tokens, self.prefill_tokens)
        if min(sizes) < 1 or self.prefill_wait_steps < 0:
            raise DecodeError(f"engine settings out of range: {self}")


@dataclass(frozen=True, kw_only=True, slots=True)
class DecodedRequest:
    """One finished request."""

    key: str
    token_ids: tuple[int, ...]
    """The generated tokens, the stop token included when one ended the answer."""
    stopped: bool
    """A stop token ended it (else ``max_new_tokens``)."""


class _Request:
    """A request's host-side state (this module only)."""

    __slots__ = (
        "admitted_step", "generated", "keep_slot", "key", "length", "max_new", "prefilled", "prompt", "slot",
        "started",
    )  # fmt: skip

    def __init__(self, key: str, prompt: tuple[int, ...], max_new: int, keep_slot: bool) -> None:
        self.key = key
        self.prompt = prompt
        self.max_new = max_new
        self.keep_slot = keep_slot
        """Park the slot when the request ends (``parked.py``)."""
        self.slot = -1
        self.prefilled = 0
        """Prompt tokens already in the cache."""
        self.admitted_step = 0
        """``num_steps`` when the request took its slot (``_prefill_due``)."""
        self.started = False
        """A chunk of its prompt was prefilled: the rest follows in the next steps (``_prefill_due``)."""
        self.length = 0
        """Positions in the cache once decoding (mirror of ``SlotState.lens``)."""
        self.generated: list[int] = []


@dataclass(frozen=True, kw_only=True, slots=True)
class _PrefillPlan:
    """The chunks the next prefill forward would run (this module only)."""

    chunks: list[PrefillChunk]
    reqs: list[_Request]
    """The request of each chunk."""
    full: bool
    """The forward is full: a prompt left out or cut for room, or ``prefill_tokens`` reached."""


@dataclass(frozen=True, kw_only=True, slots=True)
class _LaunchedStep:
    """A step queued on the device and not yet read back (this module only)."""

    decoding: list[tuple[int, _Request]]
    """The rows its decode step runs, by slot."""
    num_rows: int
    """Rows of its decode step (0: none ran)."""
    completed: list[_Request]
    """The requests its prefill forward completes, in chunk order."""
    tokens: Tensor | None
    """int64 on the device: the decode rows' tokens ([num_rows]), then the completed prompts' first tokens."""


def row_bucket(rows: int, num_slots: int) -> int:
    """Rows of the decode step covering slots 0..rows−1: the next power of two, at most ``num_slots``."""
    n = 1
    while n < rows:
        n *= 2
    return min(n, num_slots)


MIN_PADDED_WIDTH = 16
"""Narrowest width a prefill over the cache is padded to (the attention kernels' tiles are wider)."""


def padded_width(width: int, max_tokens: int) -> int:
    """Tokens per row a prefill over the cache runs at: the next power of two (at least
    ``MIN_PADDED_WIDTH``), at most ``max_tokens`` unless ``width`` itself is more."""
    n = MIN_PADDED_WIDTH
    while n < width:
        n *= 2
    return min(n, max(max_tokens, width))


class DecodeEngine:
    """Continuous batching over a ``SlotCache``: ``submit`` prompts, ``poll`` finished answers."""

    def __init__(self, model: Any, settings: EngineSettings) -> None:
        param = next(model.parameters())
        self.settings = settings
        self.device = param.device
        shape = shape_for(
            model.config, num_slots=settings.num_slots, max_len=settings.max_len, dtype=param.dtype,
            device=param.device,
        )  # fmt: skip
        self.cache = SlotCache(
            shape, attend_granule=settings.attend_granule, live_attention=settings.live_attention
        )
        self.fwd = SlotForward(model, self.cache, compile_backend=settings.compile_backend)
        self.state = SlotState(settings.num_slots, param.device)
        self.sampler = Sampler(settings.sampling)
        self.graphs = StepGraphs(param.device, enabled=settings.cuda_graphs)
        self._waiting: deque[_Request] = deque()
        self._resuming: list[_Request] = []
        """Continuations holding their parked slot, admitted at the next step."""
        self._free = list(range(settings.num_slots))
        self._parked = ParkedSlots()
        self._prefilling: list[_Request] = []
        self._decoding: dict[int, _Request] = {}
        self._finished: list[DecodedRequest] = []
        self._to_idle: list[int] = []
        self._requests: dict[str, _Request] = {}
        """Every request submitted and not yet finished, by key."""
        self._static_buffers: dict[tuple[int, int, bool], StaticPrefillBuffers] = {}
        """Per padded shape [rows, width] and kind (over the cache or fresh): the static tensors of
        ``settings.prefill_graphs``."""
        self._launched: _LaunchedStep | None = None
        """The step ``poll`` left running on the device while its caller takes the answers."""
        self._closed = False
        self.num_steps = 0
        self.num_prefills = 0
        self.num_prefill_tokens = 0
        """Prompt tokens run through the target by prefill (padding excluded)."""
        self.num_reused_tokens = 0
        """Prompt tokens whose keys and values a continuation found in its parked slot."""
        self.num_evictions = 0
        """Parked slots freed for waiting prompts before their continuation came."""
        self.num_moves = 0
        """Rows moved to a lower slot by compaction."""
        self.prefill_shapes: Counter[PrefillShape] = Counter()
        """Prefill forwards by shape: on CUDA each new shape of a forward that attends over the cache may
        cost the attention kernel a new plan."""
        self.decode_shapes: Counter[tuple[int, int]] = Counter()
        """Decode steps by (rows, attended length): on CUDA one graph capture per key."""
        self.num_decoded_rows = 0
        """Rows run by the decode steps, idle rows included (Σ of the bucket widths)."""
        self.num_live_rows = 0
        """Rows of the decode steps that decoded a token."""

    # ----- the Engine surface ---------------------------------------------------------------------

    def submit(
        self,
        key: str,
        prompt: Sequence[int],
        *,
        max_new_tokens: int | None = None,
        keep_slot: bool = False,
        continues: str | None = None,
    ) -> None:
        """Queue a request. ``keep_slot``: park its slot when it ends, for a request that continues it
        (free it with ``release`` if none will). ``continues``: the key of an ended request whose parked
        slot this one takes, prefilling only the prompt after their common prefix; when that slot is not
        parked (never kept, released or evicted) the prompt is prefilled whole, with the same answer."""
        if self._closed:
            raise DecodeError("the decode engine is closed")
        max_new = self.settings.max_new_tokens if max_new_tokens is None else max_new_tokens
        if not prompt or max_new < 1:
            raise DecodeError(f"request {key}: an empty prompt or max_new_tokens {max_new} < 1")
        if len(prompt) + max_new > self.settings.max_len:
            raise DecodeError(
                f"request {key}: {len(prompt)} prompt tokens + {max_new} new tokens exceed the "
                f"{self.settings.max_len} positions of a slot"
            )
        assert key not in self._requests, f"request {key} submitted twice"
        assert key not in self._parked, f"request {key} submitted twice"
        req = _Request(key, tuple(int(t) for t in prompt), max_new, keep_slot)
        self._requests[key] = req
        parked = self._parked.take(continues) if continues is not None else None
        if parked is None:
            self._waiting.append(req)
            return
        req.slot = parked.slot
        # The last prompt token always runs: its logits give the answer's first token.
        req.prefilled = min(common_prefix_len(parked.token_ids, req.prompt), len(req.prompt) - 1)
        self.num_reused_tokens += req.prefilled
        self._resuming.append(req)

    def release(self, key: str) -> None:
        """No request will continue ``key``: free its parked slot (if it is still in flight, it will not
        park). A key neither parked nor in flight (continued, evicted, never kept) is ignored."""
        parked = self._parked.take(key)
        if parked is not None:
            heapq.heappush(self._free, parked.slot)
        elif key in self._requests:
            self._requests[key].keep_slot = False

    def pending(self) -> int:
        return len(self._waiting) + len(self._resuming) + len(self._prefilling) + len(self._decoding)

    @property
    def num_parked(self) -> int:
        """Slots parked for a continuation."""
        return len(self._parked)

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def poll(self, timeout: float) -> list[DecodedRequest]:
        """Answers finished since the last call; runs steps for up to ``timeout`` s until one is.

        Before returning answers it queues the next step, so that the device decodes while the caller
        takes them (renders and tokenizes the next turns, writes): that step is read back by the next call.
        Its admissions never evict a parked slot (``_admit``): a turn that ended in the step just read has
        its continuation submitted only after this returns."""
        deadline = time.monotonic() + timeout
        while not self._finished and (self.pending() or self._launched) and not self._closed:
            launched, self._launched = self._launched or self._launch(evict=True), None
            self._collect(launched)
            if self._finished and self._has_work() and not self._closed:
                self._launched = self._launch(evict=False)
            if time.monotonic() >= deadline:
                break
        if not self._finished and not self.pending():
            time.sleep(min(timeout, 0.01))
        done, self._finished = self._finished, []
        return done

    def close(self, *, abort: bool = False) -> None:
        """Drop every request in flight and free the cache (returns at once)."""
        self._closed = True
        self._launched = None  # its device work ends on its own; nothing reads it back
        self._static_buffers.clear()
        self._waiting.clear()
        self._resuming.clear()
        self._parked.clear()
        self._requests.clear()
        self._prefilling.clear()
        self._decoding.clear()
        self.graphs.clear()
        self.cache.keys.clear()
        self.cache.values.clear()

    # ----- one step -------------------------------------------------------------------------------

    def _has_work(self) -> bool:
        """Whether a step launched now without evicting would run anything."""
        return bool(self._decoding or self._prefilling or self._resuming or (self._waiting and self._free))

    def step(self) -> None:
        """One whole step: decode one token for every live row, prefill a chunk of the waiting prompts,
        read both (a step ``poll`` left running is read back instead)."""
        launched, self._launched = self._launched or self._launch(evict=True), None
        self._collect(launched)

    @torch.inference_mode()
    def _launch(self, *, evict: bool) -> _LaunchedStep:
        """Queue a step on the device: its decode step first (one graph launch), then its prefill
        forward, built and launched on the host while the device runs the decode, so that the prefill's
        Python and kernel launches, the larger part of a step's host time, overlap the decode instead of
        preceding it (host copies are queued without waiting, ``host_copy.py``). Rows that complete their
        prompt in this step's prefill decode from the next step on (their first token comes from the
        prefill). ``evict``: waiting prompts may take parked slots (``_admit``)."""
        self._idle_freed_slots()
        self._admit(evict=evict)
        self._compact()
        decoding = list(self._decoding.items())
        num_rows = 0
        if decoding:
            num_rows = self._decode_rows()
            # Over live keys the attended bucket changes nothing: one graph a row count.
            attend_len = (
                self.cache.capacity
                if self.cache.reads_live_lengths
                else self.cache.attend_len(max(r.length for _, r in decoding) + 1)
            )
            n = num_rows
            self.decode_shapes[n, attend_len] += 1
            self.num_decoded_rows += n
            self.num_live_rows += len(decoding)
            self.graphs.run(
                ("decode", n, attend_len),
                lambda: decode_step(self.fwd, self.state, self.sampler, n, attend_len),
                self.state.mutated(),
            )
        first_M: Tensor | None = None
        completed: list[_Request] = []
        if self._prefilling:
            plan = self._plan_prefill()
            if self._prefill_due(plan):
                first_M, completed = self._prefill_chunk(plan)
        parts = ([self.state.sampled[:num_rows]] if num_rows else []) + (
            [first_M] if first_M is not None else []
        )
        # A copy: the next decode step overwrites ``state.sampled`` before this one is read back.
        tokens = torch.cat(parts) if parts else None
        return _LaunchedStep(decoding=decoding, num_rows=num_rows, completed=completed, tokens=tokens)

    def _collect(self, launched: _LaunchedStep) -> None:
        """Read a launched step's tokens back (the step's one host sync) and advance its requests."""
        values = launched.tokens.tolist() if launched.tokens is not None else []
        self.num_steps += 1
        for slot, req in launched.decoding:
            req.generated.append(values[slot])
            req.length += 1
            if self._done(req):
                self._finish(req)
        for i, req in enumerate(launched.completed):
            req.generated.append(values[launched.num_rows + i])
            if self._done(req):
                self._finish(req)

    def _decode_rows(self) -> int:
        """Rows of this step's decode: while prompts wait the batch is about to fill, so decode at full
        width at once rather than capturing a graph for every bucket on the way up; else the bucket
        covering the highest live slot."""
        top = self.settings.num_slots if self._waiting or self._prefilling else max(self._decoding) + 1
        return row_bucket(top, self.settings.num_slots)

    def _done(self, req: _Request) -> bool:
        return req.generated[-1] in self.settings.stop_ids or len(req.generated) >= req.max_new

    def _finish(self, req: _Request) -> None:
        del self._decoding[req.slot]
        del self._requests[req.key]
        self._to_idle.append(req.slot)
        if req.keep_slot:
            # The last generated token was sampled, never fed: its keys and values are not in the slot.
            held = req.prompt + tuple(req.generated[:-1])
            assert len(held) == req.length, (len(held), req.length)
            self._parked.park(req.key, ParkedSlot(slot=req.slot, token_ids=held))
        else:
            heapq.heappush(self._free, req.slot)
        stopped = req.generated[-1] in self.settings.stop_ids
        self._finished.append(DecodedRequest(key=req.key, token_ids=tuple(req.generated), stopped=stopped))

    def _idle_freed_slots(self) -> None:
        if self._to_idle:
            slots = int64_on(self._to_idle, self.device)
            self.state.live.index_fill_(0, slots, False)
            self._to_idle.clear()

    def _admit(self, *, evict: bool) -> None:
        """Waiting prompts take free slots; with ``evict``, parked slots too when none is free (oldest
        first)."""
        admitted, self._resuming = self._resuming, []  # continuations come with their slots
        while self._waiting and (self._free or (evict and self._parked)):
            if not self._free:  # a prompt waits: the oldest parked slot gives way
                heapq.heappush(self._free, self._parked.take_oldest().slot)
                self.num_evictions += 1
            req = self._waiting.popleft()
            req.slot = heapq.heappop(self._free)
            admitted.append(req)
        for req in admitted:
            req.admitted_step = self.num_steps
        self._prefilling += admitted
        if admitted:
            slots = int64_on([r.slot for r in admitted], self.device)
            keys = int64_on([request_key_hash(r.key) for r in admitted], self.device)
            self.state.keys.index_copy_(0, slots, keys)

    def _plan_prefill(self) -> _PrefillPlan:
        """The next prefill forward: chunks of the oldest prompts in prefill, within ``prefill_tokens``."""
        budget = self.settings.prefill_tokens
        chunks: list[PrefillChunk] = []
        reqs: list[_Request] = []
        width = 0
        full = False
        # Fresh prompts and continuations go in separate forwards: fresh ones attend only to themselves.
        fresh = self._prefilling[0].prefilled == 0
        for req in self._prefilling:
            if (req.prefilled == 0) != fresh:
                continue
            take = min(len(req.prompt) - req.prefilled, budget)
            if chunks and self._prefill_tokens(len(chunks) + 1, max(width, take), fresh) > budget:
                take = min(take, width)  # pad no wider than the rows already in
                if self._prefill_tokens(len(chunks) + 1, width, fresh) > budget:
                    full = True  # a prompt is left out for room
                    break
            width = max(width, take)
            end = req.prefilled + take
            chunks.append(
                PrefillChunk(
                    slot=req.slot, token_ids=req.prompt[req.prefilled : end], start=req.prefilled,
                    completes=end == len(req.prompt), prompt_len=len(req.prompt),
                )
            )  # fmt: skip
            reqs.append(req)
        full = (
            full
            or not all(c.completes for c in chunks)  # a prompt is cut for room
            or self._prefill_tokens(len(chunks), width, fresh) >= budget
        )
        return _PrefillPlan(chunks=chunks, reqs=reqs, full=full)

    def _prefill_due(self, plan: _PrefillPlan) -> bool:
        """Whether this step runs ``plan``: always with ``prefill_wait_steps`` 0; else when the prompts fill
        the forward, when no row decodes (nothing to overlap with), when a prompt has its later chunks to
        go (started prompts finish in consecutive steps), or when the oldest prompt in prefill (the first:
        ``_admit`` appends in order, and every plan starts with it) was admitted ``prefill_wait_steps``
        steps ago. The last bounds every prompt's wait: from then on a forward runs every step, each
        taking the oldest prompt, until the prompts admitted since are younger."""
        wait = self.settings.prefill_wait_steps
        return (
            wait == 0
            or plan.full
            or not self._decoding
            or any(r.started for r in self._prefilling)
            or self.num_steps - self._prefilling[0].admitted_step >= wait
        )

    def _prefill_chunk(self, plan: _PrefillPlan) -> tuple[Tensor | None, list[_Request]]:
        """One prefill forward of ``plan``."""
        chunks = plan.chunks
        shape = self._run_shape(chunks)
        if self.settings.prefill_graphs and (shape.fresh or reads_in_place(self.cache, chunks, shape.width)):
            first_M = self._static_prefill(chunks, shape)
        else:
            first_M, _ = prefill(self.fwd, self.state, self.sampler, chunks, shape=shape)
        self.num_prefills += 1
        self.prefill_shapes[shape] += 1
        completed = []
        for req, chunk in zip(plan.reqs, chunks, strict=True):
            req.prefilled += len(chunk.token_ids)
            req.started = True
            self.num_prefill_tokens += len(chunk.token_ids)
            if chunk.completes:
                req.length = len(req.prompt)
                self._decoding[req.slot] = req
                completed.append(req)
        self._prefilling = [r for r in self._prefilling if r.prefilled < len(r.prompt)]
        return first_M, completed

    def _static_prefill(self, chunks: Sequence[PrefillChunk], shape: PrefillShape) -> Tensor | None:
        """A prefill at the static ``shape`` (``settings.prefill_graphs``; fresh prompts, or continuations
        over the cache that ``reads_in_place``): the chunks into the shape's buffers, the forward (a CUDA
        graph per shape and kind), then the completed prompts' slots start decoding. Their first tokens
        (int64 [M], chunk order; None when none completes)."""
        over_cache = not shape.fresh
        key = (shape.rows, shape.width, over_cache)
        buf = self._static_buffers.get(key)
        if buf is None:
            buf = self._static_buffers[key] = StaticPrefillBuffers(shape.rows, shape.width, self.device)
        idle = shape.rows - len(chunks)
        copy_into(buf.ids_RW, padded_ids(chunks, shape.rows, shape.width))
        copy_into(buf.start_R, torch.tensor([c.start for c in chunks] + [0] * idle))
        copy_into(buf.length_R, torch.tensor([len(c.token_ids) for c in chunks] + [0] * idle))
        copy_into(buf.slots_R, torch.tensor([c.slot for c in chunks] + [chunks[0].slot] * idle))
        self.graphs.run(
            ("prefill", *key),
            lambda: static_prefill_step(self.fwd, self.state, self.sampler, buf, over_cache=over_cache),
            [],
        )
        done = [r for r, c in enumerate(chunks) if c.completes]
        if not done:
            return None
        done_M = int64_on(done, self.device)
        first_M = buf.first_R[done_M]  # a gather: a copy the shape's next run does not overwrite
        prompt_len_M = int64_on([chunks[r].prompt_len for r in done], self.device)
        start_decoding(self.state, buf.slots_R[done_M], first_M, prompt_len_M)
        return first_M

    def _run_shape(self, chunks: Sequence[PrefillChunk]) -> PrefillShape:
        """The shape a prefill forward of ``chunks`` runs at. One that attends over the cache (a
        continuation, a long prompt's later chunk) is padded to buckets of rows and width, so that its
        shapes repeat: on CUDA its masked attention (cuDNN) builds an execution plan for every new shape,
        which costs more than the forward itself. Fresh prompts (causal, flash: no plan) run as they are,
        or padded the same way with ``settings.prefill_graphs`` (a CUDA graph per shape)."""
        exact = prefill_shape(self.cache, chunks)
        if exact.fresh and not self.settings.prefill_graphs:
            return exact
        rows = row_bucket(exact.rows, self.settings.num_slots)
        return replace(exact, rows=rows, width=padded_width(exact.width, self.settings.prefill_tokens))

    def _prefill_tokens(self, rows: int, width: int, fresh: bool) -> int:
        """Tokens a prefill forward of ``rows`` chunks at most ``width`` long runs, padding included
        (``_run_shape``)."""
        if fresh and not self.settings.prefill_graphs:
            return rows * width
        return row_bucket(rows, self.settings.num_slots) * padded_width(width, self.settings.prefill_tokens)

    def _compact(self) -> None:
        """Move the highest decoding rows into the lowest free slots when that shrinks the decode bucket
        (only once nothing waits: a waiting prompt would fill the free slots anyway). Parked slots stay
        where they are: the rows move around them, into a bucket that holds both."""
        if self._waiting or self._resuming or self._prefilling or not self._decoding:
            return
        target = self._compact_target()
        if target is None:
            return
        s = self.state
        for src in sorted(self._decoding, reverse=True):
            if src < target:
                break
            dst = heapq.heappop(self._free)
            assert dst < target, (dst, target)
            req = self._decoding.pop(src)
            self.cache.move_slot(src, dst, req.length)
            for t in (s.tokens, s.lens, s.live, s.keys, s.steps):
                t[dst] = t[src]
            s.live[src] = False
            req.slot = dst
            self._decoding[dst] = req
            heapq.heappush(self._free, src)
            self.num_moves += 1

    def _compact_target(self) -> int | None:
        """The smallest decode bucket below the current one whose slots can hold every decoding row beside
        the parked slots in it (None: none)."""
        slots = self.settings.num_slots
        current = row_bucket(max(self._decoding) + 1, slots)
        parked = self._parked.slots()
        bucket = row_bucket(len(self._decoding), slots)
        while bucket < current:
            if len(self._decoding) + sum(p < bucket for p in parked) <= bucket:
                return bucket
            bucket = row_bucket(bucket + 1, slots)
        return None
