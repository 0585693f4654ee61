"""Training faults: damaged samples, crash leftovers, Ctrl-C, bad options, a full disk.

Each case compares with an uninterrupted reference run on the same cache (same losses, bit for bit,
under --deterministic) or with `dflash verify`'s independent account of the damage.
"""

from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from dflash_offline.cache.layout import CacheLayout
from dflash_offline.cache.reader import CacheReader
from dflash_offline.cache.shard_file import ShardFile
from dflash_offline.cache.verify import verify_cache
from dflash_offline.cache.zarr_format import parse_array_format
from dflash_offline.cli import main
from dflash_offline.drafter_shape import MAX_BLOCK_SIZE
from dflash_offline.errors import CacheDamageError, ConfigError, ResumeError
from dflash_offline.placement import DistInfo
from dflash_offline.train.checkpoint import CheckpointNoSpaceError, list_checkpoints
from dflash_offline.train.config import TrainConfig
from dflash_offline.train.damaged import DAMAGED_FILE, read_damaged
from dflash_offline.train.launch import run_training
from dflash_offline.train.metrics import StepMetrics, read_metrics
from dflash_offline.train.prepare import cosine_with_warmup
from dflash_offline.train.trainer import TrainInterrupted, train_rank
from tests.train.kill_helpers import assert_same_run, losses

STEPS = 12


@pytest.fixture(scope="module")
def cache(uncompressed_cache: Path) -> Path:
    return uncompressed_cache  # raw bytes: a flip stays a flip


def _config(cache: Path, out: Path, **overrides: object) -> TrainConfig:
    base = TrainConfig.from_options(
        cache_dir=cache,
        out_dir=out,
        num_layers=1,
        block_size=8,
        num_anchors=32,
        tokens_per_microbatch=600,
        grad_accum=1,
        lr=3e-3,
        epochs=100,
        max_steps=STEPS,
        checkpoint_every=4,
        loader_threads=2,
        prefetch=2,
        progress=False,
        deterministic=True,
        threads_per_worker=1,
        export_at_end=False,
    )
    return base.with_options(**overrides)


