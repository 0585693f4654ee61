"""The conversation driver of one worker: feeds an engine the ready turns of a bounded window of
conversations.

A conversation has at most one turn in the engine: turn k is submitted when the answer to turn k − 1
arrives (its prompt holds the target's own earlier answers), so a conversation waits for its previous
turn while the other conversations' turns keep the batch full. A finished conversation is written at
once (one flushed line) and a new record takes its place in the window, so memory stays bounded by the
window whatever the data set size. At a stop the answered turns of the conversations in flight are kept
(``in_progress``, written by ``ConversationSink.keep`` to the partial file), and the rerun admits each
with them restored (``restored``) at its next turn; a kill loses the conversations in flight.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from dflash_offline.config_fields import field_ref
from dflash_offline.data.conversations import Conversation, SourceFailure
from dflash_offline.regenerate.config import RegenerateConfig
from dflash_offline.regenerate.engine_protocol import Engine
from dflash_offline.regenerate.generation import GeneratedTokens
from dflash_offline.regenerate.jsonl_out import KEY, ResumableJsonl
from dflash_offline.regenerate.partial_out import PartialConversation, append_partials
from dflash_offline.regenerate.pending_conversation import Answer, PendingConversation
from dflash_offline.regenerate.prompt_ids import PromptEncoder, render_prompt

__all__ = ["KEY", "ConversationSink", "Driver", "Tally", "render_prompt"]

PRINTED_FAILURES = 10
"""Failed records a worker prints a line for; the rest are counted (the failures file lists every one)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Tally:
    """Counts of one worker's progress since its last report (or in total, for the summary)."""

    written: int = 0
    """Conversations written."""
    failed: int = 0
    skipped: int = 0
    """Records already done by an earlier run."""
    answers: int = 0
    """Assistant turns in written conversations."""
    truncated: int = 0
    """Of those, answers cut at --max-new-tokens."""
    new_tokens: int = 0
    """Tokens the target generated (every answer, stop tokens excluded)."""
    resumed: int = 0
    """Conversations continued from the answers an earlier run kept at its stop (the partial file)."""
    resumed_answers: int = 0
    """Their answers taken from the partial file (turns not answered again)."""
    kept: int = 0
    """Conversations in progress at a stop whose answered turns went to the partial file."""
    kept_answers: int = 0
    """Their answered turns."""

    def __add__(self, other: Tally) -> Tally:
        return Tally(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(Tally)})

    @property
    def records(self) -> int:
        return self.written + self.failed + self.skipped


def _turn_key(p: PendingConversation, turn: int) -> str:
    """The engine's key of a conversation's turn."""
    return f"{p.conv.sample_id}#{turn}"


class ConversationSink:
    """Writes finished conversations and failures; reports progress through ``on_tally`` / ``on_failure``."""

    def __init__(
        self,
        *,
        out: ResumableJsonl,
        failures: ResumableJsonl,
        partial: Path,
        source: str,
        regenerated_by: dict[str, Any],
        on_tally: Callable[[Tally], None],
        on_failure: Callable[[str], None],
    ) -> None:
        self.out = out
        self.failures = failures
        self.partial = partial
        """Where ``keep`` appends the conversations in progress (the partial file, or a worker's part)."""
        self.source = source
        self.regenerated_by = regenerated_by
        self._on_tally = on_tally
        self._on_failure = on_failure
        self._printed_failures = 0
        self.total = Tally()

    def _count(self, t: Tally) -> None:
        self.total = self.total + t
        self._on_tally(t)

    def fail(self, *, sample_id: str, source_index: int, record_id: str, reason: str, detail: str) -> None:
        self.failures.append(
            {
                KEY: sample_id,
                "source_index": source_index,
                "record_id": record_id,
                "reason": reason,
                "detail": detail,
            }
        )
        # One line per failure while they are few; a data set whose prompts run long fails hundreds of
        # records (336 of 12,000 ShareGPT records over --max-prompt-tokens 1536), which would bury every
        # other line: after PRINTED_FAILURES, one line says where the rest are (the summary counts them).
        if self._printed_failures < PRINTED_FAILURES:
            self._on_failure(
                f"regenerate: record {source_index} ({record_id or sample_id}) failed: {reason}: {detail}"
            )
        elif self._printed_failures == PRINTED_FAILURES:
            self._on_failure(
                f"regenerate: more records fail; the first {PRINTED_FAILURES} were printed, the end of the "
                "run counts them all and names the failures file that lists each with its reason"
            )
        self._printed_failures += 1
        self._count(Tally(failed=1))

    def fail_conv(self, p: PendingConversation, reason: str, detail: str) -> None:
        c = p.conv
        self.fail(
            sample_id=c.sample_id,
            source_index=c.source_index,
            record_id=c.record_id,
            reason=reason,
            detail=detail,
        )

    def skip(self) -> None:
        self._count(Tally(skipped=1))

    def resume(self, p: PendingConversation) -> None:
        self._count(Tally(resumed=1, resumed_answers=len(p.answers)))

    def keep(self, in_progress: Sequence[PendingConversation]) -> None:
        """At a stop: append the answered turns of ``in_progress`` to the partial file (fsynced on return)."""
        entries = [PartialConversation.of(p, regenerated_by=self.regenerated_by) for p in in_progress]
        append_partials(self.partial, entries)
        self._count(Tally(kept=len(entries), kept_answers=sum(len(e.answers) for e in entries)))

    def tokens(self, n: int) -> None:
        self._count(Tally(new_tokens=n))

    def write(self, p: PendingConversation) -> None:
        conv = p.conv
        self.out.append(
            {
                "id": conv.record_id or conv.sample_id,
                "messages": p.messages(),
                "source": self.source,
                KEY: conv.sample_id,
                "source_index": conv.source_index,
                "regenerated_by": self.regenerated_by,
                "finish_reasons": [a.finish_reason for a in p.answers],
                "dropped_turns": p.dropped_turns,
            }
        )
        truncated = sum(a.finish_reason == "length" for a in p.answers)
        self._count(Tally(written=1, answers=len(p.answers), truncated=truncated))


