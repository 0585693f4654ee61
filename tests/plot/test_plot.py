"""``dflash plot`` of a run, a cache and an eval report: PNGs that decode and are not blank, bucket counts
against an independent count of what was written, and kind detection."""

from __future__ import annotations

import bisect
import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from dflash_offline.cli import main
from dflash_offline.errors import ConfigError
from dflash_offline.eval.report import EVAL_REPORT_VERSION, EvalReport, PromptResult, summarize
from dflash_offline.plot import default_out_dir, detect_kind, plot_path
from dflash_offline.plot.cache_plots import bucket_labels, bucket_summary
from dflash_offline.plot.run_plots import read_run_metrics
from dflash_offline.train.metrics import StepMetrics
from tests.eval.helpers import tiny_fingerprint, write_tiny_cache


def _assert_png(path: Path) -> None:
    import matplotlib.image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(path)
    assert image.shape[0] > 200
    assert image.shape[1] > 300
    assert float(image[..., :3].std()) > 0.05  # not a blank canvas


def _write_run(run: Path, num_steps: int, *, block: int = 8) -> None:
    run.mkdir(parents=True)
    rng = np.random.default_rng(0)
    lines = []
    for step in range(1, num_steps + 1):
        progress = step / num_steps
        acc = [float(np.clip(0.8 * progress * 0.85**k + rng.normal(0, 0.02), 0, 1)) for k in range(block - 1)]
        tau = 1 + float(np.sum(np.cumprod(acc)))
        metrics = StepMetrics(
            step=step,
            epoch=step * 3 // num_steps,
            loss=8.0 * np.exp(-3 * progress) + rng.random() * 0.1,
            lr=6e-4 * min(1.0, step / 3),
            grad_norm=1.0 + rng.random(),
            acc_by_position=acc,
            simulated_tau=tau,
            tokens=4096,
            tokens_per_s=2000 + 100 * rng.random(),
            step_seconds=2.0,
            data_wait_fraction=0.05,
            buckets=[0, 1],
            num_blocks=64,
        )
        lines.append(metrics.to_json())
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n" + lines[-1][:20])  # a line being written


def test_plot_run(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _write_run(run, 40)
    rows = read_run_metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 41))  # the partial last line is passed over
    result = plot_path(run)
    assert result.kind == "run"
    assert result.out_dir == run / "plots"
    assert sorted(p.name for p in result.files) == [
        "accuracy_by_position.png", "loss.png", "simulated_tau.png", "throughput.png",
    ]  # fmt: skip
    for path in result.files:
        _assert_png(path)


def test_plot_run_draws_the_validation_curve_on_the_training_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dflash_offline.plot import run_plots

    run = tmp_path / "run"
    _write_run(run, 30)
    path = run / "metrics.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()[:-1]]
    val_steps = [10, 20, 30]
    for line in lines:
        if line["step"] in val_steps:
            line.update(
                val_loss=9.0 - line["step"] / 10,
                val_simulated_tau=1 + line["step"] / 30,
                val_block_tau=1.5,
                val_chain_tau=1 + line["step"] / 60,
                val_chain_tau_by_turn=[1 + line["step"] / 90, 2.0, None if line["step"] == 10 else 3.0],
            )
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    drawn: dict[str, dict[str, tuple[list[float], list[float]]]] = {}
    save = run_plots.save

    def capture(fig, out):  # type: ignore[no-untyped-def]
        drawn[out.name] = {
            str(line.get_label()): (list(line.get_xdata()), list(line.get_ydata()))
            for ax in fig.axes
            for line in ax.get_lines()
        }
        return save(fig, out)

    monkeypatch.setattr(run_plots, "save", capture)
    for png in plot_path(run).files:
        _assert_png(png)
    loss, tau = drawn["loss.png"], drawn["simulated_tau.png"]
    assert loss["validation"] == (val_steps, [8.0, 7.0, 6.0])
    assert len(loss["loss"][0]) == 30  # the training curve is there too
    assert tau["validation"] == (val_steps, [1 + s / 30 for s in val_steps])
    assert tau["validation, per block"] == (val_steps, [1.5, 1.5, 1.5])
    assert tau[run_plots.CHAIN_LABEL] == (val_steps, [1 + s / 60 for s in val_steps])
    first, second, later = run_plots.TURN_LABELS
    assert tau[first] == (val_steps, [1 + s / 90 for s in val_steps])
    assert tau[second] == (val_steps, [2.0, 2.0, 2.0])
    assert tau[later] == ([20, 30], [3.0, 3.0])  # no cycle of a later turn at step 10
    assert len(tau["training batches"][0]) == 30


