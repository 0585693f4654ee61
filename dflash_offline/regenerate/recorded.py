"""What an existing regenerate output says about the settings that wrote it, checked before a resume.

Every output line records its ``regenerated_by`` settings; a resume with another target, answer length,
temperature (or, sampled, another seed or top-p) would append answers of another kind to the same data set
without a word (or continue a conversation kept in progress with them). The first line of the output, of
the partial file and of each worker part left by a killed run is read (one line each: cheap at any output
size), and a difference is refused naming both values.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash_offline.config_fields import field_ref
from dflash_offline.errors import ConfigError
from dflash_offline.regenerate.config import PARTIAL_SUFFIX, RegenerateConfig

CHECKED = {field: field_ref(RegenerateConfig, field) for field in ("max_new_tokens", "temperature")}
"""``regenerated_by`` fields a resume must repeat, and their flags."""

CHECKED_WHEN_SAMPLED = {field: field_ref(RegenerateConfig, field) for field in ("seed", "top_p")}
"""Fields a sampled resume (temperature > 0) must repeat too: they choose its answers, so a file resumed with
another seed or nucleus would mix two samplings under one name. A greedy answer depends on neither. An
output written before ``top_p`` was recorded is not checked for it."""

EARLIER_SAMPLER = "gumbel-max"
"""The decode engine's sampler before answers recorded theirs (``decode/sampling.py``'s ``SAMPLER``)."""


def first_settings(path: Path) -> dict[str, Any] | None:
    """The ``regenerated_by`` of the first line of ``path`` (None: no file, no complete line, none)."""
    try:
        with open(path, encoding="utf-8") as f:
            line = f.readline()
    except OSError:
        return None
    try:
        record = json.loads(line)
    except ValueError:  # empty, or a partial line left by a kill (repaired by the resume)
        return None
    settings = record.get("regenerated_by") if isinstance(record, dict) else None
    return settings if isinstance(settings, dict) else None


def check_resume_settings(config: RegenerateConfig) -> None:
    """Refuse to resume an output (or its conversations in progress) written by another target (its
    ``target_id``: ``default``, ``random:<preset>``, the model folder's or GGUF file's name) or with another
    --max-new-tokens or --temperature (sampled: another seed, top-p or sampling algorithm)."""
    outputs = [config.out, config.partial_path]
    if config.parts_dir.is_dir():
        outputs += sorted(p for p in config.parts_dir.glob("w*.jsonl") if ".failures." not in p.name)
        outputs += sorted(config.parts_dir.glob(f"w*{PARTIAL_SUFFIX}"))
    for path in outputs:
        recorded = first_settings(path)
        if recorded is None:
            continue
        checked = CHECKED | (CHECKED_WHEN_SAMPLED if config.temperature > 0 else {})
        for field, option in checked.items():
            if field in recorded and recorded[field] != getattr(config, field):
                raise ConfigError(
                    f"{option} {getattr(config, field)} differs from the {option} {recorded[field]} that "
                    f"wrote {path}: resume with {option} {recorded[field]}, or write to another "
                    f"{field_ref(RegenerateConfig, 'out')}"
                )
        if config.temperature > 0 and config.engine != "openai" and "served_model" not in recorded:
            _check_sampler(recorded.get("sampler", EARLIER_SAMPLER), path)
        if "target" in recorded:
            _check_target(config, recorded["target"], path)


def _check_sampler(recorded: object, path: Path) -> None:
    """A sampled output extended by the decode engine must have been drawn by the same sampling algorithm:
    another one gives other answers for the same seed, so the file would hold two samplings under one."""
    from dflash_offline.decode.sampling import SAMPLER

    if recorded != SAMPLER:
        raise ConfigError(
            f"{path} was sampled by the {recorded} sampler and this version samples by {SAMPLER}: its seed "
            f"would draw other answers here; write to another {field_ref(RegenerateConfig, 'out')}"
        )


def _check_target(config: RegenerateConfig, recorded: object, path: Path) -> None:
    """The target that wrote ``path`` (its recorded ``target_id``) must be the one resuming it."""
    from dflash_offline.target_model.source import resolve_target

    target_id = resolve_target(config.target).target_id
    if recorded != target_id:
        option = field_ref(RegenerateConfig, "target")
        raise ConfigError(
            f"{option} {config.target} (target {target_id}) is not the target {recorded} that wrote {path}: "
            f"resume with that target, or write to another {field_ref(RegenerateConfig, 'out')}"
        )
