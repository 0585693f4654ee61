"""Which turns a regenerate run answered, from the turns it submitted to its engine (keys
``<sample id>#<turn>``): shared by the tests that stop a run and check what its rerun submits."""

from __future__ import annotations

from collections.abc import Iterable


def answered_before_stop(submitted: Iterable[str], finished: set[str]) -> dict[str, int]:
    """Turns answered per conversation in a stopped run, from the turns it submitted (one at a time per
    conversation): all of them for a conversation written or failed (``finished``); else all but the last,
    which was in the engine at the stop."""
    turns: dict[str, int] = {}
    for key in submitted:
        sid, turn = key.rsplit("#", 1)
        turns[sid] = max(turns.get(sid, 0), int(turn) + 1)
    return {sid: n if sid in finished else n - 1 for sid, n in turns.items()}


def turn_keys(answered: dict[str, int]) -> set[str]:
    """The keys of the first ``n`` turns of each conversation."""
    return {f"{sid}#{t}" for sid, n in answered.items() for t in range(n)}


def sample_id(key: str) -> str:
    return key.rsplit("#", 1)[0]
