"""The questions of the eval sets, and decoding one question turn by turn, target-only and speculatively.

A question is one chat-data prompt (rendered already; with ``--turns all`` its later turns too) or a
standard set's list of user turns. Turn t's prompt is the chat template over the turns' messages 1..t
with the target-only (greedy) answers to turns 1..t−1 in between, and the generation prompt: the
target's own conversation, the same for both decodes. Each turn is decoded target-only and speculatively
(the one loop of ``decode/speculative.py``, without and with a drafter), and the two outputs are compared
tie-aware.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from dflash_offline.config_fields import field_ref
from dflash_offline.data.conversations import Message
from dflash_offline.decode import DecodeResult, Drafter, SingleSequence
from dflash_offline.eval.benches import BenchQuestion
from dflash_offline.eval.config import EvalConfig
from dflash_offline.eval.exactness import Divergence, classify
from dflash_offline.eval.prompts import EvalPrompt, render_prompt_ids


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalQuestion:
    """One question of one set."""

    bench: str
    question_id: str
    """MT-Bench question_id / HumanEval task_id; empty for chat data."""
    sample_id: str
    """Chat data: the conversation's sample id; standard sets: ``bench:question_id``."""
    record_id: str
    turns: tuple[tuple[Message, ...], ...] = ()
    """The system/user messages before each answer, in order (empty: ``prompt_ids`` alone, one turn)."""
    prompt_ids: tuple[int, ...] | None = None
    """The first turn's prompt rendered already (the held-out selection rendered it to check its length)."""

    @property
    def num_turns(self) -> int:
        return max(len(self.turns), 1 if self.prompt_ids is not None else 0)


def from_chat_prompt(prompt: EvalPrompt, *, bench: str) -> EvalQuestion:
    return EvalQuestion(
        bench=bench,
        question_id="",
        sample_id=prompt.sample_id,
        record_id=prompt.record_id,
        turns=prompt.turns,
        prompt_ids=prompt.prompt_ids,
    )


def from_bench(question: BenchQuestion) -> EvalQuestion:
    return EvalQuestion(
        bench=question.bench,
        question_id=question.question_id,
        sample_id=f"{question.bench}:{question.question_id}",
        record_id=question.question_id,
        turns=tuple((Message(role="user", content=text),) for text in question.turns),
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class DecodedTurn:
    """One turn of one question, decoded target-only and speculatively."""

    question: EvalQuestion
    turn: int
    """1-based."""
    prompt_ids: tuple[int, ...]
    target_only: DecodeResult
    speculative: DecodeResult
    divergence: Divergence


@dataclass(frozen=True, kw_only=True, slots=True)
class Decoders:
    """What decoding a turn needs: the decode loop over the target (``engine``), the drafter on its device,
    the target model itself (the exactness check's full forward), and how to stop. Target-only decoding
    is the same loop with a drafter that proposes nothing."""

    engine: SingleSequence
    drafter: Drafter
    """``engine.drafter_for(model)`` for a DFlash drafter."""
    target: nn.Module
    tokenizer: Any
    layer_ids: tuple[int, ...]
    stop_ids: frozenset[int]
    max_new_tokens: int
    max_prompt_tokens: int
    tie_ulps: float

    def target_only(self, prompt_ids: Sequence[int], max_new_tokens: int | None = None) -> DecodeResult:
        return self.engine.target_only(
            prompt_ids, max_new_tokens=max_new_tokens or self.max_new_tokens, stop_ids=self.stop_ids
        )

    def speculative(self, prompt_ids: Sequence[int], max_new_tokens: int | None = None) -> DecodeResult:
        return self.engine.speculative(
            prompt_ids,
            self.drafter,
            layer_ids=self.layer_ids,
            max_new_tokens=max_new_tokens or self.max_new_tokens,
            stop_ids=self.stop_ids,
        )


def turn_messages(turns: Sequence[Sequence[Message]], answers: Sequence[str]) -> list[dict[str, str]]:
    """[turn 1's messages, assistant 1, …, turn t's messages]: the conversation whose next answer is
    turn t's."""
    assert len(answers) == len(turns) - 1, (len(turns), len(answers))
    messages: list[dict[str, str]] = []
    for i, turn in enumerate(turns):
        messages += [{"role": m.role, "content": m.content} for m in turn]
        if i < len(answers):
            messages.append({"role": "assistant", "content": answers[i]})
    return messages


def first_turn_ids(question: EvalQuestion, tokenizer: Any) -> tuple[int, ...]:
    """The prompt of the question's first turn."""
    if question.prompt_ids is not None:
        return question.prompt_ids
    return tuple(render_prompt_ids(tokenizer, turn_messages(question.turns[:1], [])))


def decode_question(
    question: EvalQuestion, dec: Decoders, *, on_skip: Callable[[str], None] | None = None
) -> Iterator[DecodedTurn]:
    """Decode every turn of ``question`` target-only and speculatively (a turn whose prompt is longer than
    ``max_prompt_tokens`` ends it)."""
    answers: list[str] = []
    for t in range(question.num_turns):
        if t == 0 and question.prompt_ids is not None:
            prompt_ids = question.prompt_ids
        else:
            prompt_ids = tuple(
                render_prompt_ids(dec.tokenizer, turn_messages(question.turns[: t + 1], answers))
            )
            if len(prompt_ids) > dec.max_prompt_tokens:
                # A standard question is noted; a chat conversation just ends there (as regenerate ends it).
                if on_skip is not None and question.question_id:
                    on_skip(
                        f"{question.bench} {question.question_id} turn {t + 1}: prompt of {len(prompt_ids)} "
                        f"tokens > {field_ref(EvalConfig, 'max_prompt_tokens')} {dec.max_prompt_tokens}, not "
                        "decoded"
                    )
                return
        base = dec.target_only(prompt_ids)
        fast = dec.speculative(prompt_ids)
        divergence = classify(
            model=dec.target,
            prompt_ids=prompt_ids,
            target_tokens=base.tokens,
            spec_tokens=fast.tokens,
            tie_ulps=dec.tie_ulps,
        )
        yield DecodedTurn(
            question=question,
            turn=t + 1,
            prompt_ids=prompt_ids,
            target_only=base,
            speculative=fast,
            divergence=divergence,
        )
        # The target's own greedy answer, as text (its stop token is a special token and goes).
        answers.append(dec.tokenizer.decode(list(base.tokens), skip_special_tokens=True))
