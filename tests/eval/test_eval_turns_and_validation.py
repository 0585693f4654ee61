"""``dflash eval`` measured like validation: every user turn of a chat record (``--turns all``), the
records the training run held out (``--bench validation``, split by whether a trained record shares
their conversation), and held-out prompts that keep away from trained conversations (ShareGPT's
``X_11`` when ``X_0`` was trained on)."""

from __future__ import annotations

import datetime as dt
import json
import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from dflash_offline.cache.manifest import record_run
from dflash_offline.cache.reader import CacheReader
from dflash_offline.cache.rows import RunRow
from dflash_offline.cli import main
from dflash_offline.data.conversations import Conversation, Message
from dflash_offline.data.sources import iter_records, source_name
from dflash_offline.decode import SingleSequence
from dflash_offline.errors import ConfigError
from dflash_offline.eval.benches import parse_bench
from dflash_offline.eval.prompts import render_prompt_ids, resolve_held_out, select_prompts
from dflash_offline.eval.question_decoding import Decoders, EvalQuestion, decode_question
from dflash_offline.eval.validation_set import select_validation_prompts
from dflash_offline.target_model.loader import LoadedTarget, load_target
from dflash_offline.train.snapshot import save_run_split, save_snapshot, split_snapshot, take_snapshot
from tests.eval.helpers import WORDS, export_untrained, one_thread, untrained_drafter, write_tiny_cache
from tests.oracles.reference_decode import TargetCaller, target_only_decode

FRACTION = 0.4


@pytest.fixture(autouse=True)
def _single_thread() -> Iterator[None]:
    with one_thread():
        yield


@pytest.fixture(scope="module")
def tiny() -> LoadedTarget:
    return load_target("random:tiny", device="cpu")


def _root(record_id: str) -> str:
    return re.sub(r"_\d+$", "", record_id)  # ShareGPT's rule, written out


def _sharegpt(path: Path, num_roots: int) -> Path:
    """Roots R000000.., each split into records ``_0``, ``_4`` (and ``_9`` for every third), each record
    two human turns with their answers."""
    with open(path, "w") as f:
        for r in range(num_roots):
            for part in (0, 4, 9)[: 3 if r % 3 == 0 else 2]:
                turns = []
                for t in range(2):
                    human = " ".join(WORDS[(r + part + t + k) % len(WORDS)] for k in range(3 + t))
                    turns += [{"from": "human", "value": human}, {"from": "gpt", "value": "fine " * (t + 2)}]
                f.write(json.dumps({"id": f"R{r:06d}_{part}", "conversations": turns}) + "\n")
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, tiny: LoadedTarget) -> dict[str, Any]:
    """A run trained on a cache of the records of roots 0..9 except their ``_4`` parts of odd roots; the
    run split that cache by sample (--val-group sample)."""
    root = tmp_path_factory.mktemp("turns")
    data = _sharegpt(root / "parts.jsonl", 14)
    convs = [c for c in iter_records(data) if isinstance(c, Conversation)]
    cached = [
        c for c in convs if int(c.record_id[1:7]) < 10 and not c.record_id.endswith(("1_4", "3_4", "5_4"))
    ]
    cache = write_tiny_cache(root / "cache", [c.sample_id for c in cached], data_source=source_name(data))
    now = dt.datetime.now(dt.UTC)
    record_run(
        cache,
        RunRow(
            run_id="gen-1", command="generate", started_at=now, finished_at=now, status="finished",
            num_workers=1, samples_committed=len(cached), tokens_committed=0, bytes_written=0, failures=0,
            fingerprint_json="{}", host="test",
            config_json=json.dumps({"data": str(data), "data_format": "auto"}),
        ),
    )  # fmt: skip
    run = root / "run"
    run.mkdir()
    config = {"cache_dir": str(cache), "val_fraction": FRACTION, "val_samples": None, "val_group": "sample"}
    (run / "config.json").write_text(json.dumps(config))
    with CacheReader.open(cache) as reader:
        snapshot = take_snapshot(reader)
    save_snapshot(snapshot, run / "snapshot.parquet")
    split = split_snapshot(snapshot, fraction=FRACTION, num_samples=None)
    save_run_split(run, split)  # as `dflash train` writes it
    assert split.validation is not None
    export_untrained(tiny, run / "drafter", block_size=4)
    validation = set(split.validation.sample_ids)
    by_id = {c.sample_id: c for c in convs}
    trained_roots = {_root(by_id[s].record_id) for s in split.train.sample_ids}
    return {
        "data": data, "cache": cache, "run": run, "convs": convs, "cached": {c.sample_id for c in cached},
        "validation": validation, "trained_roots": trained_roots,
    }  # fmt: skip


def test_bench_lists() -> None:
    assert parse_bench("all") == ("mt-bench", "humaneval", "sharegpt")
    assert parse_bench("sharegpt,validation") == ("sharegpt", "validation")
    assert parse_bench("validation, all") == ("validation", "mt-bench", "humaneval", "sharegpt")
    with pytest.raises(ConfigError, match="'sharegpts' is none of"):
        parse_bench("mt-bench,sharegpts")


