"""``dflash eval --tensorboard DIR``: the report's τ table as scalars that tensorboard's reader loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash_offline.cli import main
from dflash_offline.target_model.loader import load_target
from tests.eval.helpers import export_untrained, one_thread, write_chat_jsonl

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def test_eval_writes_its_tau_table_to_tensorboard(tmp_path: Path) -> None:
    with one_thread():
        drafter = export_untrained(
            load_target("random:tiny", device="cpu"), tmp_path / "drafter", block_size=4
        )
        data = write_chat_jsonl(tmp_path / "chat.jsonl", 4)
        out, tb_dir = tmp_path / "r.json", tmp_path / "tb"
        args = ["eval", "--target", "random:tiny", "--drafter", str(drafter), "--data", str(data),
                "--limit", "2", "--max-new-tokens", "8", "--json", str(out), "--tensorboard", str(tb_dir),
                "--no-progress"]  # fmt: skip
        result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert f"tensorboard scalars written to {tb_dir}" in result.output
    report = json.loads(out.read_text())
    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()

    def series(tag: str) -> list[tuple[int, float]]:
        return [(e.step, e.value) for e in acc.Scalars(tag)]

    s = report["summary"]
    assert series("eval/tau") == [(0, pytest.approx(s["tau"]))]
    assert series("eval/identical_prompts") == [(0, float(s["identical_prompts"]))]
    assert series("eval/accepted_histogram") == [(a, float(n)) for a, n in enumerate(s["accepted_histogram"])]
    assert series("eval/prompt_tau") == [
        (i, pytest.approx(p["tau"])) for i, p in enumerate(report["prompts"])
    ]
