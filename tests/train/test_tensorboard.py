"""TensorBoard: event files that tensorboard's own reader loads hold the metrics.jsonl values (also
after a resume), the eval τ table as scalars, and a clear error when the package is missing."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from dflash_offline import tensorboard as tb
from dflash_offline.train.metrics import MetricsLog, StepMetrics, read_metrics

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def _load(log_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    return acc


def _series(acc: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def _metrics(step: int, rng: np.random.Generator) -> StepMetrics:
    acc = sorted(rng.random(7).tolist(), reverse=True)
    return StepMetrics(
        step=step,
        epoch=0,
        loss=float(10 * rng.random()),
        lr=float(rng.random() * 1e-3),
        grad_norm=float(rng.random()),
        acc_by_position=acc,
        simulated_tau=1.0 + float(np.sum(np.cumprod(acc))),
        tokens=int(rng.integers(100, 1000)),
        tokens_per_s=float(rng.random() * 1e5),
        step_seconds=float(rng.random()),
        data_wait_fraction=float(rng.random()),
        buckets=[0, 1],
        num_blocks=12,
    )


def _expected(lines: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """tag -> (step, value) read back from metrics.jsonl, independently of metrics.py's mapping."""
    tags: dict[str, list[tuple[int, float]]] = {}
    for m in lines:
        for name in ("loss", "lr", "grad_norm", "simulated_tau", "tokens_per_s", "data_wait_fraction"):
            tags.setdefault(f"train/{name}", []).append((m["step"], m[name]))
        for k, a in enumerate(m["acc_by_position"], start=1):
            tags.setdefault(f"train/acc/pos_{k:02d}", []).append((m["step"], a))
    return tags


def _assert_same(acc: EventAccumulator, expected: dict[str, list[tuple[int, float]]]) -> None:
    assert set(expected) <= set(acc.Tags()["scalars"])
    for tag, series in expected.items():
        got = _series(acc, tag)
        assert [s for s, _ in got] == [s for s, _ in series], tag
        # Event files store float32.
        assert np.array_equal(np.float32([v for _, v in got]), np.float32([v for _, v in series])), tag


def test_metrics_log_writes_the_jsonl_values_to_tensorboard_and_a_resume_rewrites_later_steps(
    tmp_path: Path,
) -> None:
    rng = np.random.default_rng(0)
    path, tb_dir = tmp_path / "metrics.jsonl", tmp_path / "tb"
    log = MetricsLog(path, resume_from_step=0, tensorboard_dir=tb_dir)
    for step in range(1, 6):
        log.write(_metrics(step, rng))
    log.close()
    _assert_same(_load(tb_dir), _expected(read_metrics(path)))  # type: ignore[arg-type]
    # A resume comes from a later process; here the same one, so start its event file in a later second:
    # files are read in name order, "…<seconds>.<host>.<pid>.<n>" with n a per-process count, not padded, so
    # within one second the 10th file of a process sorts before its 9th and TensorBoard reads the resume's
    # events first (a flaky failure of this test under xdist, whose workers open many files).
    time.sleep(1.0 - time.time() % 1.0 + 0.01)
    # Resume from the checkpoint at step 3: steps 4-5 are written again with other values.
    log = MetricsLog(path, resume_from_step=3, tensorboard_dir=tb_dir)
    for step in range(4, 7):
        log.write(_metrics(step, rng))
    log.close()
    lines = read_metrics(path)
    assert [m["step"] for m in lines] == [1, 2, 3, 4, 5, 6]
    _assert_same(_load(tb_dir), _expected(lines))  # type: ignore[arg-type]


def test_validation_fields_go_to_val_tags(tmp_path: Path) -> None:
    from dataclasses import replace

    from dflash_offline.train.metrics import ValidationMetrics

    rng = np.random.default_rng(1)
    path, tb_dir = tmp_path / "metrics.jsonl", tmp_path / "tb"
    log = MetricsLog(path, resume_from_step=0, tensorboard_dir=tb_dir)
    for step in range(1, 7):
        metrics = _metrics(step, rng)
        if step % 3 == 0:
            acc = sorted(rng.random(7).tolist(), reverse=True)
            validation = ValidationMetrics(
                step=step,
                loss=float(rng.random() * 5),
                acc_by_position=acc,
                simulated_tau=1.0 + float(np.sum(np.cumprod(acc))),
                block_tau=1.0 + float(rng.random()),
                chain_tau=1.0 + float(rng.random()),
                chain_cycles=17,
                num_blocks=40,
                num_samples=3,
                num_tokens=500,
            )
            metrics = replace(metrics, validation=validation)
        log.write(metrics)
    log.close()
    lines = read_metrics(path)
    expected: dict[str, list[tuple[int, float]]] = {}
    for m in lines:
        if "val_loss" not in m:
            continue
        for name in ("loss", "simulated_tau", "block_tau", "chain_tau"):
            expected.setdefault(f"val/{name}", []).append((m["step"], m[f"val_{name}"]))  # type: ignore[arg-type]
        for k, a in enumerate(m["val_acc_by_position"], start=1):  # type: ignore[arg-type]
            expected.setdefault(f"val/acc/pos_{k:02d}", []).append((m["step"], a))  # type: ignore[arg-type]
    assert [s for s, _ in expected["val/loss"]] == [3, 6]
    acc = _load(tb_dir)
    _assert_same(acc, expected)
    _assert_same(acc, _expected(lines))  # type: ignore[arg-type]  # the training tags as before


