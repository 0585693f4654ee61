"""The tie-aware exactness check: near-ties on a target whose logits the test sets, real mismatches on a
real target (and ``dflash eval`` failing on one), and the ulp rule."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import dflash_offline.eval.question_decoding as question_decoding
from dflash_offline.cli import main
from dflash_offline.cli.eval import DEFAULT_TIE_ULPS as CLI_DEFAULT
from dflash_offline.cli.eval import EXIT_MISMATCH
from dflash_offline.eval.exactness import DEFAULT_TIE_ULPS, classify, last_logits, ulp
from dflash_offline.target_model.loader import LoadedTarget, load_target
from tests.eval.helpers import export_untrained, one_thread, write_chat_jsonl

V = 32


@pytest.fixture(autouse=True)
def _single_thread() -> Iterator[None]:
    with one_thread():
        yield


class FixedLogits(nn.Module):
    """A 'target' whose last-position logits are a given vector, in a given dtype (rounded to it)."""

    def __init__(self, logits_V: list[float], dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, dtype=dtype))
        self.logits_V = torch.tensor(logits_V, dtype=dtype)
        self.seen: list[list[int]] = []

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False) -> Any:
        self.seen.append(input_ids[0].tolist())
        return SimpleNamespace(logits=self.logits_V.expand(1, input_ids.shape[1], -1))


def _logits(**values: float) -> list[float]:
    out = [0.0] * V
    for key, value in values.items():
        out[int(key.removeprefix("t"))] = value
    return out


def test_ulp_is_the_dtype_spacing_at_the_magnitude() -> None:
    assert ulp(20.0, torch.bfloat16) == 2.0**-7 * 16  # 0.125: bf16 keeps 8 significant bits
    assert ulp(-20.0, torch.bfloat16) == 0.125
    assert ulp(1.0, torch.bfloat16) == 2.0**-7
    assert ulp(20.0, torch.float32) == 2.0**-23 * 16
    # The spacing is what the dtype actually resolves: x + ulp is the next representable value.
    x = torch.tensor(20.0, dtype=torch.bfloat16)
    assert float(x + ulp(20.0, torch.bfloat16)) > 20.0
    assert float(x + ulp(20.0, torch.bfloat16) / 4) == 20.0
    assert CLI_DEFAULT == DEFAULT_TIE_ULPS


def test_near_tie_and_mismatch_on_controlled_logits() -> None:
    # bf16 at magnitude 20: ulp 0.125, tolerance 8 ulp = 1.0.
    model = FixedLogits(_logits(t5=20.0, t7=19.75, t9=18.0), torch.bfloat16)
    prompt, before = [1, 2, 3], [4, 6]
    tie = classify(model=model, prompt_ids=prompt, target_tokens=[*before, 5, 1], spec_tokens=[*before, 7, 2])
    assert model.seen == [[1, 2, 3, 4, 6]]  # one full forward over prompt + the common prefix
    assert tie.kind == "near_tie"
    assert tie.position == 2
    assert (tie.target_token, tie.spec_token) == (5, 7)
    assert tie.top_logit == 20.0
    assert tie.target_token_gap == 0.0
    assert tie.spec_token_gap == 0.25
    assert tie.top2_gap == 0.25
    assert tie.tolerance == 1.0
    # The same flip with the speculative token 16 ulp below the top: a real mismatch.
    far = classify(model=model, prompt_ids=prompt, target_tokens=[*before, 5], spec_tokens=[*before, 9])
    assert far.kind == "mismatch"
    assert far.spec_token_gap == 2.0
    # A tighter tolerance turns the near-tie into a mismatch (0.25 > 1 ulp = 0.125).
    strict = classify(model=model, prompt_ids=prompt, target_tokens=[5], spec_tokens=[7], tie_ulps=1.0)
    assert strict.kind == "mismatch"
    # Even a tiny gap counts against the target-only token too: here r is the one off the top.
    swapped = classify(model=model, prompt_ids=prompt, target_tokens=[9], spec_tokens=[5])
    assert swapped.kind == "mismatch"
    assert swapped.target_token_gap == 2.0


def test_identical_and_length_mismatch() -> None:
    model = FixedLogits(_logits(t5=20.0), torch.float32)
    same = classify(model=model, prompt_ids=[1], target_tokens=[5, 6], spec_tokens=[5, 6])
    assert same.kind == "identical"
    assert same.position is None
    assert model.seen == []  # nothing to explain, no forward
    shorter = classify(model=model, prompt_ids=[1], target_tokens=[5, 6, 7], spec_tokens=[5, 6])
    assert shorter.kind == "mismatch"
    assert shorter.position == 2


@pytest.fixture(scope="module")
def tiny() -> LoadedTarget:
    return load_target("random:tiny", device="cpu", dtype=torch.float32)


def test_a_real_mismatch_on_a_real_target(tiny: LoadedTarget) -> None:
    prompt = tiny.tokenizer("Hello there, how are you?")["input_ids"]
    ids = list(prompt)
    for _ in range(6):  # greedy without a cache: the reference
        ids.append(int(last_logits(tiny.model, ids).argmax()))
    greedy = ids[len(prompt) :]
    logits = last_logits(tiny.model, [*prompt, *greedy[:3]])
    assert int(logits.argmax()) == greedy[3]
    worst = int(logits.argmin())
    spec = [*greedy[:3], worst, *greedy[4:]]
    d = classify(model=tiny.model, prompt_ids=prompt, target_tokens=greedy, spec_tokens=spec)
    assert d.kind == "mismatch"
    assert d.position == 3
    assert d.spec_token_gap == pytest.approx(float(logits.max() - logits.min()), rel=1e-5)
    assert d.spec_token_gap > d.tolerance


def test_eval_fails_on_a_real_mismatch(
    tiny: LoadedTarget, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A speculative loop that emits one wrong token: the report is still written, the run exits 3 naming
    the prompt and the position."""
    drafter = export_untrained(tiny, tmp_path / "drafter", block_size=4)
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 3)
    real = question_decoding.Decoders.speculative

    def broken(self: Any, prompt_ids: Any, max_new_tokens: int | None = None) -> Any:
        out = real(self, prompt_ids, max_new_tokens)
        if max_new_tokens is not None:  # the warm-up
            return out
        logits = last_logits(self.target, [*prompt_ids, *out.tokens[:2]])
        tokens = (*out.tokens[:2], int(logits.argmin()), *out.tokens[3:])
        return type(out)(**{**{f: getattr(out, f) for f in out.__dataclass_fields__}, "tokens": tokens})

    monkeypatch.setattr(question_decoding.Decoders, "speculative", broken)
    report = tmp_path / "r.json"
    args = ["eval", "--target", "random:tiny", "--drafter", str(drafter), "--data", str(data), "--limit", "2",
            "--max-new-tokens", "6", "--json", str(report), "--no-progress"]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == EXIT_MISMATCH, result.output
    assert "error: data rec-" in result.output
    assert "mismatch at new token 2" in result.output
    written = json.loads(report.read_text())
    assert [p["divergence"]["kind"] for p in written["prompts"]] == ["mismatch", "mismatch"]
    assert written["sets"][0]["mismatches"] == 2
