"""Build the drafter for a cache: its shape from the target's config, its frozen embedding and LM head
from the target's weights (those two tensors only), its layer ids from the cache fingerprint; and, for a
run started ``--init-from`` an export, its first weights from that export."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_offline.cache.fingerprint import CacheFingerprint
from dflash_offline.config_fields import flag
from dflash_offline.drafter.config import DrafterConfig
from dflash_offline.drafter.mask_token import resolve_mask_token_id
from dflash_offline.drafter.model import DFlashDrafter
from dflash_offline.errors import ConfigError, DrafterFormatError
from dflash_offline.train.config import TrainConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class DrafterSetup:
    """A freshly initialised drafter and where its frozen parts came from."""

    model: DFlashDrafter
    target_spec: str
    """The ``--target`` spec the embedding and LM head were read from."""


def target_spec_for(config_target: str | None, fingerprint: CacheFingerprint) -> str:
    """The target to borrow the head from: the explicit one, else the cache's own when it can be
    loaded by name (``default``, ``random:<preset>``). The spec must be the cache's target."""
    from dflash_offline.target_model.loader import resolve_target, target_info

    if config_target is None:
        if fingerprint.target_id == "default" or fingerprint.target_id.startswith("random:"):
            return fingerprint.target_id
        raise ConfigError(
            f"the cache was generated with target {fingerprint.target_id!r}; pass "
            f"{flag(TrainConfig, 'target')} with its model directory or .gguf file so that the drafter can "
            "borrow its embedding and LM head"
        )
    info = target_info(resolve_target(config_target))
    if info.weights_hash != fingerprint.weights_hash:
        raise ConfigError(
            f"{flag(TrainConfig, 'target')} {config_target!r} has weights hash {info.weights_hash}, the "
            f"cache was generated with {fingerprint.weights_hash} ({fingerprint.target_id}): use the cache's "
            "target"
        )
    return config_target


def build_drafter_setup(
    config: TrainConfig, fingerprint: CacheFingerprint, *, device: torch.device
) -> DrafterSetup:
    from dflash_offline.target_model.head import load_embedding_and_head
    from dflash_offline.target_model.loader import load_tokenizer

    spec = target_spec_for(config.target, fingerprint)
    head = load_embedding_and_head(spec, device=device)
    tokenizer = load_tokenizer(spec)
    mask_token_id = resolve_mask_token_id(tokenizer, head.info.vocab_size, config.mask_token_id)
    drafter_config = DrafterConfig.from_target_config(
        head.info.hf_config,
        target_layer_ids=fingerprint.layer_ids,
        mask_token_id=mask_token_id,
        num_layers=config.num_layers,
        block_size=config.block_size,
        loss_gamma=config.gamma,
        num_anchors=config.num_anchors,
    )
    torch.manual_seed(config.seed)  # the initial weights are a function of the seed
    model = DFlashDrafter(drafter_config, embed_VH=head.embed_VH, lm_head_VH=head.lm_head_VH).to(device)
    if config.final_norm_init != 1.0:
        with torch.no_grad():
            model.norm.weight.fill_(config.final_norm_init)
    return DrafterSetup(model=model, target_spec=spec)


ARCHITECTURE_FIELDS = (
    "num_layers",
    "block_size",
    "mask_token_id",
    "target_layer_ids",
    "num_target_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "rms_norm_eps",
    "rope_theta",
)
"""The ``DrafterConfig`` fields that shape the weights or what they compute: an export to start from must
have this run's."""


def _how_to_match(name: str) -> str:
    """What makes a run match an export that differs from it in ``name``."""
    own = {  # the run's own options
        "num_layers": flag(TrainConfig, "num_layers"),
        "block_size": flag(TrainConfig, "block_size"),
        "mask_token_id": flag(TrainConfig, "mask_token_id"),
    }
    if name in own:
        return f"pass {own[name]}"
    if name == "target_layer_ids":
        return "train on a cache of the same captured layers"
    return "train on a cache of that drafter's target"


def init_weights_from(model: DFlashDrafter, directory: Path) -> int:
    """Load the weights of the export in ``directory`` into the fresh training drafter ``model``, whose
    feature scale (if any) is already installed; return how many values were loaded.

    The export folds its run's feature scale into fc.weight (W·diag(s)); this run applies its own scale s'
    before fc, so fc starts at W·diag(s)·diag(1/s'): the drafter computes exactly the export's function
    (up to rounding), whatever the two caches' statistics."""
    from dflash_offline.drafter.export import load_exported_drafter, read_export_config

    init_from = flag(TrainConfig, "init_from")
    if not directory.is_dir():
        raise ConfigError(f"{init_from} {directory}: not a directory (an exported drafter: RUN/drafter)")
    try:
        theirs = read_export_config(directory)
    except DrafterFormatError as exc:
        raise ConfigError(f"{init_from} {directory}: {exc}") from exc
    mine = model.config
    differ = [name for name in ARCHITECTURE_FIELDS if getattr(theirs, name) != getattr(mine, name)]
    if differ:
        what = [
            f"{name} {getattr(theirs, name)} (this run: {getattr(mine, name)}; {_how_to_match(name)})"
            for name in differ
        ]
        raise ConfigError(
            f"{init_from} {directory}: that drafter differs from this run's in " + "; ".join(what)
        )
    weight = model.fc.weight
    source = load_exported_drafter(
        directory, embed_VH=model.embed_VH, lm_head_VH=model.lm_head_VH, device=weight.device
    )
    state = {key: t.to(weight.dtype) for key, t in source.state_dict().items()}
    if model.feature_scale_F is not None:
        state["fc.weight"] = (source.fc.weight.float() / model.feature_scale_F[None, :]).to(weight.dtype)
    with torch.no_grad():
        result = model.load_state_dict(state, strict=False)
    assert not result.unexpected_keys, result.unexpected_keys
    assert set(result.missing_keys) <= {"feature_scale_F"}, result.missing_keys
    return sum(t.numel() for t in state.values())
