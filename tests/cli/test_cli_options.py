"""The command line derived from the config dataclasses: same --help as before the derivation (a
snapshot), every option's default is its field's, the CLI builds the config a caller would build by
hand, --layer-ids has one validating parser, and CACHE is accepted positionally or as --cache."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import click
import pytest
import torch
from click.testing import CliRunner

from dflash_offline.cli import main
from dflash_offline.cli.flags import render, spelling
from dflash_offline.config_fields import cli_spec, option_fields
from dflash_offline.decode.attention import fused_kernels_run
from dflash_offline.eval.config import EVAL_DTYPES, EvalConfig
from dflash_offline.generate.config import GenerateConfig
from dflash_offline.placement import Placement
from dflash_offline.regenerate.config import RegenerateConfig
from dflash_offline.train.config import TrainConfig
from tests.cli._help_snapshot import snapshot

SNAPSHOT = Path(__file__).with_name("help_snapshot.json")
CONFIGS = {
    "train": TrainConfig,
    "generate": GenerateConfig,
    "regenerate": RegenerateConfig,
    "eval": EvalConfig,
}


class _Captured(Exception):  # noqa: N818 (not an error: it carries what the library function got)
    def __init__(self, value: Any) -> None:
        super().__init__("captured")
        self.value = value


def _capture(monkeypatch: pytest.MonkeyPatch, module: str, name: str) -> None:
    """Replace the library function a command calls by one that stops the command with its argument."""

    def fake(*args: Any, **kwargs: Any) -> Any:
        raise _Captured(args[0] if args else kwargs)

    monkeypatch.setattr(f"{module}.{name}", fake)


def _invoked_with(args: list[str]) -> Any:
    result = CliRunner().invoke(main, args)
    assert isinstance(result.exception, _Captured), (result.exit_code, result.output, result.exception)
    return result.exception.value


def test_help_of_every_command_matches_the_snapshot() -> None:
    """Flags, defaults, types, help texts and order of every command, as they were written by hand
    before the options were derived from the config dataclasses (plus the positional CACHE)."""
    assert json.loads(json.dumps(snapshot())) == json.loads(SNAPSHOT.read_text())


@pytest.mark.parametrize("command_name", sorted(CONFIGS))
def test_every_config_field_with_a_cli_spec_is_an_option_with_the_field_default(command_name: str) -> None:
    cls = CONFIGS[command_name]
    command = main.get_command(click.Context(main), command_name)
    assert command is not None
    by_flag = {opt: p for p in command.params for opt in p.opts}
    checked = 0
    for o in option_fields(cls):  # a config's fields and its sections' (TrainConfig's)
        f, hints = o.field, typing.get_type_hints(o.owner)
        spec = cli_spec(f)
        if spec is None or spec.kind == "placement" or spec.required:
            continue
        option = by_flag[spelling(f.name, spec)]
        assert option.help == (None if spec.help is None else render(spec.help)), f.name
        if spec.parse is not None:  # text in, the field's value out
            assert option.default == (None if spec.format is None else spec.format(f.default))
            if option.default is not None:
                assert spec.parse(option.default) == f.default
        elif spec.negate:
            assert getattr(option, "is_flag", False)  # given: the field is False
            assert f.default is True
        elif hints[f.name] is bool and spec.secondary is None:
            assert f.default is False
            assert getattr(option, "is_flag", False)
        else:
            assert option.default == f.default, f.name
        if typing.get_origin(hints[f.name]) is typing.Literal:
            assert isinstance(option.type, click.Choice)
            assert tuple(option.type.choices) == typing.get_args(hints[f.name])
        checked += 1
    assert checked >= 12


def test_train_cli_builds_the_config_a_caller_builds(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _capture(monkeypatch, "dflash_offline.train.launch", "run_training")
    cache, out = tmp_path / "c", tmp_path / "run"
    base = ["train", "--cache", str(cache), "--out", str(out)]
    assert _invoked_with(base) == TrainConfig.from_options(cache_dir=cache, out_dir=out)
    got = _invoked_with(
        [
            *base,
            *("--lr", "0.1", "--no-tensorboard", "--workers", "2", "--gamma", "5", "--threads", "3"),
            *("--feature-scale", "dim", "--deterministic", "--no-progress", "--num-anchors", "64"),
        ]
    )
    assert got == TrainConfig.from_options(
        cache_dir=cache,
        out_dir=out,
        lr=0.1,
        tensorboard=False,
        num_cpu_workers=2,
        threads_per_worker=3,
        gamma=5.0,
        feature_scale="dim",
        deterministic=True,
        progress=False,
        num_anchors=64,
    )


def test_train_compile_takes_auto_on_or_off_and_refuses_anything_else(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``--compile`` takes a value now (it was a flag): the value reaches the config; another value, or
    the old bare flag, is click's one-line refusal naming the choices, before any run."""
    _capture(monkeypatch, "dflash_offline.train.launch", "run_training")
    base = ["train", "--cache", str(tmp_path / "c"), "--out", str(tmp_path / "run")]
    for value in ("auto", "on", "off"):
        assert _invoked_with([*base, "--compile", value]).launch.compile == value
    invalid = "Error: Invalid value for '--compile': {!r} is not one of 'auto', 'on', 'off'."
    for args, error in [
        (["--compile", "yes"], invalid.format("yes")),
        (["--compile", "--lr", "0.1"], invalid.format("--lr")),
        (["--compile"], "Error: Option '--compile' requires an argument."),
    ]:
        result = CliRunner().invoke(main, [*base, *args])
        assert result.exit_code == 2, result.output
        assert not isinstance(result.exception, _Captured)
        assert [line for line in result.output.splitlines() if line.startswith("Error:")] == [error]


