"""bench/drafter_parts.sh, which carries a trained drafter from one GPU machine to the next: ``split`` then
``join`` rebuild the run's files and its drafter as bfloat16 (the original weights rounded, nothing else
changed), in parts no larger than a machine hands back, and the rebuilt export loads for ``--init-from``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from dflash_offline.drafter import export_drafter
from dflash_offline.target_model.loader import load_target
from dflash_offline.train.model_setup import init_weights_from
from tests.eval.helpers import untrained_drafter

ROOT = Path(__file__).resolve().parents[1]
PART_BYTES = 15 * 1024 * 1024


def test_split_then_join_rebuilds_the_drafter_in_bfloat16(tmp_path: Path) -> None:
    target = load_target("random:tiny", device="cpu")
    run = tmp_path / "run"
    drafter = untrained_drafter(target, block_size=4)
    with torch.no_grad():  # weights that bfloat16 rounds, and a layer that tells the files apart
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    export_drafter(drafter, run / "drafter")
    (run / "config.json").write_text(json.dumps({"cache_dir": "/somewhere/cache", "init_from": None}))
    (run / "snapshot.parquet").write_bytes(b"snapshot bytes")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "checkpoints").mkdir()  # not carried
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}

    def parts(*args: str) -> None:
        subprocess.run(["bash", str(ROOT / "bench/drafter_parts.sh"), *args], check=True, env=env)

    parts("split", str(run), str(tmp_path / "out"))
    pieces = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert pieces == ["drafter-config.json", "drafter.part00", "run-files.tgz"]
    assert all(p.stat().st_size <= PART_BYTES for p in (tmp_path / "out").iterdir())
    with tarfile.open(tmp_path / "out" / "run-files.tgz") as tar:
        assert sorted(tar.getnames()) == ["config.json", "metrics.jsonl", "snapshot.parquet"]

    rebuilt = tmp_path / "next" / "run"
    parts("join", str(tmp_path / "out"), str(rebuilt))
    for name in ("config.json", "snapshot.parquet", "metrics.jsonl"):
        assert (rebuilt / name).read_bytes() == (run / name).read_bytes()
    original = load_file(str(run / "drafter" / "model.safetensors"))
    carried = load_file(str(rebuilt / "drafter" / "model.safetensors"))
    assert set(carried) == set(original)
    for key, tensor in original.items():
        assert carried[key].dtype == torch.bfloat16
        assert torch.equal(carried[key], tensor.to(torch.bfloat16)), key
    config = json.loads((rebuilt / "drafter" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16"
    assert {k: v for k, v in config.items() if k != "torch_dtype"} == {
        k: v
        for k, v in json.loads((run / "drafter" / "config.json").read_text()).items()
        if k != "torch_dtype"
    }
    # What --init-from does with it: a fresh drafter of the same shape takes the rounded weights.
    fresh = untrained_drafter(target, block_size=4, seed=1)
    init_weights_from(fresh, rebuilt / "drafter")
    for key, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, original[key].to(torch.bfloat16).float()), key
