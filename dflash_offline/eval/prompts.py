"""Held-out evaluation prompts: conversations of a data set whose sample ids the drafter never trained on.

A prompt is the conversation up to (excluding) its first assistant turn, rendered with the target's
chat template and ``add_generation_prompt=True``: exactly what the target answers first in the data.
Held out means: its sample id (``make_sample_id`` over the data source name, the record id and the
content: the id ``dflash generate`` stores) is not committed in the training cache. That cache is named
with ``--exclude-cache`` or found from the drafter: an export written by ``dflash train`` sits in
``RUN/drafter`` and ``RUN/config.json`` names the cache.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dflash_offline.data.records import Conversation
from dflash_offline.data.schemas import DataFormat
from dflash_offline.data.sources import iter_records, source_name_for_cache
from dflash_offline.errors import ConfigError


@dataclass(frozen=True, kw_only=True, slots=True)
class HeldOut:
    """Which sample ids are excluded from evaluation, and why."""

    cache_dir: Path | None
    """The training cache whose committed samples are excluded (None: nothing is excluded)."""
    excluded_ids: frozenset[str]
    """Sample ids committed in that cache."""
    note: str
    """One line for the report: where the exclusion comes from, or why held-out is not guaranteed."""
    source: str | None = None
    """The source name the prompts' sample ids hash (None: ``source_name(data)``): an older training
    cache recorded the full file name, and its ids must be comparable."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalPrompt:
    """One evaluation prompt."""

    sample_id: str
    """Stable id of the conversation it comes from (``make_sample_id``)."""
    record_id: str
    """The record's own id (may be empty)."""
    source_index: int
    """0-based position of the record in its file."""
    prompt_ids: tuple[int, ...]
    """Token ids of the rendered prompt (chat template, generation prompt added, no extra specials)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PromptSelection:
    """The chosen prompts and how many records were passed over."""

    prompts: tuple[EvalPrompt, ...]
    records_read: int
    """Records looked at (from --skip on)."""
    excluded: int
    """Records skipped because their sample id is in the training cache."""
    unusable: int
    """Records skipped because they failed to parse, have no user turn before the first assistant turn,
    fail to render, or exceed ``max_prompt_tokens``."""


def run_dir_of(drafter_dir: Path) -> Path | None:
    """The ``dflash train`` run a drafter was exported by (``RUN/drafter``, ``RUN/drafter-last``, …
    next to ``RUN/config.json``); else None."""
    resolved = drafter_dir.resolve()
    if not resolved.name.startswith("drafter") or not (resolved.parent / "config.json").is_file():
        return None
    return resolved.parent


def training_cache_of(drafter_dir: Path) -> Path | None:
    """The cache a drafter was trained from, when it is the export of a ``dflash train`` run
    (``RUN/drafter`` next to ``RUN/config.json`` naming ``cache_dir``); else None."""
    run_dir = run_dir_of(drafter_dir)
    if run_dir is None:
        return None
    config_path = run_dir / "config.json"
    try:
        config: Any = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    cache_dir = config.get("cache_dir") if isinstance(config, dict) else None
    if not isinstance(cache_dir, str):
        return None
    return Path(cache_dir)  # as train read it (a relative path was relative to train's directory)


def resolve_held_out(*, exclude_cache: Path | None, drafter_dir: Path, data: str | Path | None) -> HeldOut:
    """Read the committed sample ids of the training cache (explicit, else inferred from the drafter)."""
    from dflash_offline.cache.layout import read_fingerprint
    from dflash_offline.cache.manifest import committed_sample_ids

    inferred = exclude_cache is None
    cache_dir = exclude_cache if exclude_cache is not None else training_cache_of(drafter_dir)
    if cache_dir is None:
        return HeldOut(
            cache_dir=None,
            excluded_ids=frozenset(),
            note=(
                f"held-out not guaranteed: {drafter_dir} is not inside a `dflash train` run and no "
                "--exclude-cache was given, so no training sample is excluded"
            ),
        )
    if not (cache_dir / "cache.json").is_file():
        if inferred:
            return HeldOut(
                cache_dir=None,
                excluded_ids=frozenset(),
                note=(
                    f"held-out not guaranteed: the training run names cache {cache_dir}, which is not "
                    "here; pass --exclude-cache with its new location"
                ),
            )
        raise ConfigError(f"--exclude-cache {cache_dir}: not a dflash cache (no cache.json)")
    fingerprint = read_fingerprint(cache_dir)
    ids = set(committed_sample_ids(cache_dir))
    source = source_name_for_cache(data, fingerprint.data_source)
    how = "inferred from the drafter's training run" if inferred else "--exclude-cache"
    note = f"excluding {len(ids)} samples of training cache {cache_dir} ({how})"
    originals = regenerated_source_ids(cache_dir)
    if originals:
        ids |= originals
        note += f" and the {len(originals)} records its regenerated data was answered from"
    elif fingerprint.data_source != source:
        note += (
            f"; that cache was generated from {fingerprint.data_source!r}, these prompts come from "
            f"{source!r}, so no id can match: held out by source"
        )
    held_out = HeldOut(cache_dir=cache_dir, excluded_ids=frozenset(ids), note=note, source=source)
    return release_validation_split(held_out, drafter_dir, cache_source=fingerprint.data_source)


def release_validation_split(held_out: HeldOut, drafter_dir: Path, *, cache_source: str) -> HeldOut:
    """``held_out`` less what the drafter's training run held out for validation (train/split.py): the
    drafter never trained on those samples, nor on the records a regenerated validation sample was
    answered from (unless a trained sample was answered from the same record)."""
    from dflash_offline.train.split import validation_ids_of_run

    run_dir = run_dir_of(drafter_dir)
    validation = None if run_dir is None or held_out.cache_dir is None else validation_ids_of_run(run_dir)
    if not validation or held_out.cache_dir is None:
        return held_out
    released = set(validation)
    answered_from = regenerated_sources(held_out.cache_dir, source=cache_source)
    trained_from = {src for sample_id, src in answered_from.items() if sample_id not in validation}
    released |= {src for sample_id, src in answered_from.items() if sample_id in validation} - trained_from
    kept = held_out.excluded_ids - released
    note = (
        f"{held_out.note}; not excluded: the {len(held_out.excluded_ids) - len(kept)} of them the "
        f"drafter's run {run_dir} held out for validation (never trained on)"
    )
    return replace(held_out, excluded_ids=frozenset(kept), note=note)


def regenerated_sources(cache_dir: Path, *, source: str) -> dict[str, str]:
    """Sample id (as the cache computes it, over ``source``) → ``source_sample_id`` of every line of the
    ``dflash regenerate`` outputs named by the cache's generate runs (see ``regenerated_source_ids``)."""
    from dflash_offline.data.jsonstream import RawRecord
    from dflash_offline.data.sources import parse_record

    found: dict[str, str] = {}
    for path in _regenerated_files(cache_dir):
        with open(path, encoding="utf-8", errors="replace") as f:
            for index, line in enumerate(f):
                if '"source_sample_id"' not in line:
                    continue
                try:
                    value = json.loads(line)
                except json.JSONDecodeError:
                    continue
                origin = value.get("source_sample_id") if isinstance(value, dict) else None
                raw = RawRecord(
                    source_index=index, where=f"line {index + 1}", value=value, error=None, truncated=False
                )
                item = parse_record(raw, source=source)
                if isinstance(origin, str) and isinstance(item, Conversation):
                    found[item.sample_id] = origin
    return found


