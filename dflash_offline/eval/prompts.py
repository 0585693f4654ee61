"""Held-out evaluation prompts: conversations of a data set that the drafter never trained on.

A prompt is the conversation up to (excluding) its first assistant turn, rendered with the target's
chat template and ``add_generation_prompt=True``: exactly what the target answers first in the data.
With ``--turns all`` every user turn is decoded in order, each after the target's own greedy answers to
the earlier ones, the turns cut as ``dflash regenerate`` cuts them (``data/user_groups.py``).
Held out means: its sample id (``make_sample_id`` over the data source name, the record id and the
content: the id ``dflash generate`` stores) is not committed in the training cache, nor is any sample
of its conversation (its root: ShareGPT's ``X_11`` belongs to ``X``, whose ``X_0`` may have been trained
on) unless the run held it out for validation. That cache is named with ``--exclude-cache`` or found
from the drafter: an export written by ``dflash train`` sits in ``RUN/drafter`` and ``RUN/config.json``
names the cache. A run started from another drafter's weights (``dflash train --init-from``) names that
drafter too: what it trained on is not held out either, found the same way down the chain.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_offline.config_fields import field_ref
from dflash_offline.data.conversations import Conversation, Message
from dflash_offline.data.schemas import DataFormat
from dflash_offline.data.sources import conversation_root, iter_records, source_name
from dflash_offline.data.user_groups import user_groups
from dflash_offline.errors import ConfigError
from dflash_offline.eval.config import EvalConfig, Turns
from dflash_offline.run_split import SPLIT_FILE, RunSplit, read_run_split


@dataclass(frozen=True, kw_only=True, slots=True)
class HeldOut:
    """Which sample ids are excluded from evaluation, and why."""

    cache_dir: Path | None
    """The training cache whose committed samples are excluded (None: nothing is excluded)."""
    excluded_ids: frozenset[str]
    """Sample ids committed in that cache."""
    note: str
    """One line for the report: where the exclusion comes from, or why held-out is not guaranteed."""
    excluded_roots: frozenset[str] = frozenset()
    """Conversation roots of the trained samples: a prompt of the same conversation (ShareGPT's ``X_11``
    when ``X_0`` was trained on) is excluded too."""
    inherited: HeldOut | None = None
    """What the drafter the run started from (``dflash train --init-from``) had trained on, itself resolved
    the same way; already included in the sets above."""


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
    """Token ids of the rendered prompt of the first turn (chat template, generation prompt added, no
    extra specials)."""
    turns: tuple[tuple[Message, ...], ...] = ()
    """``--turns all``: the system/user messages before each answer, in order (the first are those of
    ``prompt_ids``); empty: the first turn alone."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PromptSelection:
    """The chosen prompts and how many records were passed over."""

    prompts: tuple[EvalPrompt, ...]
    records_read: int
    """Records looked at (from --skip on)."""
    excluded: int
    """Records skipped because their sample id, or their conversation, is in the training cache."""
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


def _run_path(drafter_dir: Path, key: str, *, section: str | None = None) -> Path | None:
    """The path ``key`` (of the object ``section``, where config.json has it: runs before the sections
    wrote one flat object) of the ``RUN/config.json`` of the run ``drafter_dir`` was exported by; else
    None."""
    run_dir = run_dir_of(drafter_dir)
    if run_dir is None:
        return None
    config_path = run_dir / "config.json"
    try:
        config: Any = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if isinstance(config, dict) and section is not None and isinstance(config.get(section), dict):
        config = config[section]
    value = config.get(key) if isinstance(config, dict) else None
    return Path(value) if isinstance(value, str) else None


def training_cache_of(drafter_dir: Path) -> Path | None:
    """The cache a drafter was trained from, when it is the export of a ``dflash train`` run
    (``RUN/drafter`` next to ``RUN/config.json`` naming ``cache_dir``); else None."""
    return _run_path(drafter_dir, "cache_dir")  # as train read it (relative to train's directory)


def initial_drafter_of(drafter_dir: Path) -> Path | None:
    """The export a drafter's run started from (``dflash train --init-from``, stored absolute); else None."""
    return _run_path(drafter_dir, "init_from", section="drafter")


def resolve_held_out(*, exclude_cache: Path | None, drafter_dir: Path, data: str | Path | None) -> HeldOut:
    """Read the committed sample ids of the training cache (explicit, else inferred from the drafter), and
    what its data files say about them (cache_data.py): the original records regenerated samples were
    answered from, and the conversation roots of the trained samples. A run started from another drafter's
    weights (``dflash train --init-from``) holds out what that drafter trained on too, resolved the same
    way (and so on down the chain)."""
    return _held_out_chain(exclude_cache=exclude_cache, drafter_dir=drafter_dir, data=data, seen=frozenset())


