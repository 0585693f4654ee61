"""The answered turns of the conversations a stop left in progress (``<out>.partial``), from which the rerun
continues each at its next unanswered turn instead of answering it again from the first.

The output keeps complete conversations only (``dflash generate`` reads it). At a stop (the first Ctrl-C, a
worker asked to stop, an engine that gave up) each conversation in progress with at least one answer goes
here, one line: ``{"partial_version", "source_sample_id", "source_index", "id", "regenerated_by",
"answers": [{"content", "finish_reason", "num_tokens", "token_ids"}...]}``. One worker of several writes its
own part ``<out>.parts/w<k>.partial``; ``compact_partials`` folds the parts into ``<out>.partial`` and
drops the conversations that the output or the failures file holds by now, so that the file keeps at most
one line per record in progress however many reruns there were.

Crash safety as for the output (``jsonl_out.py``): lines are appended and flushed, and a torn last line
(a kill in the middle of a stop) is left out when read, so its conversation starts again from its first
turn. Several lines may hold one conversation (kept, continued and kept again; a part merged twice after a
kill in the middle of a merge): the one with the most answers counts, and the others are its prefixes.
A compaction writes a new file and renames it over the old one, so that a kill leaves one or the other
whole; the parts are deleted after it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_offline.config_fields import field_ref
from dflash_offline.errors import DataError
from dflash_offline.regenerate.config import RegenerateConfig
from dflash_offline.regenerate.jsonl_out import KEY, ResumableJsonl
from dflash_offline.regenerate.pending_conversation import Answer, PendingConversation

PARTIAL_VERSION = 1
"""Bump when a line's layout changes; a reader refuses versions it does not know."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PartialConversation:
    """One conversation in progress at a stop: the answers to its first ``len(answers)`` turns."""

    sample_id: str
    """The record's sample id (``source_sample_id``: hash of its source, id and content)."""
    source_index: int
    """The record's index in its data file."""
    record_id: str
    """The record's own id ('' when it has none)."""
    answers: tuple[Answer, ...]
    """The target's answers to turns 0..len−1, in order (at least one, fewer than the turns)."""
    regenerated_by: dict[str, Any]
    """The settings that produced them (the output line's ``regenerated_by``; checked before a resume)."""

    @staticmethod
    def of(p: PendingConversation, *, regenerated_by: dict[str, Any]) -> PartialConversation:
        conv = p.conv
        return PartialConversation(
            sample_id=conv.sample_id,
            source_index=conv.source_index,
            record_id=conv.record_id,
            answers=tuple(p.answers),
            regenerated_by=regenerated_by,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "partial_version": PARTIAL_VERSION,
            KEY: self.sample_id,
            "source_index": self.source_index,
            "id": self.record_id,
            "regenerated_by": self.regenerated_by,
            "answers": [a.to_dict() for a in self.answers],
        }

    @staticmethod
    def from_dict(d: dict[str, Any], *, where: str) -> PartialConversation:
        """A line of the partial file; ``DataError`` naming ``where`` (path:line) when it is not one."""
        out = field_ref(RegenerateConfig, "out")
        fix = f"not a line this command wrote; move the file aside or use another {out}"
        sample_id, version = d.get(KEY), d.get("partial_version")
        if not isinstance(sample_id, str):
            raise DataError(f"{where} has no string {KEY!r}: {fix}")
        if version != PARTIAL_VERSION:
            raise DataError(
                f"{where}: partial_version {version!r}, this dflash reads {PARTIAL_VERSION} only: {fix}"
            )
        try:
            answers = tuple(Answer.from_dict(a) for a in d["answers"])
            source_index, record_id, settings = d["source_index"], d["id"], d["regenerated_by"]
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"{where}: {type(e).__name__}: {e}: {fix}") from None
        if not answers or not isinstance(source_index, int) or not isinstance(record_id, str):
            raise DataError(f"{where}: no answers, or no int 'source_index' and string 'id': {fix}")
        if not isinstance(settings, dict):
            raise DataError(f"{where}: 'regenerated_by' is no JSON object: {fix}")
        return PartialConversation(
            sample_id=sample_id,
            source_index=source_index,
            record_id=record_id,
            answers=answers,
            regenerated_by=settings,
        )


def read_partials(
    paths: Iterable[Path], *, mine: Callable[[str], bool] = lambda _sid: True
) -> dict[str, PartialConversation]:
    """The conversations in progress that ``paths`` hold (missing files hold none), those with the most
    answers where several lines hold one; only the sample ids ``mine`` accepts. Read only: a torn last line
    is left out here and cut by the next compaction."""
    found: dict[str, PartialConversation] = {}
    for path in paths:
        try:
            f = open(path, encoding="utf-8")  # noqa: SIM115 (closed below; a missing file holds nothing)
        except FileNotFoundError:
            continue
        with f:
            for number, line in enumerate(f, start=1):
                if not line.endswith("\n") or not line.strip():  # torn by a kill mid-write, or blank
                    continue
                where = f"{path}:{number}"
                try:
                    value = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{where} is not valid JSON ({e}): not a file this command wrote") from e
                if not isinstance(value, dict) or not isinstance(value.get(KEY), str):
                    raise DataError(f"{where} has no string {KEY!r}: not a file this command wrote")
                if not mine(value[KEY]):
                    continue
                entry = PartialConversation.from_dict(value, where=where)
                best = found.get(entry.sample_id)
                if best is None or len(entry.answers) >= len(best.answers):
                    found[entry.sample_id] = entry
    return found


def append_partials(path: Path, entries: Sequence[PartialConversation]) -> None:
    """Append ``entries`` to ``path`` as flushed lines, durable (fsync) on return; a torn last line left by
    an earlier kill is cut first (``ResumableJsonl``), so that no line is glued to it."""
    if not entries:
        return
    with ResumableJsonl(path, key=KEY) as out:
        for entry in entries:
            out.append(entry.to_dict())
        out.flush()


def compact_partials(path: Path, parts: Sequence[Path], *, done: Callable[[str], bool]) -> int:
    """Fold ``parts`` into ``path``, keeping the longest entry of each conversation not ``done`` (written
    or failed by now); ``path`` is removed when none is left. Returns the conversations left."""
    entries = [e for e in read_partials([path, *parts]).values() if not done(e.sample_id)]
    if entries:
        staged = path.with_name(path.name + ".tmp")
        with open(staged, "w", encoding="utf-8") as f:
            for entry in entries:
                f.write(json.dumps(entry.to_dict(), ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(staged, path)  # a kill leaves the old file or the new one, whole
    else:
        path.unlink(missing_ok=True)
    for part in parts:
        part.unlink()
    return len(entries)