class Driver:
    """Moves conversations from the record stream through ``engine`` into ``sink``."""

    def __init__(
        self,
        *,
        engine: Engine,
        sink: ConversationSink,
        tokenizer: Any,
        max_prompt_tokens: int,
        window: int,
        done: Callable[[str], bool],
        mine: Callable[[str], bool] = lambda _sid: True,
        restored: Mapping[str, Sequence[Answer]] | None = None,
    ) -> None:
        self.engine = engine
        self.sink = sink
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        self.prompts = PromptEncoder(tokenizer, max_tokens=max_prompt_tokens)
        """Renders and tokenizes the turns' prompts, a turn's continuing its previous turn's ids."""
        self.window = window
        self.done = done
        """Whether a sample id was already written or failed (resume)."""
        self.mine = mine
        """Whether a sample id belongs to this worker's partition."""
        self.restored = dict(restored or {})
        """Answers an earlier run kept for conversations it left in progress, by sample id (taken at
        admission)."""
        self.live: dict[str, PendingConversation] = {}
        """The conversations in flight, by the key of their turn in the engine (one each)."""

    def _submit_next(self, p: PendingConversation) -> None:
        """Submit the conversation's next turn, or finish it here (a failure, or its prompt is too long).

        A turn with another after it asks the engine to keep its slot, and the next turn continues it (the
        engine prefills only what the prompt adds, ``decode/parked.py``); a conversation finished here
        releases what was kept for this turn."""
        turn = len(p.answers)
        previous = _turn_key(p, turn - 1) if turn else None
        try:
            prompt = self.prompts.encode(p.next_prompt(), previous=p.prompt)
        except Exception as e:  # a chat template may raise anything (jinja's raise_exception, ...)
            self._release(previous)
            self.sink.fail_conv(p, "template_error", f"turn {turn}: {type(e).__name__}: {e}")
            return
        p.prompt = prompt
        ids = prompt.ids
        if len(ids) > self.max_prompt_tokens:
            self._release(previous)
            if not p.answers:
                detail = (
                    f"prompt of at least {len(ids)} tokens > "
                    f"{field_ref(RegenerateConfig, 'max_prompt_tokens')} "
                    f"{self.max_prompt_tokens}"
                )
                self.sink.fail_conv(p, "too_long", detail)
                return
            p.stop_early()  # keep the turns answered so far
            self.sink.write(p)
            return
        key = _turn_key(p, turn)
        self.live[key] = p
        self.engine.submit(key, ids, keep_slot=turn + 1 < len(p.groups), continues=previous)

    def _release(self, key: str | None) -> None:
        if key is not None:
            self.engine.release(key)

    def _admit(self, item: Conversation | SourceFailure) -> None:
        if not self.mine(item.sample_id):
            return
        if self.done(item.sample_id):
            self.sink.skip()
        elif isinstance(item, SourceFailure):
            self.sink.fail(
                sample_id=item.sample_id,
                source_index=item.source_index,
                record_id="",
                reason=item.reason,
                detail=item.detail,
            )
        else:
            p = PendingConversation(item)
            if not p.groups:
                self.sink.fail_conv(p, "empty_conversation", "no user turn to answer")
                return
            answers = self.restored.pop(item.sample_id, ())
            if 0 < len(answers) < len(p.groups):  # else (the record's turns are cut otherwise) answered anew
                p.restore(answers)
                self.sink.resume(p)
            self._submit_next(p)

    def _answered(self, key: str, tokens: GeneratedTokens) -> None:
        p = self.live.pop(key)
        token_ids, finish_reason = tokens.token_ids, tokens.finish_reason
        self.sink.tokens(len(token_ids))
        text = self.tokenizer.decode(list(token_ids), skip_special_tokens=False)
        if not text.strip():
            self.engine.release(key)
            self.sink.fail_conv(
                p, "empty_response", f"turn {len(p.answers)}: the target answered nothing ({finish_reason})"
            )
            return
        answer = Answer(
            text=text,
            finish_reason=finish_reason,
            num_tokens=len(token_ids),
            token_ids=token_ids if tokens.from_target else None,
        )
        p.add_answer(answer)
        if p.done:
            self.sink.write(p)
        else:
            self._submit_next(p)

    def in_progress(self) -> list[PendingConversation]:
        """The conversations in flight with at least one answer (after a stop: what the rerun continues)."""
        return [p for p in self.live.values() if p.answers]

    def run(
        self, records: Iterator[Conversation | SourceFailure], *, should_stop: Callable[[], bool]
    ) -> bool:
        """Answer every record; False when ``should_stop`` ended it early (the conversations in flight stay
        in ``live``: ``in_progress``)."""
        exhausted = False
        while True:
            if should_stop():
                return False
            while not exhausted and len(self.live) < self.window:
                item = next(records, None)
                if item is None:
                    exhausted = True
                else:
                    self._admit(item)
            if not self.live:
                return True
            for finished in self.engine.poll(timeout=0.2):
                if finished.failure is not None:
                    p = self.live.pop(finished.key)
                    turn = f"turn {len(p.answers)}: "
                    self.sink.fail_conv(p, finished.failure.reason, turn + finished.failure.detail)
                    continue
                self._answered(finished.key, finished.tokens)