def test_held_out_prompts_keep_away_from_trained_conversations(
    setup: dict[str, Any], tiny: LoadedTarget
) -> None:
    held = resolve_held_out(exclude_cache=None, drafter_dir=setup["run"] / "drafter", data=setup["data"])
    assert held.excluded_roots == setup["trained_roots"]
    assert "conversations (roots)" in held.note
    selection = select_prompts(setup["data"], tiny.tokenizer, held_out=held, limit=100, turns="all")
    chosen = {p.record_id for p in selection.prompts}
    want = {
        c.record_id
        for c in setup["convs"]
        if _root(c.record_id) not in setup["trained_roots"]
        and (c.sample_id not in setup["cached"] or c.sample_id in setup["validation"])
    }
    assert chosen == want
    # Records never cached but of a trained conversation are the ones this rule adds.
    neighbours = {
        c.record_id
        for c in setup["convs"]
        if c.sample_id not in setup["cached"] and _root(c.record_id) in setup["trained_roots"]
    }
    assert neighbours
    assert not neighbours & chosen
    # --turns all: each record's human turns, one group each, in order.
    for prompt in selection.prompts:
        conv = next(c for c in setup["convs"] if c.sample_id == prompt.sample_id)
        humans = [m.content for m in conv.messages if m.role == "user"]
        assert [[(m.role, m.content) for m in g] for g in prompt.turns] == [[("user", h)] for h in humans]
        first = render_prompt_ids(tiny.tokenizer, [{"role": "user", "content": humans[0]}])
        assert list(prompt.prompt_ids) == first


def test_validation_set_is_the_runs_held_out_records(setup: dict[str, Any], tiny: LoadedTarget) -> None:
    chosen = select_validation_prompts(
        setup["run"] / "drafter", tiny.tokenizer, limit=100, max_prompt_tokens=512, turns="first"
    )
    by_id = {c.sample_id: c for c in setup["convs"]}
    unseen = {s for s in setup["validation"] if _root(by_id[s].record_id) not in setup["trained_roots"]}
    assert {p.sample_id for p in chosen.unseen_root} == unseen
    assert {p.sample_id for p in chosen.trained_root} == setup["validation"] - unseen
    assert chosen.unseen_root
    assert chosen.trained_root
    assert all(p.turns == () for p in chosen.unseen_root)  # --turns first
    limited = select_validation_prompts(
        setup["run"] / "drafter", tiny.tokenizer, limit=1, max_prompt_tokens=512, turns="all"
    )
    assert (len(limited.unseen_root), len(limited.trained_root)) == (1, 1)
    with pytest.raises(ConfigError, match="not the export of a `dflash train` run"):
        select_validation_prompts(setup["cache"], tiny.tokenizer, limit=1, max_prompt_tokens=512, turns="all")


def test_a_chat_records_later_turns_follow_the_targets_own_answers(tiny: LoadedTarget) -> None:
    system = Message(role="system", content="Answer briefly.")
    first, second = Message(role="user", content="the quick fox"), Message(role="user", content="a lazy dog")
    question = EvalQuestion(
        bench="sharegpt", question_id="", sample_id="s", record_id="r", turns=((system, first), (second,))
    )
    caller = TargetCaller(tiny.model)
    engine = SingleSequence(tiny.model, max_len=4096 + 16, attend_granule=16)
    dec = Decoders(
        engine=engine,
        drafter=engine.drafter_for(untrained_drafter(tiny, block_size=4)),
        target=tiny.model,
        tokenizer=tiny.tokenizer,
        layer_ids=(0, 2),
        stop_ids=frozenset(),
        max_new_tokens=6,
        max_prompt_tokens=4096,
        tie_ulps=8.0,
    )
    one, two = list(decode_question(question, dec))
    opening = [{"role": "system", "content": system.content}, {"role": "user", "content": first.content}]
    assert list(one.prompt_ids) == render_prompt_ids(tiny.tokenizer, opening)
    greedy = target_only_decode(caller, one.prompt_ids, max_new_tokens=6, stop_ids=frozenset())
    answer = tiny.tokenizer.decode(list(greedy.tokens), skip_special_tokens=True)
    expected = [
        *opening,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": second.content},
    ]
    assert list(two.prompt_ids) == render_prompt_ids(tiny.tokenizer, expected)
    # A prompt longer than the limit ends a chat conversation there, without a note.
    notes: list[str] = []
    short = replace(dec, max_prompt_tokens=len(one.prompt_ids))
    assert [d.turn for d in decode_question(question, short, on_skip=notes.append)] == [1]
    assert notes == []


def test_eval_cli_validation_and_all_turns(setup: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "eval.json"
    args = ["eval", "--target", "random:tiny", "--drafter", str(setup["run"] / "drafter"),
            "--bench", "sharegpt,validation", "--turns", "all", "--data", str(setup["data"]), "--limit", "2",
            "--max-new-tokens", "4", "--json", str(out), "--no-progress"]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert [s["name"] for s in report["sets"]] == ["sharegpt", "validation", "validation-trained-root"]
    for name in ("sharegpt", "validation", "validation-trained-root"):
        rows = [p for p in report["prompts"] if p["bench"] == name]
        assert [p["turn"] for p in rows] == [1, 2, 1, 2]  # two records, both human turns of each
    by_id = {c.sample_id: c for c in setup["convs"]}
    val = [p["sample_id"] for p in report["prompts"] if p["bench"].startswith("validation")]
    assert set(val) <= setup["validation"]
    seen = {p["sample_id"] for p in report["prompts"] if p["bench"] == "validation-trained-root"}
    assert all(_root(by_id[s].record_id) in setup["trained_roots"] for s in seen)
    assert any("validation: " in w and "held-out records" in w for w in report["warnings"])
    assert report["config"]["turns"] == "all"
