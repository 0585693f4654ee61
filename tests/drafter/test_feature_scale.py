"""The fixed feature scale: applied before fc in training, folded into fc.weight by the export."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from safetensors import safe_open

from dflash_offline.drafter.export import export_drafter, load_exported_drafter
from dflash_offline.train.prepare import feature_rms, scale_from_rms

from .helpers import HIDDEN, NUM_FEATURES, random_row, tiny_config, tiny_drafter


def _massive_row(seed: int):  # features with a few huge dimensions, like SmolLM2's
    row = random_row([9, 6], seed=seed)
    f = row.features_TF.clone()
    f[:, 3] = 2.0e4
    f[:, HIDDEN + 7] = -5.0e3
    return dataclasses.replace(row, features_TF=f)


def test_scale_from_rms_matches_numpy_reference() -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(30, NUM_FEATURES * HIDDEN, generator=g) * torch.linspace(0.5, 40, NUM_FEATURES * HIDDEN)
    b = torch.randn(11, NUM_FEATURES * HIDDEN, generator=g)
    rms = feature_rms([a, b], NUM_FEATURES * HIDDEN)
    ref = np.sqrt((np.concatenate([a.numpy(), b.numpy()]) ** 2).mean(0))
    np.testing.assert_allclose(rms, ref, rtol=1e-6)
    dim = scale_from_rms(rms, num_layers=NUM_FEATURES, mode="dim").numpy()
    np.testing.assert_allclose(dim, 1 / ref, rtol=1e-5)
    layer = scale_from_rms(rms, num_layers=NUM_FEATURES, mode="layer").numpy().reshape(NUM_FEATURES, -1)
    for i, block in enumerate(ref.reshape(NUM_FEATURES, -1)):
        np.testing.assert_allclose(layer[i], 1 / np.sqrt((block**2).mean()), rtol=1e-5)
    # A dead dimension is floored at 1 % of its layer's median RMS, not given an enormous multiplier.
    rms[5] = 0.0
    floored = scale_from_rms(rms, num_layers=NUM_FEATURES, mode="dim").numpy()
    assert floored[5] == np.float32(1 / (0.01 * np.median(rms[:HIDDEN])))


def test_exported_drafter_with_folded_scale_gives_the_trained_logits(tmp_path) -> None:
    config = tiny_config(num_layers=2, block_size=4)
    model = tiny_drafter(config, seed=5)
    row = _massive_row(seed=1)
    rms = feature_rms([row.features_TF], config.feature_width)
    scale = scale_from_rms(rms, num_layers=NUM_FEATURES, mode="dim")
    with torch.no_grad():
        before = model.forward_hidden(row, attention="sdpa")
        model.set_feature_scale(scale)
        scaled = model.forward_hidden(row, attention="sdpa")
    assert not torch.allclose(before, scaled, atol=1e-3)  # the scale changes the model's function
    assert "feature_scale_F" in model.state_dict()  # checkpoints carry it
    export_drafter(model, tmp_path / "out")
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        assert "feature_scale_F" not in set(f.keys())  # z-lab's layout
        fc = f.get_tensor("fc.weight")
    torch.testing.assert_close(fc, model.fc.weight.detach() * scale[None, :])
    loaded = load_exported_drafter(tmp_path / "out", embed_VH=model.embed_VH, lm_head_VH=model.lm_head_VH)
    assert loaded.feature_scale_F is None
    with torch.no_grad():
        exported = loaded.forward_hidden(row, attention="sdpa")
        logits_a = scaled @ model.lm_head_VH.T
        logits_b = exported @ loaded.lm_head_VH.T
    torch.testing.assert_close(exported, scaled, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits_b, logits_a, rtol=1e-4, atol=1e-4)
    # The drafting path (eval) sees the same folded context.
    feats = row.features_TF[:5]
    with torch.no_grad():
        da = model.draft_logits(context_features_CF=feats, anchor_token=3, anchor_position=5)
        db = loaded.draft_logits(context_features_CF=feats, anchor_token=3, anchor_position=5)
    torch.testing.assert_close(db, da, rtol=1e-4, atol=1e-4)
