"""The ``validation`` set of ``dflash eval``: the records the drafter's training run held out.

``dflash train`` measures its validation τ on the cached answers of the samples it held out (its split
file, run_split.py): teacher-forced, over every turn. This set decodes the same records: their prompts
come from the data file the run's cache was generated from (cache_data.py), each user turn in turn
with ``--turns all`` (after the target's own greedy answers, as MT-Bench's turn 2), so that its τ
compares directly with the validation τ, and with the held-out ``sharegpt`` set decoded the same way.

A run split by sample (``--val-group sample``) may hold out ShareGPT's ``X_11`` and train on ``X_0`` of
the same conversation. The records are therefore split in two sets: ``validation`` (no trained sample
shares the record's conversation root: as unseen as a held-out prompt) and ``validation-trained-root``
(one does); up to ``--limit`` records each, in file order.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_offline.config_fields import field_ref
from dflash_offline.data.conversations import Conversation
from dflash_offline.errors import ConfigError
from dflash_offline.eval.config import EvalConfig, Turns
from dflash_offline.eval.prompts import EvalPrompt, HeldOut, chat_prompt, run_dir_of, training_cache_of
from dflash_offline.run_split import SPLIT_FILE, read_run_split

THIS_SET = f"{field_ref(EvalConfig, 'bench')} validation"
"""How messages name this set."""

UNSEEN_ROOT = "validation"
TRAINED_ROOT = "validation-trained-root"


@dataclass(frozen=True, kw_only=True, slots=True)
class ValidationSelection:
    """The validation records chosen, in two sets."""

    unseen_root: tuple[EvalPrompt, ...]
    """Records of conversations no trained sample belongs to."""
    trained_root: tuple[EvalPrompt, ...]
    """Records of conversations a trained sample belongs to."""
    note: str
    """One line for the report: the run, the counts, where the records were read."""


@dataclass(frozen=True, kw_only=True, slots=True)
class _ValidationRecords:
    """What one pass over a run's cache data finds."""

    candidates: tuple[tuple[Conversation, str], ...]
    """The run's validation records (and their conversation roots) no earlier drafter trained on."""
    trained_roots: frozenset[str]
    """Conversation roots of every trained sample, this run's and the earlier drafters'."""
    trained_before: int
    """Validation records left out: the drafter the run started from trained on them."""


def _scan_validation_records(
    run_dir: Path, cache_dir: Path, validation: AbstractSet[str], inherited: HeldOut | None
) -> _ValidationRecords:
    """One pass over the cache's data files; refused when it finds no validation record to decode."""
    from dflash_offline.cache.layout import read_fingerprint
    from dflash_offline.cache.manifest import committed_sample_ids
    from dflash_offline.eval.cache_data import iter_cache_records, readable_inputs

    trained = committed_sample_ids(cache_dir) - validation
    trained_roots: set[str] = set() if inherited is None else set(inherited.excluded_roots)
    candidates: list[tuple[Conversation, str]] = []
    trained_before = 0
    for record in iter_cache_records(cache_dir, source=read_fingerprint(cache_dir).data_source):
        sample_id = record.conversation.sample_id
        if sample_id in trained:
            trained_roots.add(record.root)
        elif sample_id in validation:
            if inherited is not None and inherited.excluded_ids & {sample_id, record.origin}:
                trained_before += 1
                continue
            candidates.append((record.conversation, record.root))
    if not candidates and trained_before:
        raise ConfigError(
            f"{THIS_SET}: the drafter run {run_dir} started from had trained on all {trained_before} "
            "of its validation records found: none is held out"
        )
    if not candidates:
        files, missing = readable_inputs(cache_dir)
        where = ", ".join(str(p) for p, _ in files) or "no file"
        gone = f" ({', '.join(missing)} not here)" if missing else ""
        raise ConfigError(
            f"{THIS_SET}: none of the run's {len(validation)} validation samples is in the data "
            f"its cache {cache_dir} was generated from: read {where}{gone}"
        )
    return _ValidationRecords(
        candidates=tuple(candidates), trained_roots=frozenset(trained_roots), trained_before=trained_before
    )


def select_validation_prompts(
    drafter_dir: Path,
    tokenizer: Any,
    *,
    limit: int,
    max_prompt_tokens: int,
    turns: Turns,
    inherited: HeldOut | None = None,
) -> ValidationSelection:
    """The validation records of the run ``drafter_dir`` was exported by (module docstring). ``inherited``:
    what the drafter that run started from trained on (``HeldOut.inherited``): its records are left out, and
    its conversations count as trained ones."""
    run_dir = run_dir_of(drafter_dir)
    cache_dir = training_cache_of(drafter_dir)
    if run_dir is None or cache_dir is None:
        raise ConfigError(
            f"{THIS_SET}: {drafter_dir} is not the export of a `dflash train` run (RUN/drafter); "
            "the set is the run's validation records"
        )
    split = read_run_split(run_dir)
    if split is None:
        raise ConfigError(
            f"{THIS_SET}: the run {run_dir} has no {SPLIT_FILE} (trained by an earlier dflash-offline, or "
            "not started): run its `dflash train` command again to write it (a finished run runs no step)"
        )
    validation = split.validation
    if not validation:
        raise ConfigError(
            f"{THIS_SET}: the run {run_dir} holds no sample out for validation (its val_fraction is 0?)"
        )
    if not (cache_dir / "cache.json").is_file():
        raise ConfigError(f"{THIS_SET}: the run's cache {cache_dir} is not here")
    found = _scan_validation_records(run_dir, cache_dir, validation, inherited)
    unseen: list[EvalPrompt] = []
    seen: list[EvalPrompt] = []
    for conv, root in found.candidates:
        chosen = seen if root in found.trained_roots else unseen
        if len(chosen) >= limit:
            continue
        prompt = chat_prompt(conv, tokenizer, max_prompt_tokens=max_prompt_tokens, turns=turns)
        if prompt is not None:
            chosen.append(prompt)
    num_seen = sum(root in found.trained_roots for _, root in found.candidates)
    note = (
        f"validation: {len(found.candidates)} held-out records of run {run_dir} found, {num_seen} of them in "
        f"a conversation a trained sample belongs to ({TRAINED_ROOT}); decoding {len(unseen)} + {len(seen)}"
    )
    if found.trained_before:
        note += f"; left out: {found.trained_before} the drafter this run started from trained on"
    return ValidationSelection(unseen_root=tuple(unseen), trained_root=tuple(seen), note=note)