def regenerated_source_ids(cache_dir: Path) -> set[str]:
    """Sample ids of the original records behind a cache generated from ``dflash regenerate`` output.

    Such a cache's own ids hash the regenerated conversations, which share their user turns (the eval
    prompts) with the original records: the ``source_sample_id`` of every line of the data files named
    by the cache's generate runs are excluded as well. Files no longer on disk are passed over."""
    found: set[str] = set()
    for path in _regenerated_files(cache_dir):
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if '"source_sample_id"' not in line:
                    continue
                try:
                    value = json.loads(line).get("source_sample_id")
                except (json.JSONDecodeError, AttributeError):
                    continue
                if isinstance(value, str):
                    found.add(value)
    return found


def _regenerated_files(cache_dir: Path) -> list[Path]:
    """The JSONL data files named by the cache's generate runs that are still on disk."""
    from dflash_offline.cache.manifest import read_runs

    try:
        runs = read_runs(cache_dir)
    except Exception:  # an unreadable runs table only loses this extra safety net
        return []
    paths = set()
    for run in runs:
        try:
            data = json.loads(run.config_json).get("data")
        except (json.JSONDecodeError, AttributeError):
            continue
        if isinstance(data, str) and data.endswith(".jsonl") and Path(data).is_file():
            paths.add(Path(data))
    return sorted(paths)


def prompt_messages(conv: Conversation) -> list[dict[str, str]] | None:
    """The messages before the first assistant turn, or None when they hold no user turn."""
    messages: list[dict[str, str]] = []
    for m in conv.messages:
        if m.role == "assistant":
            break
        messages.append({"role": m.role, "content": m.content})
    if not any(m["role"] == "user" and m["content"].strip() for m in messages):
        return None
    return messages


def render_prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` rendered with the generation prompt (no special tokens added twice)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]


def select_prompts(
    data: str | Path | None,
    tokenizer: Any,
    *,
    held_out: HeldOut,
    limit: int,
    skip: int = 0,
    max_prompt_tokens: int = 2048,
    data_format: DataFormat = "auto",
) -> PromptSelection:
    """The first ``limit`` usable, held-out prompts of ``data`` from record ``skip`` on."""
    if limit < 1:
        raise ConfigError(f"--limit must be >= 1, got {limit}")
    prompts: list[EvalPrompt] = []
    read = excluded = unusable = 0
    for item in iter_records(data, skip=skip, data_format=data_format, source=held_out.source):
        if len(prompts) >= limit:
            break
        read += 1
        if not isinstance(item, Conversation):
            unusable += 1
            continue
        if item.sample_id in held_out.excluded_ids:
            excluded += 1
            continue
        messages = prompt_messages(item)
        if messages is None:
            unusable += 1
            continue
        try:
            ids = render_prompt_ids(tokenizer, messages)
        except Exception:  # a chat template may raise anything (jinja's raise_exception, ...)
            unusable += 1
            continue
        if not 1 <= len(ids) <= max_prompt_tokens:
            unusable += 1
            continue
        prompts.append(
            EvalPrompt(
                sample_id=item.sample_id,
                record_id=item.record_id,
                source_index=item.source_index,
                prompt_ids=tuple(ids),
            )
        )
    return PromptSelection(prompts=tuple(prompts), records_read=read, excluded=excluded, unusable=unusable)