def _held_out_chain(
    *, exclude_cache: Path | None, drafter_dir: Path, data: str | Path | None, seen: frozenset[Path]
) -> HeldOut:
    own = _own_held_out(exclude_cache=exclude_cache, drafter_dir=drafter_dir, data=data)
    initial = initial_drafter_of(drafter_dir)
    if initial is None:
        return own
    seen = seen | {drafter_dir.resolve()}
    if initial.resolve() in seen:
        raise ConfigError(
            f"{drafter_dir}: the drafters its run started from (their runs' init_from) loop back to {initial}"
        )
    inherited = _held_out_chain(exclude_cache=None, drafter_dir=initial, data=data, seen=seen)
    return HeldOut(
        cache_dir=own.cache_dir,
        excluded_ids=own.excluded_ids | inherited.excluded_ids,
        note=f"{own.note}; its run started from the weights of {initial}: {inherited.note}",
        excluded_roots=own.excluded_roots | inherited.excluded_roots,
        inherited=inherited,
    )


def _own_held_out(*, exclude_cache: Path | None, drafter_dir: Path, data: str | Path | None) -> HeldOut:
    """``resolve_held_out`` for the drafter's own run alone."""
    from dflash_offline.cache.layout import read_fingerprint
    from dflash_offline.cache.manifest import committed_sample_ids
    from dflash_offline.eval.cache_data import iter_cache_records

    inferred = exclude_cache is None
    cache_dir = exclude_cache if exclude_cache is not None else training_cache_of(drafter_dir)
    if cache_dir is None or not (cache_dir / "cache.json").is_file():
        return _without_training_cache(cache_dir, drafter_dir=drafter_dir, inferred=inferred)
    fingerprint = read_fingerprint(cache_dir)
    committed = committed_sample_ids(cache_dir)
    source = _prompt_source(data)
    run_dir = run_dir_of(drafter_dir)
    split = read_run_split(run_dir) if run_dir is not None else None
    # Samples of the cache the drafter's run never trained on: its validation split, the samples its
    # train_samples left out, and those committed after it took its snapshot. Without the run's split
    # file: none (every committed sample counts as trained, so nothing trained on is taken for held out).
    never_trained: frozenset[str] = frozenset()
    if split is not None:
        never_trained = frozenset(committed - split.train)
    trained = committed - never_trained
    # One pass over the cache's data files: the records behind the samples.
    origin_of: dict[str, str] = {}
    all_origins: set[str] = set()
    trained_roots: set[str] = set()
    for record in iter_cache_records(cache_dir, source=fingerprint.data_source):
        sample_id = record.conversation.sample_id
        if record.origin is not None:
            all_origins.add(record.origin)
            origin_of[sample_id] = record.origin
        if sample_id in trained:
            trained_roots.add(record.root)
    how = "inferred from the drafter's training run" if inferred else field_ref(EvalConfig, "exclude_cache")
    note = f"excluding {len(committed)} samples of training cache {cache_dir} ({how})"
    ids = set(committed) | all_origins
    if all_origins:
        note += f" and the {len(all_origins)} records its regenerated data was answered from"
    elif source is not None and fingerprint.data_source != source:
        note += (
            f"; that cache was generated from {fingerprint.data_source!r}, these prompts come from "
            f"{source!r}, so no id can match: held out by source"
        )
    if never_trained and split is not None:
        kept = ids - _never_trained_on(never_trained, origin_of)
        note += (
            f"; not excluded: the {len(ids) - len(kept)} of them the drafter's run {run_dir} never trained "
            f"on ({_never_trained_note(never_trained, split)})"
        )
        ids = kept
    if run_dir is not None and split is None:
        note += (
            f"; every one counted as trained: the run {run_dir} has no {SPLIT_FILE} (trained by an earlier "
            "dflash-offline; running its `dflash train` command again writes it, a finished run runs no step)"
        )
    note += _roots_note(cache_dir, trained_roots)
    return HeldOut(
        cache_dir=cache_dir,
        excluded_ids=frozenset(ids),
        note=note,
        excluded_roots=frozenset(trained_roots),
    )


def _prompt_source(data: str | Path | None) -> str | None:
    """The source name of the sharegpt set's prompts; None when ``data`` is the embedded ShareGPT file and
    its package is not installed: only the sharegpt set reads that file, and it says so itself, so a
    HumanEval or MT-Bench eval needs neither."""
    from dflash_offline.errors import DataError

    try:
        return source_name(data)
    except DataError:
        if data is None or str(data) == "default":
            return None
        raise


