"""The validation split of ``dflash train``: chosen by the sample id alone, never trained on, evaluated
whole; its metrics against a brute-force recomputation with the inference path; the best-τ export,
early stop, and a resume that keeps (or refuses to change) the split."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import signal
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from dflash_offline.cache.reader import CacheReader
from dflash_offline.cache.rows import CachedSample
from dflash_offline.drafter.export import load_exported_drafter
from dflash_offline.drafter.loss import decay_weights
from dflash_offline.errors import ConfigError, ResumeError
from dflash_offline.placement import DistInfo
from dflash_offline.train import trainer
from dflash_offline.train.checkpoint import list_checkpoints
from dflash_offline.train.config import TrainConfig
from dflash_offline.train.launch import run_training
from dflash_offline.train.metrics import StepMetrics, read_metrics, validation_records
from dflash_offline.train.snapshot import read_snapshot, snapshot_from_columns, split_snapshot
from dflash_offline.train.trainer import TrainInterrupted, train_rank
from tests.tiny_caches import TinyCaches
from tests.train.helpers import assert_export_equals_checkpoint, flat_config_json
from tests.train.learnable_task import embedding as learnability_embedding
from tests.train.learnable_task import synthetic_setup as learnability_setup
from tests.train.learnable_task import write_cache as learnability_cache

CPU = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="none")


def _key(sample_id: str) -> float:
    """The documented rule, written out: 64 bits of blake2b over the salt and the id, in [0, 1)."""
    digest = hashlib.blake2b(b"dflash-validation-split-v1\x00" + sample_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64


def _snapshot(ids: list[str]) -> Any:
    return snapshot_from_columns(ids, [10 + i % 7 for i in range(len(ids))], [i % 3 for i in range(len(ids))])


def test_split_is_a_function_of_each_sample_id() -> None:
    ids = [f"sample-{i:04d}" for i in range(600)]
    split = split_snapshot(_snapshot(ids), fraction=0.1, num_samples=None)
    assert split.validation is not None
    val, train = set(split.validation.sample_ids), set(split.train.sample_ids)
    assert val == {s for s in ids if _key(s) < 0.1}
    assert not val & train
    assert val | train == set(ids)
    assert 30 <= len(val) <= 90  # ~60
    assert split.train.snapshot_id != _snapshot(ids).snapshot_id
    # Another order of the same ids, or a cache that has grown since: the same samples stay held out.
    more = [f"extra-{i}" for i in range(200)]
    grown = split_snapshot(_snapshot(list(reversed(ids)) + more), fraction=0.1, num_samples=None)
    assert grown.validation is not None
    assert set(grown.validation.sample_ids) & set(ids) == val
    # --val-samples: exactly that many, the smallest keys.
    exact = split_snapshot(_snapshot(ids), fraction=0.1, num_samples=25)
    assert exact.validation is not None
    assert set(exact.validation.sample_ids) == set(sorted(ids, key=_key)[:25])
    # Off, and a split that would leave nothing to train on.
    off = split_snapshot(_snapshot(ids), fraction=0.0, num_samples=None)
    assert off.validation is None
    assert off.train.snapshot_id == _snapshot(ids).snapshot_id
    with pytest.raises(ConfigError, match="leaving none to train on"):
        split_snapshot(_snapshot(ids), fraction=0.1, num_samples=600)


# ---- runs ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cache(tiny_caches: TinyCaches) -> Path:
    return tiny_caches.get(records=60, seed=11).root


def _config(cache: Path, out: Path, **overrides: object) -> TrainConfig:
    base = TrainConfig.from_options(
        cache_dir=cache,
        out_dir=out,
        num_layers=1,
        block_size=8,
        num_anchors=32,
        tokens_per_microbatch=600,
        grad_accum=1,
        lr=1e-2,
        epochs=100,
        max_steps=8,
        checkpoint_every=4,
        loader_threads=2,
        prefetch=2,
        progress=False,
        deterministic=True,
        threads_per_worker=1,
        val_fraction=0.15,
        val_every=2,
        tensorboard=False,
    )
    return base.with_options(**overrides)


def _validation_ids(run: Path, config: TrainConfig) -> set[str]:
    split = split_snapshot(
        read_snapshot(run / "snapshot.parquet"),
        fraction=config.data.val_fraction,
        num_samples=config.data.val_samples,
    )
    assert split.validation is not None
    return set(split.validation.sample_ids)


class CountingReader:
    """The cache reader, counting how often each sample is read (training and validation alike)."""

    def __init__(self, cache: Path) -> None:
        self._reader = CacheReader.open(cache)
        self.samples = self._reader.samples
        self.reads: Counter[str] = Counter()
        self._lock = threading.Lock()

    def read_rows(self, rows: list[int]) -> list[CachedSample]:
        out = self._reader.read_rows(rows)
        with self._lock:
            self.reads.update(s.sample_id for s in out)
        return out


def test_validation_samples_are_never_trained_on_and_evaluated_whole(cache: Path, tmp_path: Path) -> None:
    """One epoch, validation only at its end: every training sample is read once, every validation
    sample once (by the evaluation), none twice (which a validation sample trained on would be)."""
    run = tmp_path / "run"
    config = _config(cache, run, epochs=1, max_steps=None, val_every=10_000, export_at_end=False)
    reader = CountingReader(cache)
    result = train_rank(config, CPU, reader=reader)
    val = _validation_ids(run, config)
    everything = set(CacheReader.open(cache).samples.sample_id.tolist())
    assert 3 <= len(val) < len(everything)
    assert set(reader.reads) == everything
    assert set(reader.reads.values()) == {1}
    records = validation_records(read_metrics(run / "metrics.jsonl"))  # type: ignore[arg-type]
    assert [r["step"] for r in records] == [result.total_steps]
    assert records[0]["val_num_samples"] == len(val)
    saved = json.loads((run / "config.json").read_text())
    assert saved["data"]["val_fraction"] == 0.15
    assert saved["data"]["val_samples"] is None


def _brute_force(run: Path, config: TrainConfig) -> dict[str, Any]:
    """The split's metrics from the inference path, one anchor at a time: every eligible position of
    every validation sample (``--num-anchors`` exceeds them all, so the anchor draw takes each one),
    ``draft_logits`` over the sample's own features before the anchor, float64 cross-entropy."""
    embed = learnability_embedding()
    model = load_exported_drafter(run / "drafter-last", embed_VH=embed, lm_head_VH=embed)
    B, gamma = model.config.block_size, model.config.gamma
    w_B = decay_weights(B, gamma).double()
    ce = weight = 0.0
    correct, total = np.zeros(B - 1), np.zeros(B - 1)
    blocks = prefix = 0
    with CacheReader.open(config.cache_dir) as reader:
        row_of = {s: i for i, s in enumerate(reader.samples.sample_id.tolist())}
        samples = reader.read_rows([row_of[s] for s in sorted(_validation_ids(run, config))])
    for sample in samples:
        ids, mask, feats = sample.input_ids_T.long(), sample.loss_mask_T.bool(), sample.features_TF.float()
        T = len(ids)
        for a in range(T - 1):
            if not (mask[a] and mask[a + 1]):
                continue
            logits = model.draft_logits(
                context_features_CF=feats[:a], anchor_token=int(ids[a]), anchor_position=a
            )
            log_probs = torch.log_softmax(logits.double(), dim=-1)
            blocks += 1
            run_on = True
            for k in range(1, B):
                valid = a + k < T and bool(mask[a + k])
                hit = valid and int(logits[k - 1].argmax()) == int(ids[a + k])
                if valid:
                    ce -= float(w_B[k]) * float(log_probs[k - 1, ids[a + k]])
                    weight += float(w_B[k])
                    total[k - 1] += 1
                    correct[k - 1] += hit
                run_on = run_on and hit
                prefix += run_on
    acc = np.where(total > 0, correct / np.maximum(total, 1), 0.0)
    return {
        "loss": ce / weight,
        "acc": acc.tolist(),
        "tau": 1 + float(np.sum(np.cumprod(acc))),
        "block_tau": 1 + prefix / blocks,
        "blocks": blocks,
    }


