"""Target loading (random presets, HF directories), deterministic preset weights, and the
embedding/LM-head loader checked against the full model's own tensors."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from dflash_offline.errors import TargetError
from dflash_offline.target_model.capture import FeatureCapture
from dflash_offline.target_model.head import load_embedding_and_head
from dflash_offline.target_model.loader import LoadedTarget, TargetInfo, load_target, load_tokenizer
from dflash_offline.target_model.presets import RANDOM_PRESETS, uniform_values
from tests.target_model._reference import padded_batch, random_seqs


@pytest.fixture(scope="module")
def tiny() -> LoadedTarget:
    return load_target("random:tiny", device="cpu")


@pytest.fixture(scope="module")
def tiny_llama() -> LoadedTarget:
    return load_target("random:tiny-llama", device="cpu")


def test_defaults_on_cpu(tiny: LoadedTarget) -> None:
    assert tiny.dtype == torch.float32
    assert tiny.attn_implementation == "sdpa"
    assert next(tiny.model.parameters()).dtype == torch.float32
    assert not any(p.requires_grad for p in tiny.model.parameters())
    assert not tiny.model.training
    info = tiny.info
    assert (info.num_layers, info.hidden_size, info.vocab_size, info.model_type) == (4, 64, 49152, "qwen3")
    assert (info.num_attention_heads, info.num_key_value_heads, info.head_dim) == (4, 2, 16)
    assert info.rope_theta == 1e6
    assert not info.tie_word_embeddings
    assert TargetInfo.from_dict(json.loads(json.dumps(info.to_dict()))) == info
    assert len(tiny.tokenizer) == 49152  # presets reuse the embedded SmolLM2 tokenizer
    with pytest.raises(TargetError, match=r"outside the target's layers 0\.\.3"):
        load_target("random:tiny", device="cpu", max_layer=4)


def test_preset_weights_are_deterministic_and_independent_of_what_is_built(tiny: LoadedTarget) -> None:
    again = load_target("random:tiny", device="cpu")
    truncated = load_target("random:tiny", device="cpu", max_layer=1, tokenizer=False)  # as a generate worker
    assert truncated.tokenizer is None
    full = dict(tiny.model.named_parameters())
    for name, param in again.model.named_parameters():
        assert torch.equal(param, full[name]), name
    for name, param in truncated.model.named_parameters():
        if name != "norm.weight":
            assert torch.equal(param, full["model." + name]), name
    # bfloat16 weights are the float32 values rounded, not other values.
    bf16 = load_target("random:tiny", device="cpu", dtype=torch.bfloat16)
    for name, param in bf16.model.named_parameters():
        assert torch.equal(param, full[name].to(torch.bfloat16)), name
    q = full["model.layers.0.self_attn.q_proj.weight"]
    assert abs(q.mean().item()) < 1e-3
    assert abs(q.std().item() - 0.02) < 1e-3
    assert not torch.equal(q, full["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(full["model.layers.0.self_attn.q_norm.weight"], torch.ones(16))


def _py_mix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x5BD1E995) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_value_function_matches_a_pure_python_spelling_and_golden_values() -> None:
    """The documented hash, re-spelled with Python ints; pinned values guard against silent changes
    to every random target (a deliberate change must bump WEIGHT_INIT_VERSION)."""
    name = "layers.0.mlp.up_proj.weight"
    digest = hashlib.sha256(f"0\x00{name}".encode()).digest()
    k1, k2 = int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:8], "little")
    expected = [(_py_mix32(_py_mix32(i ^ k1) ^ k2) >> 8) / 2**23 - 1.0 for i in range(1000)]
    values = uniform_values(0, name, 1000, device=torch.device("cpu"))
    assert values.tolist() == expected
    assert expected[:4] == [-0.6614595651626587, -0.4584643840789795, 0.9098634719848633, -0.8155926465988159]


def test_qwen3_8b_preset_shape() -> None:
    p = RANDOM_PRESETS["qwen3-8b"]
    config = p.hf_config()
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (36, 4096, 32)
    assert (config.num_key_value_heads, config.head_dim, config.intermediate_size) == (8, 128, 12288)
    assert (config.vocab_size, config.model_type, config.tie_word_embeddings) == (151936, "qwen3", False)
    with torch.device("meta"):  # the layer structure, without allocating 8B parameters
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(p.hf_config(num_layers=1))
    attn = model.model.layers[0].self_attn
    assert hasattr(attn, "q_norm")
    assert hasattr(attn, "k_norm")


def test_head_of_random_presets_equals_the_models_tensors(
    tiny: LoadedTarget, tiny_llama: LoadedTarget
) -> None:
    head = load_embedding_and_head("random:tiny")
    assert not head.tied
    assert torch.equal(head.embed_VH, tiny.model.model.embed_tokens.weight)
    assert torch.equal(head.lm_head_VH, tiny.model.lm_head.weight)
    assert not torch.equal(head.embed_VH, head.lm_head_VH)
    tied = load_embedding_and_head("random:tiny-llama")
    assert tied.tied
    assert tied.lm_head_VH is tied.embed_VH
    assert torch.equal(tied.embed_VH, tiny_llama.model.model.embed_tokens.weight)
    assert torch.equal(tied.lm_head_VH, tiny_llama.model.lm_head.weight)
    assert head.info == tiny.info


@pytest.mark.parametrize("shard", [False, True])
@pytest.mark.parametrize("spec", ["random:tiny", "random:tiny-llama"])
def test_hf_directory_round_trip(tmp_path: Path, spec: str, shard: bool) -> None:
    source = load_target(spec, device="cpu")
    kwargs = {"max_shard_size": "2MB"} if shard else {}
    source.model.save_pretrained(str(tmp_path), **kwargs)
    source.tokenizer.save_pretrained(str(tmp_path))
    assert (tmp_path / "model.safetensors.index.json").is_file() == shard

    head = load_embedding_and_head(str(tmp_path))
    assert head.tied == source.info.tie_word_embeddings
    assert torch.equal(head.embed_VH, source.model.model.embed_tokens.weight)
    assert torch.equal(head.lm_head_VH, source.model.lm_head.weight)

    loaded = load_target(str(tmp_path), device="cpu")
    assert loaded.info.kind == "hf"
    assert loaded.info.target_id == tmp_path.name
    assert loaded.info.weights_hash.startswith("sampled-sha256:")
    own = dict(source.model.named_parameters())
    for name, param in loaded.model.named_parameters():
        assert torch.equal(param, own[name]), name
    assert len(load_tokenizer(str(tmp_path))) == len(source.tokenizer)

    truncated = load_target(str(tmp_path), device="cpu", max_layer=1)
    assert len(truncated.model.layers) == 2
    assert isinstance(truncated.model.norm, nn.Identity)
    batch = padded_batch(random_seqs([7, 3], 49152), 49152)
    assert torch.equal(
        FeatureCapture(truncated, [0, 1])(batch.ids_BS, batch.mask_BS),
        FeatureCapture(source, [0, 1])(batch.ids_BS, batch.mask_BS),
    )


def test_hf_directory_errors(tmp_path: Path, tiny: LoadedTarget) -> None:
    tiny.model.save_pretrained(str(tmp_path))
    with pytest.raises(TargetError, match="tokenizer files"):
        load_tokenizer(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 6}))
    with pytest.raises(TargetError, match=r"config\.json cannot be used"):  # 6 layers, 4 layer_types
        load_target(str(tmp_path), device="cpu")
    config = {**config, "num_hidden_layers": 6, "layer_types": ["full_attention"] * 6}
    (tmp_path / "config.json").write_text(json.dumps(config))  # the checkpoint holds only 4 layers
    with pytest.raises(TargetError, match="lacks weights"):
        load_target(str(tmp_path), device="cpu", max_layer=5)


@pytest.mark.gpu
def test_preset_weights_are_identical_on_cuda(tiny: LoadedTarget) -> None:
    on_gpu = load_target("random:tiny", device="cuda", dtype=torch.float32)
    for name, param in on_gpu.model.named_parameters():
        assert torch.equal(param.cpu(), dict(tiny.model.named_parameters())[name]), name
    head = load_embedding_and_head("random:tiny", device="cuda")
    assert torch.equal(head.embed_VH.cpu(), tiny.model.model.embed_tokens.weight)
    default = load_target("random:tiny", device="cuda")
    assert default.dtype == torch.bfloat16
    batch = padded_batch(random_seqs([17, 9], 49152), 49152)
    got = FeatureCapture(default, [0, 3])(batch.ids_BS.cuda(), batch.mask_BS.cuda()).float().cpu()
    ref = FeatureCapture(tiny, [0, 3])(batch.ids_BS, batch.mask_BS)
    for row, seq in enumerate(batch.seqs):  # bf16 weights and activations: ~1e-2 relative
        torch.testing.assert_close(got[row, : len(seq)], ref[row, : len(seq)], rtol=5e-2, atol=5e-3)


@pytest.mark.gpu
def test_qwen3_8b_preset_builds_on_cuda_and_its_head_matches() -> None:
    """The 8B preset is only ever built on a GPU: truncated to the default capture depth, in bf16."""
    target = load_target("random:qwen3-8b", device="cuda", max_layer=33)
    assert target.dtype == torch.bfloat16
    assert target.num_layers_built == 34
    assert not hasattr(target.model, "lm_head")
    head = load_embedding_and_head("random:qwen3-8b", device="cuda")
    assert not head.tied
    assert head.embed_VH.shape == (151936, 4096)
    assert torch.equal(head.embed_VH.to(torch.bfloat16), target.model.embed_tokens.weight)
    batch = padded_batch(random_seqs([64, 33], 49152), 49152)
    features = FeatureCapture(target, [1, 9, 17, 25, 33])(batch.ids_BS.cuda(), batch.mask_BS.cuda())
    assert features.shape == (2, 64, 5 * 4096)
    assert torch.isfinite(features).all()