def test_eval_report_becomes_a_scalar_set(tmp_path: Path) -> None:
    from dflash_offline.eval.report import EvalReport, PromptResult, summarize, write_eval_report

    prompts = [
        PromptResult(
            sample_id=f"s{i}",
            record_id=f"r{i}",
            prompt_tokens=10,
            new_tokens=20 + i,
            cycles=5 + i,
            accepted_histogram=[1, 2 + i, 1, 1 + i],
            tau=1.5 + i / 4,
            spec_seconds=1.0,
            target_seconds=1.2 + i / 10,
            speedup=1.2 + i / 10,
            identical=i != 1,
            first_mismatch=None if i != 1 else 3,
            stop_reason="eos",
            text="x",
        )
        for i in range(3)
    ]
    summary = summarize(prompts, block_size=4)
    report = EvalReport(
        version=1,
        config={},
        target={},
        drafter={},
        held_out="",
        warnings=[],
        prompts=prompts,
        summary=summary,
    )
    acc = _load(write_eval_report(tmp_path / "tb", report, step=7))
    hist = [sum(p.accepted_histogram[a] for p in prompts) for a in range(4)]
    cycles = sum(hist)
    assert _series(acc, "eval/tau") == [
        (7, pytest.approx(sum((a + 1) * n for a, n in enumerate(hist)) / cycles))
    ]
    assert _series(acc, "eval/identical_prompts") == [(7, 2.0)]
    assert _series(acc, "eval/accepted_histogram") == [(a, float(n)) for a, n in enumerate(hist)]
    assert _series(acc, "eval/prompt_tau") == [(i, pytest.approx(p.tau)) for i, p in enumerate(prompts)]


def test_without_tensorboard_asking_for_it_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dflash_offline.cli import main

    monkeypatch.setattr(tb, "tensorboard_available", lambda: False)
    cache = tmp_path / "cache"
    cache.mkdir()
    result = CliRunner().invoke(
        main, ["train", "--cache", str(cache), "--out", str(tmp_path / "run"), "--tensorboard", str(tmp_path)]
    )
    assert result.exit_code != 0
    assert "pip install 'dflash-offline[tensorboard]'" in result.output
    assert "Traceback" not in result.output
    # Not asked for: no tensorboard means no event files, not an error.
    from dflash_offline.train.config import TrainConfig

    config = TrainConfig.from_options(cache_dir=cache, out_dir=tmp_path / "run")
    assert config.resolved_tensorboard_dir() is None
    monkeypatch.setattr(tb, "tensorboard_available", lambda: True)
    assert config.resolved_tensorboard_dir() == tmp_path / "run" / "tb"
    assert (
        TrainConfig.from_options(
            cache_dir=cache, out_dir=tmp_path, tensorboard=False
        ).resolved_tensorboard_dir()
        is None
    )


@pytest.mark.slow  # a training run in a process of its own
@pytest.mark.timeout(300)
def test_dflash_train_writes_event_files_under_run_tb_by_default(tiny_cache: Path, tmp_path: Path) -> None:
    import subprocess
    import sys

    run = tmp_path / "run"
    argv = [sys.executable, "-m", "dflash_offline", "train", "--cache", str(tiny_cache)]
    argv += ["--out", str(run), "--num-layers", "1", "--block-size", "8", "--num-anchors", "16"]
    argv += ["--tokens-per-microbatch", "600", "--grad-accum", "1", "--max-steps", "4", "--no-progress"]
    argv += ["--threads", "1", "--loader-threads", "1", "--checkpoint-every", "4"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=240, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"tensorboard --logdir {run / 'tb'}" in out.stdout
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    acc = _load(run / "tb")
    _assert_same(acc, _expected(lines))
    assert len(acc.Tags()["scalars"]) == 7 + 7  # 7 scalars + accuracy at 7 block positions (B = 8)