def test_train_help_reads_the_drafter_defaults_without_importing_torch() -> None:
    """The drafter's shape defaults have one home (``drafter_shape.py``) that ``dflash train --help``
    reads without the drafter package, which imports torch."""
    code = (
        "import sys; from click.testing import CliRunner; from dflash_offline.cli import main; "
        "out = CliRunner().invoke(main, ['train', '--help']).output; "
        "print('torch' in sys.modules, '--block-size' in out)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["False", "True"], done.stdout + done.stderr
    from dflash_offline.drafter import DrafterConfig

    drafter = {f.name: f.default for f in dataclasses.fields(DrafterConfig)}
    train = {o.name: o.field.default for o in option_fields(TrainConfig)}
    shape = ("num_layers", "block_size")
    assert [drafter[k] for k in shape] == [train[k] for k in shape]
    # --num-anchors is resolved by device when the config is built (tests/train/test_layout_defaults.py).
    assert train["num_anchors"] == 0


def test_help_sql_and_status_run_without_importing_torch(tiny_cache: Path) -> None:
    """``dflash --help`` (which lists every command), ``dflash sql`` and ``dflash status`` read the cache's
    rows without torch (≈ 1 s of an interpreter's start-up): it is imported where a tensor is handled."""
    code = (
        "import sys; from click.testing import CliRunner; from dflash_offline.cli import main; "
        "outs = [CliRunner().invoke(main, args) for args in "
        f"(['--help'], ['sql', {str(tiny_cache)!r}, '--query', 'buckets', '--format', 'json'], "
        f"['status', {str(tiny_cache)!r}])]; "
        "print('torch' in sys.modules, *(o.exit_code for o in outs)); "
        "print(*(o.output for o in outs), sep='\\n')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    first, _, output = done.stdout.partition("\n")
    assert first.split() == ["False", "0", "0", "0"], done.stdout + done.stderr
    assert "Commands:" in output  # the help
    assert '"bucket_id"' in output  # the SQL answer
    assert f"cache      {tiny_cache}" in output  # the status report


def test_train_placement_defaults_are_the_placement_record_defaults() -> None:
    fields = {o.name: o.field.default for o in option_fields(TrainConfig)}
    default = Placement()
    assert (fields["gpus"], fields["num_cpu_workers"], fields["threads_per_worker"]) == (
        default.gpus,
        default.num_cpu_workers,
        default.threads_per_worker,
    )


def test_eval_dtypes_are_the_runtime_dtypes() -> None:
    from dflash_offline.target_model.loader import DTYPES

    assert set(EVAL_DTYPES) == set(DTYPES)


def test_generate_cli_builds_the_config_a_caller_builds(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _capture(monkeypatch, "dflash_offline.generate.launch", "generate_from_config")
    cache = tmp_path / "c"
    assert _invoked_with(["generate", "--cache", str(cache)]) == GenerateConfig(cache_dir=cache)
    got = _invoked_with(
        [
            *("generate", str(cache), "--layer-ids", "1,3", "--bucket-edges", "128,256", "--workers", "2"),
            *("--data", "x.jsonl", "--max-len", "64", "--window", "5", "--no-fsync", "--dtype", "bfloat16"),
        ]
    )
    assert got == GenerateConfig(
        cache_dir=cache,
        layer_ids=(1, 3),
        bucket_edges=(128, 256),
        placement=Placement(num_cpu_workers=2),
        data=Path("x.jsonl"),
        max_length=64,
        window_records=5,
        dtype="bfloat16",
    )


def test_regenerate_and_eval_cli_build_the_config_a_caller_builds(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _capture(monkeypatch, "dflash_offline.regenerate.run", "run_regenerate")
    out = tmp_path / "a.jsonl"
    assert _invoked_with(["regenerate", "--out", str(out)]) == RegenerateConfig(out=out)
    got = _invoked_with(
        ["regenerate", "--out", str(out), "--temperature", "0.5", "--engine", "slots", "--prefill-wait", "8"]
    )
    assert got == RegenerateConfig(out=out, temperature=0.5, engine="slots", prefill_wait=8)
    # --prefill-wait: 8 steps on a GPU and 0 on the CPU unless given; an explicit 0 holds on a GPU too.
    default = RegenerateConfig(out=out)
    assert (default.prefill_wait_for("cuda"), default.prefill_wait_for("cpu")) == (8, 0)
    zero = _invoked_with(["regenerate", "--out", str(out), "--prefill-wait", "0"])
    assert (zero.prefill_wait_for("cuda"), zero.prefill_wait_for("cpu")) == (0, 0)
    # --prefill-graphs and --decode-attention: on and live for a GPU in half precision unless given.
    assert (default.prefill_graphs_for("cuda"), default.prefill_graphs_for("cpu")) == (True, False)
    assert [default.live_attention_for(fused_kernels=f) for f in (True, False)] == [True, False]
    cases = [("cuda", torch.bfloat16), ("cuda", torch.float16), ("cuda", torch.float32)]
    cases.append(("cpu", torch.bfloat16))
    assert [fused_kernels_run(torch.device(d), t) for d, t in cases] == [True, True, False, False]
    given = _invoked_with(
        ["regenerate", "--out", str(out), "--prefill-graphs", "off", "--decode-attention", "padded"]
    )
    assert not given.prefill_graphs_for("cuda")
    assert not given.live_attention_for(fused_kernels=True)

    _capture(monkeypatch, "dflash_offline.eval.run", "run_eval")
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    assert _invoked_with(["eval", "--drafter", str(drafter)]) == EvalConfig(drafter_dir=drafter)
    got = _invoked_with(["eval", "--drafter", str(drafter), "--bench", "all", "--no-warmup", "--no-progress"])
    assert got == EvalConfig(
        drafter_dir=drafter, bench=("mt-bench", "humaneval", "sharegpt"), warmup=False, progress=False
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--layer-ids", "3,1"], "--layer-ids '3,1': ids must be ascending"),
        (["--layer-ids", "1,2,2"], "--layer-ids '1,2,2': [2] repeat"),
        (["--layer-ids", "1,x"], "are not all integers"),
        (["--layer-ids", "1,2", "--num-features", "2"], "--num-features 2 and --layer-ids 1,2 both given"),
    ],
)
def test_layer_ids_are_refused_at_the_command_line_in_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, flags: list[str], message: str
) -> None:
    _capture(monkeypatch, "dflash_offline.generate.launch", "generate_from_config")
    result = CliRunner().invoke(main, ["generate", "--cache", str(tmp_path / "c"), *flags])
    assert result.exit_code == 1, result.output
    assert not isinstance(result.exception, _Captured)  # refused before any run
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert message in lines[0], result.output


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--bench", "humaneval", "--skip", "20"], "--skip 20 is only read by the sharegpt set"),
        (
            ["--bench", "mt-bench,validation", "--data", "x.jsonl"],
            "--data x.jsonl is only read by the sharegpt set",
        ),
    ],
)
def test_eval_options_no_chosen_set_reads_are_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, flags: list[str], message: str
) -> None:
    """`--skip` and `--data` choose the sharegpt set's records: without that set they would be ignored."""
    _capture(monkeypatch, "dflash_offline.eval.run", "run_eval")
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    result = CliRunner().invoke(main, ["eval", "--drafter", str(drafter), *flags])
    assert result.exit_code == 1, result.output
    assert not isinstance(result.exception, _Captured)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert message in lines[0], result.output
    with_sharegpt = [
        f.replace("humaneval", "humaneval,sharegpt").replace("validation", "sharegpt") for f in flags
    ]
    assert isinstance(
        CliRunner().invoke(main, ["eval", "--drafter", str(drafter), *with_sharegpt]).exception, _Captured
    )


