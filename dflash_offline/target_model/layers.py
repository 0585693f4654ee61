"""Which target decoder layers are captured (docs/drafter.md#captured-layers).

A feature is the residual stream *after* decoder layer i (HF ``output_hidden_states[i + 1]``), before
any final norm. Because our capture runs the layers directly and never applies the final norm, layer
L−1 may be captured too (through ``output_hidden_states`` its entry would be post-norm instead).
"""

from __future__ import annotations

from dflash_offline.config_fields import field_ref
from dflash_offline.errors import ConfigError

# The options these checks are about (the module sits below GenerateConfig: it names the class).
LAYER_IDS = field_ref("GenerateConfig", "layer_ids")
NUM_FEATURES = field_ref("GenerateConfig", "num_features")


def default_layer_ids(num_target_layers: int, num_features: int = 5) -> tuple[int, ...]:
    """The DFlash rule (z-lab): ``int(round(1 + i·(L−4)/(n−1)))`` for i = 0..n−1; n = 1 -> (L // 2,).

    Python's ``round`` (half to even) is part of the rule: other engines that round half up number
    some layers differently. Raises ``ConfigError`` when the rule yields repeated ids (L < n + 3 or
    so), since silently deduplicating would change the feature width."""
    if num_target_layers < 1:
        raise ConfigError(f"the target has {num_target_layers} layers; need at least 1")
    if num_features < 1:
        raise ConfigError(f"{NUM_FEATURES} must be >= 1, got {num_features}")
    ids = _rule_ids(num_target_layers, num_features)
    if not _rule_fits(num_target_layers, num_features):
        limit = max_default_features(num_target_layers)
        raise ConfigError(
            f"the DFlash default rule gives layer ids {list(ids)} for {num_features} features of a "
            f"{num_target_layers}-layer target (repeated or out of range); it fits at most {limit} "
            f"feature{'s' if limit != 1 else ''} there ({NUM_FEATURES} {limit}), or pass {LAYER_IDS} "
            f"explicitly (e.g. {','.join(str(i) for i in range(min(num_features, num_target_layers)))})"
        )
    return ids


def _rule_ids(num_target_layers: int, num_features: int) -> tuple[int, ...]:
    if num_features == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(round(1 + i * span / (num_features - 1)) for i in range(num_features))


def _rule_fits(num_target_layers: int, num_features: int) -> bool:
    ids = _rule_ids(num_target_layers, num_features)
    return len(set(ids)) == len(ids) and min(ids) >= 0 and max(ids) < num_target_layers


def max_default_features(num_target_layers: int) -> int:
    """The largest n for which the default rule gives n distinct ids in range (1 always fits)."""
    return max(n for n in range(1, num_target_layers + 1) if _rule_fits(num_target_layers, n))


def split_layer_ids(text: str) -> tuple[int, ...]:
    """``"1,9,17"`` -> (1, 9, 17): the one parser of ``--layer-ids``. Refuses (``ConfigError``) anything
    that is not integers, ascending and unique, never sorting or deduplicating (that would change which
    features a cache holds); ``check_layer_ids`` adds the range once the target's depth is known."""
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p for p in parts):
        raise ConfigError(f"{LAYER_IDS} {text!r}: give comma-separated integers, e.g. 1,9,17")
    try:
        ids = tuple(int(p) for p in parts)
    except ValueError:
        raise ConfigError(f"{LAYER_IDS} {text!r}: {parts} are not all integers") from None
    return _check_order(ids, text)


def _check_order(ids: tuple[int, ...], text: str) -> tuple[int, ...]:
    if len(set(ids)) != len(ids):
        repeated = sorted({i for i in ids if ids.count(i) > 1})
        raise ConfigError(f"{LAYER_IDS} {text!r}: {repeated} repeat; name each layer once")
    if list(ids) != sorted(ids):
        raise ConfigError(
            f"{LAYER_IDS} {text!r}: ids must be ascending (features are stored in ascending layer "
            f"order), e.g. {','.join(str(i) for i in sorted(ids))}"
        )
    return ids


def parse_layer_ids(text: str, num_target_layers: int) -> tuple[int, ...]:
    """Parse ``"1,9,17"`` into ascending unique ids in [0, L). Raises ``ConfigError`` naming the problem."""
    return check_layer_ids(split_layer_ids(text), num_target_layers, spelled=text)


def check_layer_ids(
    ids: tuple[int, ...], num_target_layers: int, *, spelled: str | None = None
) -> tuple[int, ...]:
    """``ids`` if they are ascending, unique and in [0, L); else ``ConfigError`` naming the problem
    (never sorted or deduplicated silently: that would change which features a cache holds)."""
    text = ",".join(str(i) for i in ids) if spelled is None else spelled
    if not ids:
        raise ConfigError(f"{LAYER_IDS}: give at least one layer id")
    bad = [i for i in ids if not 0 <= i < num_target_layers]
    if bad:
        raise ConfigError(
            f"{LAYER_IDS} {text!r}: {bad} out of range; the target has {num_target_layers} layers "
            f"(valid ids 0..{num_target_layers - 1})"
        )
    return _check_order(ids, text)


def resolve_layer_ids(
    num_target_layers: int,
    *,
    num_features: int | None = None,
    layer_ids: str | tuple[int, ...] | None = None,
) -> tuple[int, ...]:
    """``--layer-ids`` when given (and consistent with ``--num-features`` if both are), else the default."""
    if layer_ids is None:
        return default_layer_ids(num_target_layers, 5 if num_features is None else num_features)
    if isinstance(layer_ids, str):
        ids = parse_layer_ids(layer_ids, num_target_layers)
    else:
        ids = check_layer_ids(tuple(layer_ids), num_target_layers)
    if num_features is not None and num_features != len(ids):
        raise ConfigError(
            f"{NUM_FEATURES} {num_features} but {LAYER_IDS} {layer_ids!r} names {len(ids)} layers"
        )
    return ids