@pytest.fixture(scope="module")
def reference(cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("reference") / "run"
    run_training(_config(cache, run))
    assert [s for s, _ in list_checkpoints(run)] == [8, 12]
    return run


def _copy_run(reference: Path, dest: Path) -> Path:
    shutil.copytree(reference, dest)
    return dest


# ---- checksums in training --------------------------------------------------------------------------


def _damage(cache: Path, dest: Path) -> tuple[Path, set[str]]:
    """A copy of the cache with one feature byte flipped; the damaged ids as `dflash verify` finds them."""
    shutil.copytree(cache, dest)
    with CacheReader.open(dest) as reader:
        shard = str(reader.samples.shard[0])
    fmt = parse_array_format(CacheLayout.at(dest).shard_group(shard) / "features", "features")
    shard_file = ShardFile(fmt, 0)
    path = shard_file.path
    data = bytearray(path.read_bytes())
    data[int(shard_file.offsets[0]) + 3 * fmt.row_bytes + 1] ^= 0x40
    path.write_bytes(bytes(data))
    report = verify_cache(dest, progress=False)
    damaged = {d.sample_id for d in report.damaged}
    assert len(damaged) == 1
    return dest, damaged


def test_a_damaged_sample_stops_training_naming_it(cache: Path, tmp_path: Path) -> None:
    damaged_cache, damaged = _damage(cache, tmp_path / "cache")
    (sample_id,) = damaged
    with pytest.raises(CacheDamageError) as caught:
        run_training(_config(damaged_cache, tmp_path / "run", epochs=1, max_steps=None))
    message = str(caught.value)
    assert sample_id in message
    assert "checksum" in message
    assert "\n" not in message
    result = CliRunner().invoke(
        main,
        [
            "train", "--cache", str(damaged_cache), "--out", str(tmp_path / "cli"), "--num-layers", "1",
            "--block-size", "8", "--num-anchors", "32", "--tokens-per-microbatch", "600", "--epochs", "1",
            "--grad-accum", "1", "--threads", "1", "--no-progress", "--deterministic",
        ],
    )  # fmt: skip
    assert result.exit_code != 0
    assert sample_id in result.output
    assert "Traceback" not in result.output


def test_skip_damaged_trains_on_the_rest_and_records_them(cache: Path, tmp_path: Path) -> None:
    damaged_cache, damaged = _damage(cache, tmp_path / "cache")
    run = tmp_path / "run"
    result = run_training(_config(damaged_cache, run, epochs=1, max_steps=None, on_damaged="skip"))
    assert result is not None
    assert result.global_step == result.total_steps
    assert {d.sample_id for d in read_damaged(run)} == damaged
    # One line per read of the damaged sample (module docstring of train/damaged.py): the feature scale's
    # statistics pass reads it too, before training does.
    lines = (run / DAMAGED_FILE).read_text().splitlines()
    assert lines
    assert {json.loads(line)["sample_id"] for line in lines} == damaged
    assert all(math.isfinite(loss) for loss in losses(run))
    clean = tmp_path / "clean"
    run_training(_config(cache, clean, epochs=1, max_steps=None))
    # Same plan, one sample fewer contributing: the losses differ (the damage is not trained on).
    assert len(losses(clean)) == len(losses(run))
    assert losses(clean) != losses(run)


def _group(cache: Path) -> Path:
    (group,) = sorted((cache / "shards").glob("*.zarr"))
    return group


def _edit_zarr_json(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    meta = json.loads(path.read_text())
    edit(meta)
    path.write_text(json.dumps(meta))


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[100] ^= 0x40
    path.write_bytes(bytes(data))


def _twice_as_wide(meta: dict[str, Any]) -> None:
    meta["shape"][1] *= 2


# Every kind of damage a reader can meet: (name, what it does to the copy's only shard group).
DAMAGE: dict[str, Callable[[Path], None]] = {
    "missing input_ids file": lambda group: (group / "input_ids" / "c" / "1").unlink(),
    "truncated features file": lambda group: _truncate(group / "features" / "c" / "1" / "0"),
    "checksum mismatch": lambda group: _flip(group / "features" / "c" / "1" / "0"),
    "loss_mask dtype mismatch": lambda group: _edit_zarr_json(
        group / "loss_mask" / "zarr.json", lambda meta: meta.update(data_type="int16")
    ),
    "features shape mismatch": lambda group: _edit_zarr_json(
        group / "features" / "zarr.json", _twice_as_wide
    ),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_every_kind_of_damage_is_skipped_as_verify_lists_it_or_stops_in_one_line(
    kind: str, cache: Path, tmp_path: Path
) -> None:
    """`--on-damaged skip` leaves out (and records) exactly the samples `dflash verify` finds damaged
    (their bytes, or their shard group's zarr.json), whatever the damage; the default stops with one
    line naming a damaged sample or its shard."""
    damaged_cache = shutil.copytree(cache, tmp_path / "cache")
    DAMAGE[kind](_group(damaged_cache))
    report = verify_cache(damaged_cache, progress=False)
    # verify's account: samples whose bytes are damaged, and every sample of a shard group whose
    # zarr.json it reports damaged (verify reads them through rebuilt metadata; a reader has none).
    bad_groups = {m.shard for m in report.metadata}
    with CacheReader.open(damaged_cache) as reader:
        table = reader.samples
        in_bad_groups = {str(table.sample_id[i]) for i in range(len(table)) if table.shard[i] in bad_groups}
    listed = {d.sample_id for d in report.damaged} | in_bad_groups
    assert listed  # the damage is real
    run = tmp_path / "skip"
    # 256-token microbatches: the longer samples are read alone, the shorter ones with others.
    skip = _config(damaged_cache, run, epochs=1, max_steps=None, on_damaged="skip", tokens_per_microbatch=256)
    result = run_training(skip)
    assert result is not None
    assert result.global_step == result.total_steps
    assert {d.sample_id for d in read_damaged(run)} == listed
    assert all(math.isfinite(loss) for loss in losses(run))
    with pytest.raises(CacheDamageError) as caught:
        run_training(_config(damaged_cache, tmp_path / "stop", epochs=1, max_steps=None))
    message = str(caught.value)
    assert "\n" not in message
    assert any(sample_id in message for sample_id in listed) or _group(damaged_cache).name in message


# ---- crash leftovers ------------------------------------------------------------------------------


def test_torn_last_metrics_line_does_not_block_resume(cache: Path, reference: Path, tmp_path: Path) -> None:
    run = _copy_run(reference, tmp_path / "run")
    shutil.rmtree(run / "checkpoints" / "step-00000012")  # killed between steps 10 and 11 ...
    lines = (run / "metrics.jsonl").read_text().splitlines()[:10]
    (run / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 11, "epoch": 0, "lo')  # ... mid-write
    run_training(_config(cache, run))
    assert_same_run(run, reference, steps=STEPS)


def test_truncated_newest_checkpoint_falls_back_to_the_older_one(
    cache: Path, reference: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    run = _copy_run(reference, tmp_path / "run")
    state = run / "checkpoints" / "step-00000012" / "state.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    run_training(_config(cache, run))
    err = capfd.readouterr().err
    assert "step-00000012" in err
    assert "does not load" in err
    assert "resuming from step-00000008" in err
    assert (run / "checkpoints" / "step-00000012.unreadable").is_dir()
    assert_same_run(run, reference, steps=STEPS)


def test_every_checkpoint_unreadable_is_a_clear_refusal(cache: Path, reference: Path, tmp_path: Path) -> None:
    run = _copy_run(reference, tmp_path / "run")
    for _step, path in list_checkpoints(run):
        (path / "state.pt").write_bytes(b"PK\x03\x04 not a checkpoint")
    with pytest.raises(ResumeError, match=r"no checkpoint in .* loads"):
        run_training(_config(cache, run))


def test_stop_request_checkpoints_at_the_step_boundary_and_resume_is_exact(
    cache: Path, reference: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="none")

    def on_step(metrics: StepMetrics) -> None:
        if metrics.step == 5:
            signal.raise_signal(signal.SIGINT)  # Ctrl-C: train_rank's handler asks for a stop

    with pytest.raises(TrainInterrupted) as caught:
        train_rank(_config(cache, run), info, on_step=on_step)
    assert caught.value.step == 5
    assert [s for s, _ in list_checkpoints(run)] == [4, 5]  # 5 is not a --checkpoint-every step
    assert [m["step"] for m in read_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    run_training(_config(cache, run))
    assert_same_run(run, reference, steps=STEPS)


# ---- bad options ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        # Built in Python, the message names the field (test_cli_refuses_nonsense_in_one_line: the flag).
        (
            {"threads_per_worker": -3},
            r"`LaunchConfig\.threads_per_worker` -3: expected an integer in 0\.\.4096",
        ),
        (
            {"block_size": 100000},
            rf"`DrafterTrainConfig\.block_size` 100000: expected an integer in 2\.\.{MAX_BLOCK_SIZE}",
        ),
        ({"lr": float("nan")}, r"`OptimizerConfig\.lr` nan: expected a finite number > 0"),
        ({"lr": float("inf")}, r"`OptimizerConfig\.lr` inf"),
        ({"gamma": -1.0}, r"`DrafterTrainConfig\.gamma` -1\.0"),
        ({"weight_decay": -0.1}, r"`OptimizerConfig\.weight_decay` -0\.1"),
        ({"loader_threads": 100000}, r"`LaunchConfig\.loader_threads` 100000"),
    ],
)
def test_nonsense_numbers_are_refused_with_the_valid_range(
    tmp_path: Path, overrides: dict[str, object], expected: str
) -> None:
    with pytest.raises(ConfigError, match=expected):
        _config(tmp_path / "cache", tmp_path / "run", **overrides)


def test_cli_refuses_nonsense_in_one_line(cache: Path, tmp_path: Path) -> None:
    for args, expected in (
        (["--threads", "-3"], "--threads -3: expected an integer in 0..4096"),
        (["--block-size", "100000"], f"--block-size 100000: expected an integer in 2..{MAX_BLOCK_SIZE}"),
    ):
        result = CliRunner().invoke(
            main, ["train", "--cache", str(cache), "--out", str(tmp_path / "run"), *args]
        )
        assert result.exit_code == 1, result.output
        assert expected in result.output
        assert len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_resume_with_another_model_shape_is_refused_naming_the_field(
    cache: Path, reference: Path, tmp_path: Path
) -> None:
    run = _copy_run(reference, tmp_path / "run")
    for overrides, flag in (
        ({"num_layers": 2}, "`DrafterTrainConfig.num_layers`"),
        ({"block_size": 16}, "`DrafterTrainConfig.block_size`"),
    ):
        with pytest.raises(ResumeError, match=rf"trained with {flag} .*resume with the same {flag}"):
            run_training(_config(cache, run, **overrides))
    assert json.loads((run / "config.json").read_text())["drafter"]["num_layers"] == 1  # not overwritten


def test_resume_with_another_lr_applies_it_and_says_so(
    cache: Path, reference: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    run = _copy_run(reference, tmp_path / "run")
    shutil.rmtree(run / "checkpoints" / "step-00000012")
    run_training(_config(cache, run, lr=1e-3))
    assert (
        "resuming with `OptimizerConfig.lr` 0.001 (the previous run used 0.003): applied"
        in capfd.readouterr().err
    )
    factor = cosine_with_warmup(STEPS, 0.04)
    lrs = [float(m["lr"]) for m in read_metrics(run / "metrics.jsonl")]  # type: ignore[arg-type]
    reference_lrs = [float(m["lr"]) for m in read_metrics(reference / "metrics.jsonl")]  # type: ignore[arg-type]
    assert lrs[:8] == reference_lrs[:8]
    assert lrs[8:] == pytest.approx([1e-3 * factor(step) for step in range(9, STEPS + 1)], rel=1e-12)
    assert losses(run)[:9] == losses(reference)[:9]  # step 9 ran with the lr set after step 8
    assert losses(run)[9:] != losses(reference)[9:]


# ---- a full disk --------------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path):  # type: ignore[no-untyped-def]
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, timeout=30
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=30)


def test_disk_full_while_checkpointing_is_one_line_and_the_run_resumes(
    cache: Path, reference: Path, small_disk: Path
) -> None:
    run = small_disk / "run"
    with pytest.raises(CheckpointNoSpaceError) as caught:
        run_training(_config(cache, run))
    message = str(caught.value)
    assert message.startswith("no space left on device at ")
    assert message.endswith("; free space and rerun the same command")
    assert "inline_container" not in message
    assert not list((run / "checkpoints").glob(".tmp-*"))  # the partial checkpoint freed its space
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True, timeout=30)
    run_training(_config(cache, run))
    assert_same_run(run, reference, steps=STEPS)


def test_out_of_memory_in_a_step_or_a_validation_names_the_microbatch_options(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A raw allocator error says nothing of the options; this one says which to lower, and by how much."""
    import dflash_offline.train.trainer as trainer

    def out_of_memory(*args: object, **kwargs: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore lines")

    monkeypatch.setattr(trainer.OptimizerStep, "__call__", out_of_memory)
    with pytest.raises(ConfigError) as caught:
        train_rank(
            _config(cache, tmp_path / "run"),
            DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="none"),
        )
    message = str(caught.value)
    assert message.startswith(
        "a training step ran out of memory on cpu with `DataConfig.tokens_per_microbatch` 600, "
    )
    assert (
        "e.g. `DataConfig.tokens_per_microbatch` 150 `DataConfig.num_anchors` 8 "
        "`TopologyConfig.grad_accum` 4 " in message
    )
    assert message.endswith("The allocator said: CUDA out of memory. Tried to allocate 2.00 GiB")

    with pytest.raises(
        ConfigError, match=r"`TopologyConfig\.grad_accum` 4 without `LaunchConfig\.fuse_microbatches`"
    ):
        train_rank(
            _config(cache, tmp_path / "run-fused").with_options(fuse_microbatches=True),
            DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="none"),
        )

    monkeypatch.undo()
    monkeypatch.setattr(trainer.ValidationSchedule, "evaluate", out_of_memory)
    config = _config(cache, tmp_path / "run-val", val_every=2)
    with pytest.raises(ConfigError, match=r"^the validation after step 2 ran out of memory on cpu with "):
        train_rank(
            config, DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="none")
        )
