"""Which user turns of a conversation are answered: the turns ``dflash regenerate`` has the target answer
and the turns ``dflash eval --turns all`` decodes, cut the same way.

The system and user turns are kept in order and cut into groups where the data had its assistant turns;
an answer follows each group. An assistant turn before any user turn has no prompt and is dropped (its
system turns carry over to the next group); so are system turns after the last user turn. A conversation
of user turns alone gets one answer.
"""

from __future__ import annotations

from dflash_offline.data.conversations import Message


def user_groups(messages: tuple[Message, ...]) -> list[tuple[Message, ...]]:
    """The system/user turns cut into groups, one answer after each: a group ends where the data had an
    assistant turn (or at the end of the conversation) and holds at least one user turn; otherwise its
    turns carry over to the next group (an assistant turn with no user turn before it has no prompt)."""
    groups: list[tuple[Message, ...]] = []
    pending: list[Message] = []
    for m in (*messages, None):
        if m is not None and m.role != "assistant":
            pending.append(m)
        elif any(p.role == "user" for p in pending):
            groups.append(tuple(pending))
            pending = []
    return groups
