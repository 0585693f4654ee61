"""The generate progress bar shows the coordinator's ``ProgressView``: count, total once planned, postfix."""

from __future__ import annotations

import pytest

from dflash_offline.generate.progress import GenerateProgress, ProgressView


def test_the_bar_shows_the_view_and_learns_the_total_once_planning_is_done(
    capsys: pytest.CaptureFixture[str],
) -> None:
    bar = GenerateProgress(enabled=True, num_workers=2)
    view = ProgressView(
        samples=3, tokens=2_500_000, stored_bytes=4_000_000_000, failures=1, planned=7, total=None
    )
    bar.update(tally=view)
    bar._last_refresh = 0.0  # the bar refreshes at most every 0.25 s: let the next update through
    bar.update(
        tally=ProgressView(samples=5, tokens=2_500_000, stored_bytes=0, failures=1, planned=9, total=9)
    )
    bar.close()
    frames = capsys.readouterr().err.split("\r")
    before = next(f for f in frames if "planned=7" in f)
    for shown in ("3sample [", "GB=4.00", "failed=1", "tokens=2.50M"):
        assert shown in before
    after = next(f for f in frames if "planned=9" in f)
    assert "5/9 [" in after, "the total arrives with the second view"
    assert "GB=0.00" in after


def test_a_disabled_bar_ignores_updates(capsys: pytest.CaptureFixture[str]) -> None:
    bar = GenerateProgress(enabled=False, num_workers=1)
    bar.update(tally=ProgressView(samples=1, tokens=1, stored_bytes=1, failures=0, planned=1, total=1))
    bar.close()
    assert capsys.readouterr().err == ""