def test_plot_run_with_one_step(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _write_run(run, 1)
    result = plot_path(run, tmp_path / "out")
    assert sorted(p.name for p in result.files) == [
        "accuracy_by_position.png", "loss.png", "simulated_tau.png", "throughput.png",
    ]  # fmt: skip
    for path in result.files:
        assert path.parent == tmp_path / "out"
        _assert_png(path)


def test_plot_run_refuses_an_empty_log(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ConfigError, match="no step yet"):
        plot_path(tmp_path)


def test_plot_cache(tmp_path: Path) -> None:
    lengths = [3, 8, 9, 16, 17, 40, 64, 5, 30, 33, 2]  # edges 8, 16, 32, 64
    cache = write_tiny_cache(
        tmp_path / "cache", [f"s{i}" for i in range(len(lengths))], data_source="x", lengths=lengths
    )
    summary = bucket_summary(cache)
    edges = tiny_fingerprint(data_source="x").bucket_edges
    expected = [0] * len(edges)
    expected_tokens = [0] * len(edges)
    for n in lengths:
        expected[bisect.bisect_left(edges, n)] += 1
        expected_tokens[bisect.bisect_left(edges, n)] += n
    assert list(summary.samples) == expected == [4, 2, 2, 3]
    assert list(summary.tokens) == expected_tokens
    assert summary.labels == ("≤8", "9–16", "17–32", "33–64")
    result = CliRunner().invoke(main, ["plot", str(cache)])
    assert result.exit_code == 0, result.output
    out = default_out_dir(cache, "cache")
    assert out == tmp_path / "cache-plots"
    assert not (cache / "plots").exists()  # nothing is added to the cache itself
    for name in ("buckets.png", "lengths.png"):
        assert str(out / name) in result.output
        _assert_png(out / name)
    # As every cache command takes it: --cache C is the same command.
    again = CliRunner().invoke(main, ["plot", "--cache", str(cache)])
    assert again.exit_code == 0, again.output
    assert again.output == result.output
    refused = CliRunner().invoke(main, ["plot", "--cache", str(tmp_path)])  # a folder, not a cache
    assert refused.exit_code == 1, refused.output
    assert refused.output.strip().splitlines() == [
        f"Error: --cache {tmp_path}: not a cache (no cache.json); plot a run or report as PATH"
    ]


def test_bucket_labels() -> None:
    assert bucket_labels((256, 512, 3072)) == ["≤256", "257–512", "513–3072", ">3072"]


def test_plot_eval_report(tmp_path: Path) -> None:
    prompts = [
        PromptResult(
            sample_id=f"s{i}",
            record_id="",
            prompt_tokens=10,
            new_tokens=20,
            cycles=5,
            accepted_histogram=[1, 2, 1, 1],
            tau=2.4 + i,
            spec_seconds=1.0,
            target_seconds=1.5 + i,
            speedup=1.5 + i,
            identical=True,
            first_mismatch=None,
            stop_reason="length",
            text="",
        )
        for i in range(3)
    ]
    report = EvalReport(
        version=EVAL_REPORT_VERSION, config={}, target={}, drafter={}, held_out="", warnings=[],
        prompts=prompts, summary=summarize(prompts, block_size=4),
    )  # fmt: skip
    path = tmp_path / "report.json"
    path.write_text(json.dumps(asdict(report)))
    result = plot_path(path)
    assert result.kind == "eval"
    assert [p.name for p in result.files] == ["eval_acceptance.png"]
    assert result.out_dir == tmp_path / "report-plots"
    _assert_png(result.files[0])


def test_unknown_paths_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="expected a training run"):
        detect_kind(tmp_path)
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    with pytest.raises(ConfigError, match="not a `dflash eval --json` report"):
        plot_path(bad)


def _captured_figures(monkeypatch: pytest.MonkeyPatch, module: object) -> dict[str, object]:
    """The figures ``module`` saves, by file name, drawn before they are closed (their artists laid out)."""
    figures: dict[str, object] = {}
    save = module.save  # type: ignore[attr-defined]

    def capture(fig, out):  # type: ignore[no-untyped-def]
        fig.tight_layout()
        fig.canvas.draw()
        figures[out.name] = {
            "titles": [(ax.title.get_text(), ax.title.get_window_extent()) for ax in fig.axes],
            "width": fig.bbox.width,
            "ylim": [ax.get_ylim() for ax in fig.axes],
            "xlim": [ax.get_xlim() for ax in fig.axes],
            "vlines": [
                (str(line.get_label()), list(line.get_xdata()))
                for ax in fig.axes
                for line in ax.get_lines()
                if len(set(line.get_xdata())) == 1 and len(line.get_xdata()) == 2
            ],
            "texts": [t.get_text() for ax in fig.axes for t in ax.texts],
        }
        return save(fig, out)

    monkeypatch.setattr(module, "save", capture)
    return figures


