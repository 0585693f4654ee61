"""Build the drafter for a cache: its shape from the target's config, its frozen embedding and LM head
from the target's weights (those two tensors only), its layer ids from the cache fingerprint."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_offline.cache.fingerprint import CacheFingerprint
from dflash_offline.config_fields import flag
from dflash_offline.drafter.config import DrafterConfig
from dflash_offline.drafter.mask_token import resolve_mask_token_id
from dflash_offline.drafter.model import DFlashDrafter
from dflash_offline.errors import ConfigError
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
