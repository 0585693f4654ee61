"""--feature-scale through a run: computed once and saved, carried by checkpoints across a resume,
folded into fc.weight by `dflash export`."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from dflash_offline.cache.reader import CacheReader
from dflash_offline.train.checkpoint import export_run, list_checkpoints
from dflash_offline.train.launch import run_training
from dflash_offline.train.prepare import FEATURE_SCALE_FILE, feature_rms, load_feature_scale
from tests.train.helpers import train_config


def test_feature_scale_survives_resume_and_is_folded_at_export(tiny_cache: Path, tmp_path: Path) -> None:
    cache, run = tiny_cache, tmp_path / "run"
    config = train_config(
        cache, run, feature_scale="dim", final_norm_init=0.1, max_steps=2, checkpoint_every=2
    )
    run_training(config)
    scale = load_feature_scale(run)
    # Independent reference: 1/RMS over every token of the (small) cache, which the sample covers.
    with CacheReader.open(cache) as reader:
        feats = [s.features_TF for s in reader.read_rows(list(range(len(reader.samples))))]
    ref = 1.0 / torch.from_numpy(feature_rms(feats, feats[0].shape[1])).float()
    torch.testing.assert_close(scale, ref, rtol=1e-4, atol=0)
    before = (run / FEATURE_SCALE_FILE).stat().st_mtime_ns
    run_training(config.with_options(max_steps=3))  # resumes from step 2
    assert (run / FEATURE_SCALE_FILE).stat().st_mtime_ns == before  # reused, not recomputed
    step, path = list_checkpoints(run)[-1]
    assert step == 3
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=False)["model"]
    torch.testing.assert_close(state["feature_scale_F"], scale)
    out = export_run(run, tmp_path / "export", dtype="float32")
    exported = load_file(str(out / "model.safetensors"))
    assert "feature_scale_F" not in exported
    torch.testing.assert_close(exported["fc.weight"], state["fc.weight"] * scale[None, :])
