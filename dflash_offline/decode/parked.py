"""Slots kept after their request ended, with the keys and values they hold, for the request that
continues it (a conversation's next turn, whose prompt starts with the previous turn's prompt and answer).

A request submitted with ``keep_slot`` parks its slot when it ends instead of freeing it: the slot keeps
the K/V of every token the request fed through the target, that is its prompt and its generated tokens
but the last one (sampled from the logits of the one before, it was never fed back). A request submitted
with ``continues=<that key>`` takes the slot and prefills only the tokens after the longest common prefix
of the parked tokens and its own prompt. The prefix is found by comparing, never assumed: a chat template
may render the previous answer differently from the tokens the target generated (an end-of-turn marker
after it, another split of its text, an earlier turn rewritten), and the common prefix ends where they
part. Keys past the prefix are stale; the continuation overwrites them before any mask shows them.

A parked slot is not a live row: the decode step runs it as an idle row (writing only the scratch
position, reading only position 0) and compaction never moves it. It leaves the parking by its
continuation, by ``DecodeEngine.release`` (the caller knows no continuation will come), or by eviction,
oldest first, when the free slots run out while prompts wait.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class ParkedSlot:
    """A finished request's slot, kept for its continuation."""

    slot: int
    token_ids: tuple[int, ...]
    """The tokens whose K/V the slot holds at positions 0..len−1: the prompt, then the generated tokens
    but the last."""


class ParkedSlots:
    """Parked slots by the key of the request that left them, oldest first."""

    def __init__(self) -> None:
        self._by_key: dict[str, ParkedSlot] = {}  # insertion order: the oldest first

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, key: object) -> bool:
        return key in self._by_key

    def park(self, key: str, parked: ParkedSlot) -> None:
        assert key not in self._by_key, f"request {key} parked twice"
        self._by_key[key] = parked

    def take(self, key: str) -> ParkedSlot | None:
        """The slot parked under ``key``, which leaves the parking (None: none is)."""
        return self._by_key.pop(key, None)

    def take_oldest(self) -> ParkedSlot:
        key = next(iter(self._by_key))
        return self._by_key.pop(key)

    def slots(self) -> list[int]:
        return [p.slot for p in self._by_key.values()]

    def clear(self) -> None:
        self._by_key.clear()


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)
