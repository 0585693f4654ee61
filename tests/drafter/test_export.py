"""Export in z-lab's DFlash layout and load it back: bit-equal weights, config fields, file names."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch
from safetensors import safe_open

from dflash_offline.drafter.export import config_from_zlab, export_drafter, load_exported_drafter
from dflash_offline.errors import DrafterFormatError

from .helpers import random_row, tiny_config, tiny_drafter


def expected_keys(num_layers: int) -> set[str]:
    per_layer = [
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    ]
    keys = {f"layers.{i}.{name}" for i in range(num_layers) for name in per_layer}
    return keys | {"fc.weight", "hidden_norm.weight", "norm.weight"}


def test_round_trip_is_bit_equal_with_the_zlab_layout(tmp_path) -> None:
    config = tiny_config(num_layers=3, block_size=5, loss_gamma=3.5, num_anchors=64)
    model = tiny_drafter(config, seed=3)
    export_drafter(model, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors"]

    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == expected_keys(3)  # no embedding, no LM head
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == 5
    assert cfg["num_target_layers"] == 5
    assert cfg["num_hidden_layers"] == 3
    assert cfg["dflash_config"] == {"mask_token_id": config.mask_token_id, "target_layer_ids": [1, 3]}
    for field in (
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "rms_norm_eps",
        "rope_theta",
        "vocab_size",
        "max_position_embeddings",
    ):
        assert field in cfg
    assert cfg["head_dim"] == 8
    assert cfg["num_key_value_heads"] == 2
    assert cfg["intermediate_size"] == 48
    assert cfg["dtype"] == "float32"

    loaded = load_exported_drafter(tmp_path / "out", embed_VH=model.embed_VH, lm_head_VH=model.lm_head_VH)
    assert loaded.config == config
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k
    row = random_row([8, 5], seed=0)
    with torch.no_grad():
        assert torch.equal(
            model.forward_hidden(row, attention="sdpa"), loaded.forward_hidden(row, attention="sdpa")
        )


def test_bf16_export_loads_as_bf16(tmp_path) -> None:
    model = tiny_drafter(seed=4)
    export_drafter(model, tmp_path, dtype=torch.bfloat16)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = load_exported_drafter(tmp_path, embed_VH=model.embed_VH, lm_head_VH=model.lm_head_VH)
    for k, v in model.state_dict().items():
        got = loaded.state_dict()[k]
        assert got.dtype == torch.bfloat16, k
        assert torch.equal(got, v.bfloat16()), k
    assert loaded.embed_VH.dtype == torch.float32  # the frozen head is not cast


def test_reads_a_zlab_published_config() -> None:
    """The layout of z-lab/Qwen3-8B-DFlash-b16 (block_size and num_target_layers at the top level)."""
    published = {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "block_size": 16,
        "num_target_layers": 36,
        "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 5,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "max_position_embeddings": 40960,
        "vocab_size": 151936,
        "layer_types": ["full_attention"] * 5,
        "use_sliding_window": False,
    }
    cfg = config_from_zlab(published)
    assert cfg.block_size == 16
    assert cfg.num_layers == 5
    assert cfg.target_layer_ids == (1, 9, 17, 25, 33)
    assert cfg.mask_token_id == 151669
    assert cfg.num_target_layers == 36
    assert cfg.feature_width == 5 * 4096
    assert cfg.gamma == 7.0
    assert cfg.rope_theta == 1e6


def test_broken_exports_are_refused(tmp_path) -> None:
    model = tiny_drafter()
    with pytest.raises(DrafterFormatError, match="missing"):
        load_exported_drafter(tmp_path, embed_VH=model.embed_VH, lm_head_VH=model.lm_head_VH)
    export_drafter(model, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_hidden_layers"] = 3  # the weights hold 2 layers
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DrafterFormatError, match="missing"):
        load_exported_drafter(tmp_path, embed_VH=model.embed_VH, lm_head_VH=model.lm_head_VH)
    cfg.update(num_hidden_layers=2, intermediate_size=64)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DrafterFormatError, match="shape"):
        load_exported_drafter(tmp_path, embed_VH=model.embed_VH, lm_head_VH=model.lm_head_VH)
    with pytest.raises(DrafterFormatError, match="architectures"):
        config_from_zlab({**cfg, "architectures": ["Qwen3ForCausalLM"]})
    with pytest.raises(DrafterFormatError, match="format version"):
        config_from_zlab({**cfg, "dflash_offline": {"format_version": 99}})
    with pytest.raises(DrafterFormatError, match="mask_token_id"):
        config_from_zlab({**cfg, "dflash_config": {"mask_token_id": 10**6, "target_layer_ids": [1, 3]}})


@pytest.mark.parametrize("umask", [0o022, 0o027], ids=["umask022", "umask027"])
def test_export_files_take_the_mode_of_a_plain_open(tmp_path, umask: int) -> None:
    """model.safetensors as well as config.json: readable as the umask allows (safetensors alone
    writes 0600), like every other file a run writes."""
    model = tiny_drafter()
    previous = os.umask(umask)
    try:
        export_drafter(model, tmp_path / "out", readme="# card\n")
        reference = tmp_path / "plain"
        reference.write_text("x")  # what open() gives under this umask: the independent reference
    finally:
        os.umask(previous)
    expected = stat.S_IMODE(reference.stat().st_mode)
    assert expected == 0o666 & ~umask
    for name in ("model.safetensors", "config.json", "README.md"):
        assert oct(stat.S_IMODE((tmp_path / "out" / name).stat().st_mode)) == oct(expected), name
