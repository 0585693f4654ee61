"""The DFlash drafter's configuration: shape copied from the target, plus the DFlash-specific fields.

docs/drafter.md#architecture: L_d Qwen3-style layers at the target's width (hidden, heads, KV heads, head
dim, MLP size, RMSNorm eps and RoPE base copied from the target's HF config), block size B, the target layer
ids whose residual streams make the context features, the mask token id, and the training knobs of the loss
(γ of the decayed cross-entropy, number of anchors per document).

RoPE: the drafter always uses default (unscaled) RoPE with the target's base ``rope_theta``; a target's
``rope_scaling`` (e.g. Llama-3.1's "llama3") is not copied. The export writes exactly what was trained
(``rope_type: default``), so a serving engine reproduces it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from dflash_offline.drafter_shape import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_NUM_ANCHORS,
    DEFAULT_NUM_LAYERS,
    MIN_BLOCK_SIZE,
)
from dflash_offline.errors import ConfigError

# γ of the decayed loss by block size, from the DFlash paper (docs/drafter.md#labels-and-loss). Other
# block sizes use DEFAULT_LOSS_GAMMA: a plain choice, not a published one.
LOSS_GAMMA_BY_BLOCK_SIZE: dict[int, float] = {16: 7.0, 10: 5.0, 8: 4.0}
DEFAULT_LOSS_GAMMA = 7.0


def default_loss_gamma(block_size: int) -> float:
    """γ for ``block_size``: 7 for B = 16, 5 for B = 10, 4 for B = 8, else 7."""
    return LOSS_GAMMA_BY_BLOCK_SIZE.get(block_size, DEFAULT_LOSS_GAMMA)


@dataclass(frozen=True, kw_only=True, slots=True)
class DrafterConfig:
    """Everything needed to build a ``DFlashDrafter`` (its frozen embedding/LM head come separately)."""

    hidden_size: int
    """H: width of the residual stream, equal to the target's hidden size."""
    num_layers: int = DEFAULT_NUM_LAYERS
    """L_d: number of drafter decoder layers."""
    num_attention_heads: int
    """Query heads per layer."""
    num_key_value_heads: int
    """Key/value heads per layer (GQA); divides ``num_attention_heads``."""
    head_dim: int
    """Width of one attention head."""
    intermediate_size: int
    """Width of the SwiGLU MLP."""
    rms_norm_eps: float
    """Epsilon of every RMSNorm."""
    rope_theta: float
    """RoPE base (default RoPE, no scaling)."""
    vocab_size: int
    """V: rows of the target's embedding and LM head."""
    block_size: int = DEFAULT_BLOCK_SIZE
    """B: tokens per draft block (the anchor plus B−1 masked slots)."""
    target_layer_ids: tuple[int, ...]
    """Target layers (0-based, ascending) whose outputs are concatenated into the features."""
    num_target_layers: int
    """L: number of decoder layers of the target."""
    mask_token_id: int
    """Embedding row used for the B−1 masked block slots; a valid row of the target's embedding."""
    max_position_embeddings: int
    """Largest position the drafter is meant to see (copied from the target; exported)."""
    loss_gamma: float | None = None
    """γ of the decayed cross-entropy; None = ``default_loss_gamma(block_size)``."""
    num_anchors: int = DEFAULT_NUM_ANCHORS
    """N_a: anchors drawn per document (fewer when a document has fewer eligible positions)."""
    initializer_range: float = field(default=0.02)
    """Standard deviation of the normal initialisation of linear weights (Qwen3's default)."""

    def __post_init__(self) -> None:
        positive = {
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "num_target_layers": self.num_target_layers,
            "max_position_embeddings": self.max_position_embeddings,
            "num_anchors": self.num_anchors,
        }
        for name, value in positive.items():
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"drafter {name}={value!r} must be a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}; copy both from the target config"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.block_size < MIN_BLOCK_SIZE:
            raise ConfigError(
                f"block_size={self.block_size} must be at least {MIN_BLOCK_SIZE} (the anchor + one draft)"
            )
        if not self.target_layer_ids:
            raise ConfigError("target_layer_ids is empty; give at least one target layer id")
        ids = tuple(self.target_layer_ids)
        if any(not 0 <= i < self.num_target_layers for i in ids) or list(ids) != sorted(set(ids)):
            raise ConfigError(
                f"target_layer_ids={list(ids)} must be distinct, ascending and in "
                f"[0, {self.num_target_layers}) for a target of {self.num_target_layers} layers"
            )
        object.__setattr__(self, "target_layer_ids", ids)
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(
                f"mask_token_id={self.mask_token_id} is not a row of the target embedding "
                f"(vocab_size={self.vocab_size}); see drafter.mask_token.resolve_mask_token_id"
            )
        if self.loss_gamma is not None and not self.loss_gamma > 0:
            raise ConfigError(f"loss_gamma={self.loss_gamma} must be > 0 (or None for the default)")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0:
            raise ConfigError(
                f"rms_norm_eps={self.rms_norm_eps} and rope_theta={self.rope_theta} must be positive"
            )

    @property
    def gamma(self) -> float:
        """The γ actually used by the loss."""
        return self.loss_gamma if self.loss_gamma is not None else default_loss_gamma(self.block_size)

    @property
    def num_features(self) -> int:
        """n: number of target layers concatenated into one feature row."""
        return len(self.target_layer_ids)

    @property
    def feature_width(self) -> int:
        """F = n·H: width of one feature row as stored in the cache."""
        return self.num_features * self.hidden_size

    @classmethod
    def from_target_config(
        cls,
        hf_config: dict[str, Any],
        *,
        target_layer_ids: tuple[int, ...] | list[int],
        mask_token_id: int,
        num_layers: int = DEFAULT_NUM_LAYERS,
        block_size: int = DEFAULT_BLOCK_SIZE,
        loss_gamma: float | None = None,
        num_anchors: int = DEFAULT_NUM_ANCHORS,
    ) -> DrafterConfig:
        """Copy the drafter's shape from a Llama/Qwen-style HF ``config.json`` dict.

        ``head_dim`` may be absent (then hidden/heads), ``num_key_value_heads`` too (then heads);
        ``rope_theta`` is read from the top level or from transformers-5 ``rope_parameters``.
        A multimodal config's ``text_config`` is used when the top level has no ``hidden_size``.
        """
        cfg = hf_config
        if "hidden_size" not in cfg and isinstance(cfg.get("text_config"), dict):
            cfg = cfg["text_config"]
        missing = [
            k
            for k in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
            if k not in cfg
        ]
        if "num_hidden_layers" not in cfg:
            missing.append("num_hidden_layers")
        if missing:
            raise ConfigError(
                f"the target config lacks {missing}; give the config.json of a Llama/Qwen-style decoder"
            )
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        head_dim = cfg.get("head_dim")
        return cls(
            hidden_size=hidden,
            num_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim) if head_dim else hidden // heads,
            intermediate_size=int(cfg["intermediate_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(cfg),
            vocab_size=int(cfg["vocab_size"]),
            block_size=block_size,
            target_layer_ids=tuple(int(i) for i in target_layer_ids),
            num_target_layers=int(cfg["num_hidden_layers"]),
            mask_token_id=int(mask_token_id),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
            loss_gamma=loss_gamma,
            num_anchors=num_anchors,
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``target_layer_ids`` as a list); inverse of ``from_dict``."""
        out = asdict(self)
        out["target_layer_ids"] = list(self.target_layer_ids)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DrafterConfig:
        """Parse ``to_dict`` output; unknown or missing keys raise ``ConfigError``."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown drafter config keys {unknown}; known keys: {sorted(known)}")
        try:
            return cls(**{**data, "target_layer_ids": tuple(data["target_layer_ids"])})
        except (TypeError, KeyError) as exc:
            raise ConfigError(f"incomplete drafter config: {exc}") from exc


def _rope_theta(cfg: dict[str, Any]) -> float:
    if "rope_theta" in cfg and cfg["rope_theta"] is not None:
        return float(cfg["rope_theta"])
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        return float(params["rope_theta"])
    return 10000.0