@pytest.mark.parametrize("engine", ["cb", "static"])
def test_the_removed_regenerate_engines_are_click_s_invalid_choice(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, engine: str
) -> None:
    """transformers' continuous batching and static generate batches are no regenerate engines any more
    (the decode engine is faster): naming one is click's usual one-line refusal, before any run."""
    _capture(monkeypatch, "dflash_offline.regenerate.run", "run_regenerate")
    result = CliRunner().invoke(main, ["regenerate", "--out", str(tmp_path / "o.jsonl"), "--engine", engine])
    assert result.exit_code == 2, result.output
    assert not isinstance(result.exception, _Captured)
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert errors == [
        f"Error: Invalid value for '--engine': '{engine}' is not one of 'auto', 'slots', 'openai'."
    ]


@pytest.mark.parametrize(
    ("command", "module", "function"),
    [
        ("generate", "dflash_offline.generate.launch", "generate_from_config"),
        ("regenerate", "dflash_offline.regenerate.run", "run_regenerate"),
        ("train", "dflash_offline.train.launch", "run_training"),
    ],
)
def test_a_negative_thread_count_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, command: str, module: str, function: str
) -> None:
    _capture(monkeypatch, module, function)
    where = ["--cache", str(tmp_path / "c")] if command != "regenerate" else []
    out = ["--out", str(tmp_path / ("run" if command == "train" else "out.jsonl"))] * (command != "generate")
    result = CliRunner().invoke(main, [command, *where, *out, "--threads", "-3"])
    assert result.exit_code == 1, result.output
    assert not isinstance(result.exception, _Captured)  # refused before any run
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert lines[0].startswith("Error: "), result.output
    assert "--threads -3: expected" in lines[0], result.output


