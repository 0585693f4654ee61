"""DrafterConfig: shape copied from HF target configs, γ defaults, dict round trip, validation."""

from __future__ import annotations

import pytest

from dflash_offline.drafter.config import DrafterConfig, default_loss_gamma
from dflash_offline.errors import ConfigError

from .helpers import tiny_config

SMOLLM2_135M = {  # the fields of HuggingFaceTB/SmolLM2-135M-Instruct's config.json (Llama)
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "num_hidden_layers": 30,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}
QWEN3_8B = {  # transformers-5 spelling: rope_theta inside rope_parameters
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_hidden_layers": 36,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
}


def test_from_llama_config_without_head_dim() -> None:
    cfg = DrafterConfig.from_target_config(SMOLLM2_135M, target_layer_ids=[1, 14, 27], mask_token_id=16)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        576,
        9,
        3,
        64,
    )
    assert (cfg.intermediate_size, cfg.rms_norm_eps, cfg.rope_theta) == (1536, 1e-5, 100000.0)
    assert (cfg.vocab_size, cfg.num_target_layers, cfg.max_position_embeddings) == (49152, 30, 8192)
    assert (cfg.num_layers, cfg.block_size, cfg.num_anchors, cfg.gamma) == (5, 16, 512, 7.0)
    assert cfg.feature_width == 3 * 576


def test_from_qwen3_config_with_rope_parameters() -> None:
    cfg = DrafterConfig.from_target_config(
        QWEN3_8B, target_layer_ids=(1, 9, 17, 25, 33), mask_token_id=151669, block_size=8, num_layers=3
    )
    assert cfg.head_dim == 128
    assert cfg.rope_theta == 1e6
    assert cfg.gamma == 4.0
    assert cfg.num_layers == 3
    nested = DrafterConfig.from_target_config(
        {"text_config": QWEN3_8B}, target_layer_ids=(1, 9), mask_token_id=151669
    )
    assert nested.hidden_size == 4096


def test_gamma_defaults_follow_the_block_size() -> None:
    assert [default_loss_gamma(b) for b in (16, 10, 8, 12)] == [7.0, 5.0, 4.0, 7.0]
    assert tiny_config(block_size=10).gamma == 5.0
    assert tiny_config(block_size=10, loss_gamma=2.5).gamma == 2.5


def test_dict_round_trip() -> None:
    cfg = tiny_config(loss_gamma=3.0, num_anchors=7)
    data = cfg.to_dict()
    assert data["target_layer_ids"] == [1, 3]
    assert DrafterConfig.from_dict(data) == cfg
    with pytest.raises(ConfigError, match="unknown"):
        DrafterConfig.from_dict({**data, "bogus": 1})


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ({"mask_token_id": 61}, "mask_token_id"),
        ({"mask_token_id": -1}, "mask_token_id"),
        ({"target_layer_ids": (3, 1)}, "ascending"),
        ({"target_layer_ids": (1, 5)}, "ascending"),
        ({"target_layer_ids": ()}, "empty"),
        ({"num_key_value_heads": 3}, "multiple"),
        ({"block_size": 1}, "block_size"),
        ({"loss_gamma": 0.0}, "loss_gamma"),
        ({"num_layers": 0}, "num_layers"),
    ],
)
def test_invalid_configs_are_refused(override: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        tiny_config(**override)


def test_incomplete_target_config_is_refused() -> None:
    with pytest.raises(ConfigError, match="lacks"):
        DrafterConfig.from_target_config({"hidden_size": 8}, target_layer_ids=[0], mask_token_id=0)
