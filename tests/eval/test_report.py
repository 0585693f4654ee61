"""The per-set table's arithmetic on a hand-computed case (decode results made up, times chosen)."""

from __future__ import annotations

import pytest

from dflash_offline.decode import DecodeResult
from dflash_offline.eval.report import (
    EVAL_REPORT_VERSION,
    EvalReport,
    format_table,
    prompt_result,
    summarize_sets,
)

B = 4


def _decode(num_tokens: int, accepted: tuple[int, ...], seconds: float) -> DecodeResult:
    return DecodeResult(
        tokens=tuple(range(num_tokens)),
        accepted_per_cycle=accepted,
        stop_reason="length",
        prefill_seconds=9.0,  # never counted
        decode_seconds=seconds,
        num_target_forwards=len(accepted) or num_tokens - 1,
    )


def _result(
    bench: str, qid: str, turn: int, *, n: int, accepted: tuple[int, ...], spec_s: float, target_s: float
):  # type: ignore[no-untyped-def]
    return prompt_result(
        sample_id=f"{bench}:{qid}", record_id=qid, prompt_tokens=10, spec=_decode(n, accepted, spec_s),
        target_only=_decode(n, (), target_s), block_size=B, text="", bench=bench, turn=turn, question_id=qid,
    )  # fmt: skip


def test_table_arithmetic_on_a_hand_computed_case() -> None:
    results = [
        # set A: the scripted case of test_speculative (accepted 2,0,3,1,0,3,3: 1 + 19 = 20 tokens).
        _result("A", "q1", 1, n=20, accepted=(2, 0, 3, 1, 0, 3, 3), spec_s=0.5, target_s=1.0),
        # set B: one question of two turns: 1 + 3 = 4 tokens, then 1 + 8 = 9 tokens.
        _result("B", "q2", 1, n=4, accepted=(0, 0, 0), spec_s=0.2, target_s=0.1),
        _result("B", "q2", 2, n=9, accepted=(3, 3), spec_s=0.3, target_s=0.4),
    ]
    sets, mean, pooled = summarize_sets(results, block_size=B)
    a, b = sets
    assert (a.name, a.num_questions, a.num_prompts, a.cycles, a.new_tokens) == ("A", 1, 1, 7, 20)
    assert a.tau == pytest.approx(19 / 7)
    assert a.accepted_histogram == [2, 1, 1, 3]
    assert a.spec_tokens_per_s == pytest.approx(20 / 0.5)
    assert a.target_tokens_per_s == pytest.approx(20 / 1.0)
    assert a.speedup == pytest.approx(2.0)
    assert (b.name, b.num_questions, b.num_prompts, b.cycles, b.new_tokens) == ("B", 1, 2, 5, 13)
    assert b.tau == pytest.approx((3 + 8) / 5)
    assert b.accepted_histogram == [3, 0, 0, 2]
    assert b.spec_tokens_per_s == pytest.approx(13 / 0.5)
    assert b.target_tokens_per_s == pytest.approx(13 / 0.5)
    assert b.speedup == pytest.approx(1.0)
    # The mean row: each set once.
    assert mean.num_sets == 2
    assert mean.tau == pytest.approx((19 / 7 + 11 / 5) / 2)
    assert mean.spec_tokens_per_s == pytest.approx((40 + 26) / 2)
    assert mean.target_tokens_per_s == pytest.approx((20 + 26) / 2)
    assert mean.speedup == pytest.approx(1.5)
    # Pooled: every cycle and every second together (not a mean of the sets).
    assert pooled.tau == pytest.approx(30 / 12)
    assert pooled.new_tokens == 33
    assert pooled.speedup == pytest.approx(1.5 / 1.0)
    assert pooled.accepted_histogram == [5, 1, 1, 5]
    report = EvalReport(
        version=EVAL_REPORT_VERSION, config={}, target={"target_id": "t"}, drafter={"directory": "d"},
        held_out="h", warnings=[], prompts=results, summary=pooled, sets=sets, mean=mean,
    )  # fmt: skip
    table, hist = format_table(report).split("accepted draft tokens per cycle")
    rows = {line.split("  ")[0]: line.split() for line in table.splitlines() if line}
    hist_rows = {line.split()[0]: line.split()[1:] for line in hist.splitlines()[1:] if line}
    assert rows["A"][1:10] == ["1", "1", "20", "7", "2.714", "20.0", "40.0", "2.00x", "1"]
    assert rows["B"][1:10] == ["1", "2", "13", "5", "2.200", "26.0", "26.0", "1.00x", "2"]
    assert rows["mean of 2 sets"][4:8] == ["2.457", "23.0", "33.0", "1.50x"]
    assert rows["all (pooled)"][2:11] == ["2", "3", "33", "12", "2.500", "22.0", "33.0", "1.50x", "3"]
    # The histogram rows, in % of each set's cycles.
    assert hist_rows["A"] == ["29", "14", "14", "43"]
    assert hist_rows["B"] == ["60", "0", "0", "40"]


def _report(results: list) -> EvalReport:  # type: ignore[type-arg]
    sets, mean, pooled = summarize_sets(results, block_size=B)
    return EvalReport(
        version=EVAL_REPORT_VERSION, config={}, target={"target_id": "t"}, drafter={"directory": "d"},
        held_out="h", warnings=[], prompts=results, summary=pooled, sets=sets, mean=mean,
    )  # fmt: skip


def test_timings_too_short_to_time_are_marked_noise_with_the_rule() -> None:
    """At least 1,000 new tokens and 5 s of decoding in each loop, or tok/s and speedup are noise: said in
    the table's row (and its rule printed) and in the JSON's ``timed``, per set and per prompt."""
    short = [_result("A", "q1", 1, n=48, accepted=(0,) * 47, spec_s=0.7, target_s=0.4)]  # a 0.57x
    table = format_table(_report(short))
    row = next(line.split() for line in table.splitlines() if line.startswith("A "))
    assert row[8] == "0.57x"
    assert row[-2:] == ["no:", "noise"]
    assert "noise, not a measurement" in table
    assert "at least 1,000 new tokens and 5 s of decoding in each loop" in table
    doc = _report(short).to_dict()
    assert doc["summary"]["timed"] is False
    assert doc["prompts"][0]["timed"] is False
    assert "1,000 new tokens" in doc["timing_rule"]
    # Enough tokens but too little time in one loop: still noise.
    fast = [_result("A", f"q{i}", 1, n=500, accepted=(3,) * 125, spec_s=1.0, target_s=9.0) for i in range(2)]
    assert not _report(fast).summary.timed
    # Long enough: a measurement, and no rule line; each 500-token prompt alone is still noise.
    long = [_result("A", f"q{i}", 1, n=500, accepted=(3,) * 125, spec_s=3.0, target_s=9.0) for i in range(2)]
    report = _report(long)
    table = format_table(report)
    row = next(line.split() for line in table.splitlines() if line.startswith("A "))
    assert row[-1] == "yes"
    assert "noise" not in table
    assert report.summary.timed
    assert not any(p.timed for p in report.prompts)
