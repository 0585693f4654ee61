"""bench/quality_recipe.py's ``--follow-window`` mode: the answers streamed through a bounded cache,
``dflash generate --window-limit`` and one variant's ``dflash train --follow`` at once, then eval of the
run's final drafter (docs/follow.md). End to end on the CPU with the random tiny target; the report is
checked against the cache's own manifest and the run's follow.json."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_offline.cache.manifest import read_table
from dflash_offline.cache.window import is_validation_store, read_retirements, read_seals
from tests.eval.helpers import write_chat_jsonl
from tests.test_quality_budget import _harness

ROOT = Path(__file__).resolve().parents[1]


def _args(**overrides: object) -> argparse.Namespace:
    settings: dict[str, object] = dict(
        codecs="fp8", variants='{"f": ""}', original_cache=False, equal_steps=False, train_args=""
    )
    return argparse.Namespace(**{**settings, **overrides})


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        ({}, None),
        ({"codecs": "default,fp8"}, "give one --codecs and one variant"),
        ({"variants": '{"a": "", "b": "--seed 1"}'}, "give one --codecs and one variant"),
        ({"equal_steps": True}, "neither --original-cache nor --equal-steps"),
        ({"train_args": "--val-every 50 --val-samples 200"}, "refuses --val-samples; leave it out"),
        ({"variants": '{"f": "--max-steps 9 @fp8"}'}, "refuses --max-steps; leave it out"),
        ({"variants": '{"f": "@fp8"}'}, None),
        ({"variants": '{"f": "@nf4"}'}, "the variant's cache @nf4 is not --codecs fp8"),
    ],
)
def test_the_follow_mode_refuses_what_train_follow_refuses_before_any_stage(
    overrides: dict[str, object], problem: str | None
) -> None:
    found = _harness().follow_problem(_args(**overrides))
    assert (found is None) if problem is None else (problem in (found or ""))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_follow_window_streams_one_cache_into_one_run_and_evaluates_its_final_drafter(
    tmp_path: Path,
) -> None:
    work, report = tmp_path / "q", tmp_path / "report"
    work.mkdir()
    write_chat_jsonl(work / "answers.jsonl", 24, turns=2)  # --regen-s 0: these answers as they are
    threads = str(torch.get_num_threads())
    proc = subprocess.run(
        [sys.executable, "bench/quality_recipe.py", "--smoke", "--data", str(work / "answers.jsonl"),
         "--work", str(work), "--report", str(report), "--target", "random:tiny", "--budget-s", "500",
         "--regen-s", "0", "--regen-limit", "24", "--codecs", "fp8", "--variants", '{"follow": ""}',
         "--follow-window", "2MB", "--follow-val-fraction", "0.2", "--train-s", "60", "--eval-s", "200",
         "--gen-args", f"--max-len 256 --too-long truncate --tokens-per-batch 256 --store-size 64KB "
         f"--layer-ids 0,2 --bucket-edges 48,96,160,256 --threads {threads}",
         "--train-args", f"--log-every 1 --threads {threads}", "--eval-args", "--bench mt-bench"],
        cwd=ROOT, capture_output=True, text=True, timeout=580, env={**os.environ, "OMP_NUM_THREADS": threads},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((report / "summary.json").read_text())
    stages = summary["stages"]
    assert list(stages) == ["generate_fp8", "train_follow", "eval_follow"]
    assert {name: s["rc"] for name, s in stages.items()} == dict.fromkeys(stages, 0)

    cache, run = work / "cache-fp8", work / "run-follow"
    rows = read_table(cache, "samples", ["sample_id", "shard"]).to_pydict()
    training = [s for s in rows["shard"] if not is_validation_store(s)]
    # Several stores through a window of 2 MB, every training store retired by the run, validation kept.
    seals = {s for s in read_seals(cache) if not is_validation_store(s)}
    assert len(seals) > 2
    assert set(read_retirements(cache)) == seals
    variant = summary["variants"]["follow"]
    segments = variant["segments"]
    follow_json = json.loads((run / "follow.json").read_text())
    assert [s["index"] for s in segments] == [s["index"] for s in follow_json["segments"]]
    assert segments[-1]["samples_so_far"] == sum(s["num_samples"] for s in follow_json["segments"])
    assert segments[-1]["samples_so_far"] == len(training)
    assert segments[-1]["last"]  # planned after generate's plan ended: the run ended with its decay
    # The rows of each segment renumbered to the run's global steps: the last one is the run's last step.
    assert variant["steps"] == sum(s["num_steps"] for s in follow_json["segments"])
    last = run / "segments" / f"{segments[-1]['index']:04d}"
    assert Path(variant["drafter"]).parent == last
    evaluated = json.loads((work / "eval-follow.json").read_text())
    assert evaluated["drafter"]["directory"] == variant["drafter"]
    assert [s["name"] for s in evaluated["sets"]] == ["mt-bench"]
    markdown = (report / "summary.md").read_text()
    assert f"segment {segments[-1]['index']}: from step" in markdown
    assert "retired" in markdown  # the window's stores, from dflash sql