def _without_training_cache(cache_dir: Path | None, *, drafter_dir: Path, inferred: bool) -> HeldOut:
    """Nothing excluded, and why, when there is no training cache to read (a cache named explicitly that
    is not one is refused)."""
    if cache_dir is None:
        note = (
            f"held-out not guaranteed: {drafter_dir} is not inside a `dflash train` run and no "
            f"{field_ref(EvalConfig, 'exclude_cache')} was given, so no training sample is excluded"
        )
    elif inferred:
        note = (
            f"held-out not guaranteed: the training run names cache {cache_dir}, which is not "
            f"here; pass {field_ref(EvalConfig, 'exclude_cache')} with its new location"
        )
    else:
        raise ConfigError(
            f"{field_ref(EvalConfig, 'exclude_cache')} {cache_dir}: not a dflash cache (no cache.json)"
        )
    return HeldOut(cache_dir=None, excluded_ids=frozenset(), note=note)


def _roots_note(cache_dir: Path, trained_roots: set[str]) -> str:
    """What the note says about the conversation roots of the trained samples."""
    from dflash_offline.eval.cache_data import readable_inputs

    _, missing = readable_inputs(cache_dir)
    if trained_roots:
        return (
            f"; nor any record of the {len(trained_roots)} conversations (roots) the trained samples "
            "belong to"
        )
    if missing:
        return f"; conversation roots not checked: {', '.join(missing)} (its data) is not here"
    return ""


def _never_trained_note(never_trained: frozenset[str], split: RunSplit) -> str:
    """Why the run never trained on ``never_trained`` (its validation split, its train_samples, or a
    commit after its snapshot), counted by cause."""
    held = len(never_trained & split.validation)
    # What train_samples left out is the rest of the snapshot (still committed, unless a repair dropped
    # some); whatever else the run never trained on was committed after it took its snapshot.
    cut = len(never_trained & split.left_out)
    later = len(never_trained) - held - cut
    parts = [f"{held} held out for validation"] if held else []
    if cut:
        parts.append(f"{cut} left out by its train_samples")
    if later:
        parts.append(f"{later} committed after its start")
    return ", ".join(parts)


def _never_trained_on(never_trained: frozenset[str], origin_of: dict[str, str]) -> set[str]:
    """The samples never trained on, and the records a regenerated one was answered from (unless a
    trained sample was answered from the same record)."""
    trained_from = {src for sample_id, src in origin_of.items() if sample_id not in never_trained}
    return set(never_trained) | (
        {src for sample_id, src in origin_of.items() if sample_id in never_trained} - trained_from
    )


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


def chat_prompt(
    item: Conversation, tokenizer: Any, *, max_prompt_tokens: int, turns: Turns = "first"
) -> EvalPrompt | None:
    """The record as an eval prompt; None when it has no user turn to answer first, its first prompt fails
    to render or is longer than ``max_prompt_tokens``."""
    groups = user_groups(item.messages) if turns == "all" else []
    if turns == "all":
        first = [{"role": m.role, "content": m.content} for m in groups[0]] if groups else None
    else:
        first = prompt_messages(item)
    if first is None:
        return None
    try:
        ids = render_prompt_ids(tokenizer, first)
    except Exception:  # a chat template may raise anything (jinja's raise_exception, ...)
        return None
    if not 1 <= len(ids) <= max_prompt_tokens:
        return None
    return EvalPrompt(
        sample_id=item.sample_id,
        record_id=item.record_id,
        source_index=item.source_index,
        prompt_ids=tuple(ids),
        turns=tuple(groups),
    )


def select_prompts(
    data: str | Path | None,
    tokenizer: Any,
    *,
    held_out: HeldOut,
    limit: int,
    skip: int = 0,
    max_prompt_tokens: int = 2048,
    data_format: DataFormat = "auto",
    turns: Turns = "first",
) -> PromptSelection:
    """The first ``limit`` usable, held-out prompts of ``data`` from record ``skip`` on."""
    if limit < 1:
        raise ConfigError(f"{field_ref(EvalConfig, 'limit')} must be >= 1, got {limit}")
    prompts: list[EvalPrompt] = []
    read = excluded = unusable = 0
    for item in iter_records(data, skip=skip, data_format=data_format):
        if len(prompts) >= limit:
            break
        read += 1
        if not isinstance(item, Conversation):
            unusable += 1
            continue
        if item.sample_id in held_out.excluded_ids or (
            conversation_root(item.record_id, item.sample_id) in held_out.excluded_roots
        ):
            excluded += 1
            continue
        prompt = chat_prompt(item, tokenizer, max_prompt_tokens=max_prompt_tokens, turns=turns)
        if prompt is None:
            unusable += 1
            continue
        prompts.append(prompt)
    return PromptSelection(prompts=tuple(prompts), records_read=read, excluded=excluded, unusable=unusable)