@pytest.mark.parametrize(
    ("command", "module", "function"),
    [
        ("status", "dflash_offline.cache.status", "cache_status"),
        ("verify", "dflash_offline.cache.verify", "verify_cache"),
        ("index", "dflash_offline.cache.index", "build_index"),
    ],
)
def test_cache_is_accepted_positionally_or_as_an_option(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, command: str, module: str, function: str
) -> None:
    _capture(monkeypatch, module, function)
    cache = tmp_path / "c"
    for args in ([str(cache)], ["--cache", str(cache)], [str(cache), "--cache", str(cache)]):
        assert Path(_invoked_with([command, *args])) == cache, args
    result = CliRunner().invoke(main, [command, str(cache), "--cache", str(tmp_path / "other")])
    assert result.exit_code == 2, result.output
    assert "name different caches" in result.output
    result = CliRunner().invoke(main, [command])
    assert result.exit_code == 2, result.output
    assert "give the cache directory" in result.output


def test_sql_takes_the_statement_after_a_cache_option(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _capture(monkeypatch, "dflash_offline.cache.sql", "stream_query")
    cache = tmp_path / "c"
    statement = "SELECT 'a//b/'"  # as typed (a Path would normalise it)
    for args in ([str(cache), statement], ["--cache", str(cache), statement]):
        config = _invoked_with(["sql", *args])
        assert (config.root, config.sql) == (cache, statement), args
    config = _invoked_with(["sql", "--cache", str(cache), "-q", "progress"])
    assert (config.root, config.sql, config.query_name) == (cache, None, "progress")


def test_train_and_generate_take_a_positional_cache_too(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _capture(monkeypatch, "dflash_offline.train.launch", "run_training")
    cache, out = tmp_path / "c", tmp_path / "run"
    assert _invoked_with(["train", str(cache), "--out", str(out)]).cache_dir == cache
    result = CliRunner().invoke(main, ["train", "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert "give the cache directory" in result.output


def test_a_bad_layer_list_is_one_line_from_a_real_process(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash_offline",
            "generate",
            "--cache",
            str(tmp_path / "c"),
            "--layer-ids",
            "5,2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "Error: --layer-ids '5,2': ids must be ascending (features are stored in ascending layer order), "
        "e.g. 2,5"
    ]
    assert not (tmp_path / "c").exists()