def test_validation_metrics_equal_a_brute_force_recomputation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the learnability test's synthetic cache (a 64-token vocabulary whose head is well conditioned:
    even an untrained drafter gets some tokens right, so the accuracies count something)."""
    monkeypatch.setattr(trainer, "build_drafter_setup", learnability_setup)
    cache = learnability_cache(tmp_path / "cache", zero_features=False, num_samples=60)
    run = tmp_path / "run"
    # A few validation samples (the reference is slow); every eligible position an anchor.
    config = _config(
        cache,
        run,
        max_steps=6,
        val_every=3,
        block_size=4,
        num_anchors=4096,
        val_samples=5,
        final_norm_init=0.1,
    )
    run_training(config)
    last = validation_records(read_metrics(run / "metrics.jsonl"))[-1]  # type: ignore[arg-type]
    assert last["step"] == 6
    expected = _brute_force(run, config)
    assert last["val_num_blocks"] == expected["blocks"]
    assert float(last["val_loss"]) == pytest.approx(expected["loss"], rel=1e-5)  # type: ignore[arg-type]
    assert last["val_acc_by_position"] == pytest.approx(expected["acc"], abs=1e-12)
    assert float(last["val_simulated_tau"]) == pytest.approx(expected["tau"], rel=1e-6)  # type: ignore[arg-type]
    assert float(last["val_block_tau"]) == pytest.approx(expected["block_tau"], rel=1e-12)  # type: ignore[arg-type]
    assert sum(a > 0 for a in expected["acc"]) >= 2  # counts that can disagree


def _weights(path: Path) -> dict[str, torch.Tensor]:
    if path.name == "state.pt":
        return torch.load(path, map_location="cpu", weights_only=False)["model"]  # type: ignore[no-any-return]
    return load_file(str(path / "model.safetensors"))


def _assert_same_weights(export: Path, checkpoint: Path) -> None:
    assert_export_equals_checkpoint(_weights(export), _weights(checkpoint / "state.pt"))


@pytest.mark.slow  # over 20 s on 2 cores
def test_best_export_and_early_stop(cache: Path, tmp_path: Path) -> None:
    """RUN/drafter holds the weights of the best validation chain τ's step (RUN/drafter-last the last
    step's); --early-stop K ends the run K validations after its best, checkpointed, and a rerun trains
    nothing."""
    full = tmp_path / "full"
    steps = 14
    config = _config(cache, full, max_steps=steps, val_every=1, checkpoint_every=1, keep_checkpoints=100)
    result = run_training(config)
    assert result is not None
    records = validation_records(read_metrics(full / "metrics.jsonl"))  # type: ignore[arg-type]
    taus = [float(r["val_chain_tau"]) for r in records]  # type: ignore[arg-type]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    best_step = 1 + int(np.argmax(taus))  # the first of equal maxima: an improvement must be strict
    assert result.best_validation_step == best_step
    assert result.best_validation_tau == max(taus)
    checkpoints = dict(list_checkpoints(full))
    _assert_same_weights(full / "drafter", checkpoints[best_step])
    _assert_same_weights(full / "drafter-last", checkpoints[steps])
    assert best_step != steps, taus  # else the two checks above would not tell the exports apart

    # The step early stopping must end at: K evaluations after the last strict improvement.
    patience = 2
    best, since, stop = -math.inf, 0, None
    for step, tau in enumerate(taus, start=1):
        best, since = (tau, 0) if tau > best else (best, since + 1)
        if since >= patience:
            stop = step
            break
    assert stop is not None, taus
    assert stop < steps, taus
    early = tmp_path / "early"
    stopped = run_training(config.with_options(out_dir=early, early_stop=patience, checkpoint_every=100))
    assert stopped is not None
    assert stopped.stopped_early
    assert stopped.global_step == stop
    assert [r["step"] for r in read_metrics(early / "metrics.jsonl")] == list(range(1, stop + 1))
    assert max(step for step, _ in list_checkpoints(early)) == stop
    _assert_same_weights(early / "drafter-last", checkpoints[stop])
    again = run_training(config.with_options(out_dir=early, early_stop=patience, checkpoint_every=100))
    assert again is not None
    assert again.stopped_early
    assert again.global_step == stop
    assert [r["step"] for r in read_metrics(early / "metrics.jsonl")] == list(range(1, stop + 1))


def test_resume_keeps_the_split_and_refuses_another(cache: Path, tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    config = _config(cache, reference, max_steps=7, val_every=2)
    run_training(config)
    run = tmp_path / "run"

    def stop_at_3(metrics: StepMetrics) -> None:
        if metrics.step == 3:
            signal.raise_signal(signal.SIGINT)  # Ctrl-C: train_rank's handler asks for a stop

    with pytest.raises(TrainInterrupted):
        train_rank(config.with_options(out_dir=run), CPU, on_step=stop_at_3)
    run_training(config.with_options(out_dir=run))
    # The same lines, validation fields included, bit for bit (timings aside).
    timing = {"tokens_per_s", "step_seconds", "data_wait_fraction", "startup_seconds", "val_seconds"}
    got, want = read_metrics(run / "metrics.jsonl"), read_metrics(reference / "metrics.jsonl")
    assert [{k: v for k, v in r.items() if k not in timing} for r in got] == [
        {k: v for k, v in r.items() if k not in timing} for r in want
    ]
    assert len(validation_records(got)) == 4  # steps 2, 4, 6 and the last, 7

    for change, flag in (
        ({"val_fraction": 0.3}, "`DataConfig.val_fraction`"),
        ({"val_samples": 5}, "`DataConfig.val_samples`"),
    ):
        with pytest.raises(ResumeError, match=rf"trained with {flag} .*resume with the same {flag}"):
            run_training(config.with_options(out_dir=run, max_steps=9, **change))
    # A config.json this version did not write (a shape option missing) is refused in one line.
    other = tmp_path / "other"
    shutil.copytree(run, other)
    saved = flat_config_json(json.loads((other / "config.json").read_text()))
    del saved["val_fraction"]
    (other / "config.json").write_text(json.dumps(saved))
    with pytest.raises(ResumeError, match=r"config\.json lacks \['val_fraction'\]: this dflash-offline"):
        run_training(config.with_options(out_dir=other, max_steps=9))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_ddp_cpu_processes_validate_the_same_split_as_one(cache: Path, tmp_path: Path) -> None:
    """Each rank evaluates its part, the sums are reduced: the same metrics as one process (the blocks
    and chain cycles counted once: a rank evaluating everything, or nothing, would change
    val_num_blocks and val_chain_cycles)."""
    common = {"max_steps": 4, "val_every": 2, "algorithm": "sgd", "lr": 0.05, "export_at_end": False}
    one, two = tmp_path / "one", tmp_path / "two"
    run_training(_config(cache, one, grad_accum=2, **common))  # type: ignore[arg-type]
    run_training(_config(cache, two, grad_accum=1, num_cpu_workers=2, **common))  # type: ignore[arg-type]
    a = validation_records(read_metrics(one / "metrics.jsonl"))
    b = validation_records(read_metrics(two / "metrics.jsonl"))
    assert [r["step"] for r in a] == [r["step"] for r in b] == [2, 4]
    for x, y in zip(a, b, strict=True):
        assert x["val_num_blocks"] == y["val_num_blocks"]
        assert x["val_num_samples"] == y["val_num_samples"]
        assert float(x["val_loss"]) == pytest.approx(float(y["val_loss"]), rel=1e-5)  # type: ignore[arg-type]
        assert x["val_acc_by_position"] == pytest.approx(y["val_acc_by_position"], abs=1e-9)
        assert x["val_chain_cycles"] == y["val_chain_cycles"]
        assert float(x["val_chain_tau"]) == pytest.approx(float(y["val_chain_tau"]), rel=1e-9)  # type: ignore[arg-type]