def test_run_plot_titles_fit_the_figure_and_the_tau_axis_fits_the_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long run name with every validation figure in the title stays inside the figure (wrapped, not
    clipped); a run near τ 1.05 gets a τ axis near its values, not one from 1 to B = 8."""
    from dflash_offline.plot import run_plots

    run = tmp_path / "smollm2-b8-one-layer-drafter-trained-on-regenerated-sharegpt-answers-2026-12-06"
    _write_run(run, 30)
    path = run / "metrics.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()[:-1]]
    for line in lines:
        line["simulated_tau"] = 1.02 + line["step"] / 1000
        if line["step"] % 10 == 0:
            line.update(val_loss=6.5, val_simulated_tau=1.04, val_block_tau=1.03, val_chain_tau=1.05)
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    figures = _captured_figures(monkeypatch, run_plots)
    plot_path(run)
    for name, fig in figures.items():
        for text, box in fig["titles"]:  # type: ignore[index]
            if text:
                assert box.x0 >= 0, (name, text)
                assert box.x1 <= fig["width"], (name, text)  # type: ignore[index]
    bottom, top = figures["simulated_tau.png"]["ylim"][0]  # type: ignore[index]
    assert bottom == 1.0
    assert 1.06 <= top <= 1.2  # the highest value drawn (1.06) and a margin, not B + 0.5 = 8.5


@pytest.mark.parametrize("spelling", ["NaN", "null", "Infinity"])
def test_run_plot_marks_where_the_loss_stopped_being_finite(
    spelling: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hand-written metrics.jsonl whose loss is finite up to step 3, then ``spelling`` (a strict writer's
    null, or NaN / Infinity as json.dumps writes them), and whose grad norm goes first in another file."""
    from dflash_offline.plot import run_plots

    def line(step: int, loss: str, grad_norm: str) -> str:
        return (
            f'{{"step": {step}, "loss": {loss}, "lr": 0.001, "grad_norm": {grad_norm}, "simulated_tau": 1.1, '
            '"acc_by_position": [0.1, 0.05, 0.0], "tokens_per_s": 100.0, "data_wait_fraction": 0.0}'
        )

    run = tmp_path / "run"
    run.mkdir()
    steps = [line(s, "5.0", "1.0") for s in (1, 2, 3)] + [line(s, spelling, spelling) for s in (4, 5, 6)]
    (run / "metrics.jsonl").write_text("\n".join(steps) + "\n")
    figures = _captured_figures(monkeypatch, run_plots)
    plot_path(run)
    loss = figures["loss.png"]
    assert ("loss not finite from step 4", [4, 4]) in loss["vlines"]  # type: ignore[index]
    assert sum(x == [4, 4] for _, x in loss["vlines"]) == 2  # type: ignore[index]  # loss and lr panels
    assert any("loss not finite from step 4" in t for t in loss["texts"])  # type: ignore[index]
    assert "loss not finite from step 4" in loss["titles"][0][0].replace("\n", " ")  # type: ignore[index]
    assert any(x == [4, 4] for _, x in figures["simulated_tau.png"]["vlines"])  # type: ignore[index]
    result = CliRunner().invoke(main, ["plot", str(run)])
    assert result.exit_code == 0, result.output
    assert "warning: loss not finite from step 4" in result.output

    other = tmp_path / "grad-first"
    other.mkdir()
    steps = [line(1, "5.0", "1.0"), line(2, "5.0", spelling), line(3, spelling, spelling)]
    (other / "metrics.jsonl").write_text("\n".join(steps) + "\n")
    figures.clear()
    plot_path(other)
    assert ("grad norm not finite from step 2", [2, 2]) in figures["loss.png"]["vlines"]  # type: ignore[index]


def test_cache_length_axis_ends_at_the_fingerprints_max_length() -> None:
    from dflash_offline.plot.cache_plots import _lengths_figure
    from dflash_offline.plot.common import pyplot

    tokens = np.array([100, 300, 700, 1024])
    fig = _lengths_figure(
        pyplot(), tokens, tokens // 2, edges=(256, 512, 1024, 2048, 3072), name="c", max_length=1024
    )
    ax = fig.axes[0]
    assert ax.get_xlim() == (0.0, 1024.0)
    edges_drawn = sorted(line.get_xdata()[0] for line in ax.get_lines())
    assert edges_drawn == [256, 512, 1024]
