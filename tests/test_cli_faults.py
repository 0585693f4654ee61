"""Every command, on paths it cannot use and files damaged under it: one `Error:` line naming the path,
exit code 1, and no traceback anywhere in the output.

Outputs on a read-only file system (a read-only tmpfs when this runs as root, which ignores mode bits; a
mode-0555 folder otherwise), outputs under ``/proc`` or under a file, manifest parts with damaged pages,
a truncated ``index.duckdb``, a query that fails only when its rows are fetched, a cache.json whose
hidden size or field names were edited. Everything runs in-process (``CliRunner``): a traceback from the
main thread would surface as ``result.exception``, one from a worker thread in the captured output.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from dflash_offline.cli import main
from dflash_offline.regenerate.config import RegenerateConfig
from dflash_offline.train.launch import run_training
from tests.eval.helpers import export_untrained_for, write_chat_jsonl
from tests.regenerate.openai_server_process import Server, ready, start_server
from tests.train.helpers import train_config

TRAIN_ARGS = ["--num-layers", "1", "--block-size", "8", "--num-anchors", "32", "--tokens-per-microbatch",
              "600", "--max-steps", "2", "--threads", "1", "--no-progress"]  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class Scene:
    """What the cases run against (module-wide; a case that damages something copies it first)."""

    root: Path
    """A scratch folder of the module."""
    cache: Path
    """A generated cache (shared: never written to)."""
    data: Path
    """The chat data it was generated from."""
    run: Path
    """A training run with a checkpoint."""
    drafter: Path
    """An exported (untrained) drafter for random:tiny."""
    read_only: Path | None
    """A folder nothing can be written into, or None where none could be made."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Fault:
    args: list[str]
    path: str
    """What the one error line must name."""
    cwd: Path | None = None
    """Run from this folder (a relative path in the arguments)."""


@pytest.fixture(scope="module")
def read_only(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path | None]:
    folder = tmp_path_factory.mktemp("read-only")
    if os.geteuid() != 0:
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
        return
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        yield None  # the cases that need it skip
        return
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


@pytest.fixture(scope="module")
def scene(
    uncompressed_cache: Path, tmp_path_factory: pytest.TempPathFactory, read_only: Path | None
) -> Scene:
    root = tmp_path_factory.mktemp("faults")
    run = root / "run"
    run_training(train_config(uncompressed_cache, run, max_steps=1, checkpoint_every=1, export_at_end=False))
    drafter = export_untrained_for("random:tiny", root / "drafter", block_size=4, layer_ids=(0, 2))
    return Scene(
        root=root,
        cache=uncompressed_cache,
        data=uncompressed_cache.parent / "chat.jsonl",
        run=run,
        drafter=drafter,
        read_only=read_only,
    )


def _copy(scene: Scene, name: str) -> Path:
    return shutil.copytree(scene.cache, scene.root / name)


def _read_only(scene: Scene) -> Path:
    if scene.read_only is None:
        pytest.skip("no read-only folder: mounting a read-only tmpfs failed")
    return scene.read_only


def _generate(scene: Scene, cache: str) -> Fault:
    args = ["generate", "--cache", cache, "--target", "random:tiny", "--data", str(scene.data),
            "--layer-ids", "0,2", "--max-len", "256", "--no-progress", "--threads", "1"]  # fmt: skip
    return Fault(args=args, path=cache)


def _generate_read_only(scene: Scene) -> Fault:
    return _generate(scene, str(_read_only(scene) / "cache"))


def _generate_under_a_file(scene: Scene) -> Fault:
    (scene.root / "a-file").write_text("not a folder")
    return _generate(scene, str(scene.root / "a-file" / "cache"))


def _train_read_only(scene: Scene) -> Fault:
    out = str(_read_only(scene) / "run")
    return Fault(args=["train", "--cache", str(scene.cache), "--out", out, *TRAIN_ARGS], path=out)


def _regenerate_read_only(scene: Scene) -> Fault:
    out = str(_read_only(scene) / "answers.jsonl")
    args = ["regenerate", "--target", "random:tiny", "--data", str(scene.data), "--limit", "2",
            "--max-new-tokens", "4", "--no-progress", "--out", out]  # fmt: skip
    return Fault(args=args, path=out)


def _export_read_only(scene: Scene) -> Fault:
    out = str(_read_only(scene) / "drafter")
    return Fault(args=["export", str(scene.run), "--out", out], path=out)


def _eval_read_only(scene: Scene) -> Fault:
    report = str(_read_only(scene) / "report.json")
    args = ["eval", "--target", "random:tiny", "--drafter", str(scene.drafter), "--data", str(scene.data),
            "--limit", "1", "--max-new-tokens", "4", "--json", report, "--no-progress"]  # fmt: skip
    return Fault(args=args, path=report)


def _damaged_manifest_part(scene: Scene, name: str) -> tuple[Path, Path]:
    """A cache copy whose first samples part has a damaged data page (its footer, hence its schema,
    intact: only reading the rows fails)."""
    cache = _copy(scene, name)
    part = sorted((cache / "manifest" / "samples").glob("*.parquet"))[0]
    row_group = pq.ParquetFile(part).metadata.row_group(0)
    chunk = max(
        (row_group.column(i) for i in range(row_group.num_columns)), key=lambda c: c.total_compressed_size
    )
    start = chunk.data_page_offset + 64  # past the page header: its compressed values
    assert chunk.total_compressed_size > 96
    data = bytearray(part.read_bytes())
    for i in range(start, chunk.data_page_offset + chunk.total_compressed_size - 8):
        data[i] ^= 0x5A
    part.write_bytes(bytes(data))
    pq.read_metadata(part)  # the footer still reads
    return cache, part


def _status_damaged_part(scene: Scene) -> Fault:
    cache, part = _damaged_manifest_part(scene, "status-part")
    return Fault(args=["status", str(cache)], path=str(part))


def _sql_damaged_part(scene: Scene) -> Fault:
    cache, part = _damaged_manifest_part(scene, "sql-part")
    return Fault(args=["sql", str(cache), "SELECT count(*) FROM samples"], path=str(part))


def _sql_truncated_index(scene: Scene) -> Fault:
    cache = _copy(scene, "truncated-index")
    index = cache / "index.duckdb"
    index.write_bytes(index.read_bytes()[:20000])
    return Fault(
        args=["sql", str(cache), "SELECT count(*) FROM samples", "--source", "index"], path=str(index)
    )


def _sql_fails_while_fetching(scene: Scene) -> Fault:
    # read_text of the cache's own files is allowed; index.duckdb is not UTF-8, which DuckDB finds
    # only when the rows are fetched.
    where = scene.root / "fetch"
    where.mkdir()
    shutil.copytree(scene.cache, where / "c1")
    return Fault(args=["sql", "c1", "SELECT * FROM read_text('c1/*')"], path="c1/index.duckdb", cwd=where)


def _edit_fingerprint(scene: Scene, name: str, edit: Callable[[dict], None]) -> Path:
    cache = _copy(scene, name)
    doc = json.loads((cache / "cache.json").read_text())
    edit(doc["fingerprint"])
    (cache / "cache.json").write_text(json.dumps(doc))
    return cache


def _train_edited_hidden_size(scene: Scene) -> Fault:
    cache = _edit_fingerprint(scene, "hidden-size", lambda fp: fp.update(hidden_size=fp["hidden_size"] + 32))
    args = ["train", "--cache", str(cache), "--out", str(scene.root / "hidden-size-run"), *TRAIN_ARGS]
    return Fault(args=args, path=str(cache))


def _mistype_hidden_size(fp: dict) -> None:
    fp["hiden_size"] = fp.pop("hidden_size")


def _status_mistyped_field(scene: Scene) -> Fault:
    cache = _edit_fingerprint(scene, "mistyped-status", _mistype_hidden_size)
    return Fault(args=["status", str(cache)], path=str(cache / "cache.json"))


def _verify_mistyped_field(scene: Scene) -> Fault:
    cache = _edit_fingerprint(scene, "mistyped-verify", _mistype_hidden_size)
    return Fault(args=["verify", str(cache), "--no-progress"], path=str(cache / "cache.json"))


FAULTS: dict[str, Callable[[Scene], Fault]] = {
    "generate, cache on a read-only file system": _generate_read_only,
    "train, out on a read-only file system": _train_read_only,
    "regenerate, out on a read-only file system": _regenerate_read_only,
    "export, out on a read-only file system": _export_read_only,
    "eval, json on a read-only file system": _eval_read_only,
    "generate, cache under /proc": lambda scene: _generate(scene, "/proc/dflash-cache"),
    "generate, cache under a file": _generate_under_a_file,
    "status, manifest part with damaged pages": _status_damaged_part,
    "sql, manifest part with damaged pages": _sql_damaged_part,
    "sql, truncated index.duckdb": _sql_truncated_index,
    "sql, a query failing while its rows are fetched": _sql_fails_while_fetching,
    "train, hidden size edited in cache.json": _train_edited_hidden_size,
    "status, mistyped fingerprint field": _status_mistyped_field,
    "verify, mistyped fingerprint field": _verify_mistyped_field,
}


@pytest.mark.parametrize("name", list(FAULTS))
def test_one_error_line_naming_the_path_and_no_traceback(
    name: str, scene: Scene, monkeypatch: pytest.MonkeyPatch
) -> None:
    fault = FAULTS[name](scene)
    if fault.cwd is not None:
        monkeypatch.chdir(fault.cwd)
    result = CliRunner().invoke(main, fault.args)
    output = result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        f"{type(result.exception).__name__}: {result.exception}"
    )
    assert result.exit_code == 1, output
    assert "Traceback" not in output, output
    errors = [line for line in output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, output
    assert fault.path in errors[0], output
    if name.startswith("eval"):
        assert "tau" not in output  # refused before the evaluation, not after it


# --- dflash regenerate --engine openai: a server's bad values, bad URLs, failed runs (issue 44, item 5) ---


@pytest.fixture(scope="module")
def openai_servers() -> Iterator[tuple[Server, Server]]:
    """A fake OpenAI-compatible server (tests/regenerate/openai_server.py) and one the cases kill."""
    processes = [start_server(), start_server()]
    try:
        healthy, victim = (ready(p) for p in processes)
        yield healthy, victim
    finally:
        for p in processes:
            p.kill()
            p.wait(timeout=30)


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_chat_jsonl(tmp_path_factory.mktemp("served") / "chat.jsonl", 4, turns=1, seed=5)


def _regenerate(url: str, chat: Path, out: Path, *extra: str) -> list[str]:
    return ["regenerate", "--engine", "openai", "--base-url", url, "--target", "random:tiny", "--data",
            str(chat), "--out", str(out), "--no-progress", "--max-new-tokens", "16", "--max-retries", "0",
            "--request-timeout", "20", *extra]  # fmt: skip


def _one_error_line(result: Any) -> str:
    """The one ``Error:`` line of a command that exited 1 without a traceback."""
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.output
    return errors[0]


MALFORMED_URLS = ["http://", "http://127.0.0.1:99999", "http://[::1", "http://127.0.0.1:0", "http://::1",
                  "http://127.0.0.1:port", "ftp://127.0.0.1:8000", "http://127.0.0.1 :8000", "http://a..b:8000",
                  "http://user:secret@127.0.0.1:8000", "http://127.0.0.1:8000/?model=x"]  # fmt: skip


@pytest.mark.parametrize("url", MALFORMED_URLS)
def test_a_malformed_base_url_is_one_line_before_anything_runs(url: str, chat: Path, tmp_path: Path) -> None:
    out = tmp_path / "new" / "answers.jsonl"
    error = _one_error_line(CliRunner().invoke(main, _regenerate(url, chat, out)))
    assert f"--base-url {url!r}" in error
    assert not out.parent.exists()


BAD_VALUES: dict[str, tuple[dict[str, Any], str]] = {
    "token ids below 0": ({"choice_override": {"token_ids": [-5, 12]}}, "choices[0].token_ids[0] is -5"),
    "a token id past the vocabulary": ({"choice_override": {"token_ids": [3, 10**12]}}, "token_ids[1] is 10"),
    "more ids than max_tokens": (
        {"choice_override": {"token_ids": [5] * 40}},
        "has 40 ids, more than the request's max_tokens 16",
    ),
    "ids that are not integers": ({"choice_override": {"token_ids": [1, "2"]}}, "token_ids[1] is '2'"),
    "token ids that are not a list": ({"choice_override": {"token_ids": "1 2"}}, "token_ids is '1 2'"),
    "a count that is not an integer": ({"usage_override": {"completion_tokens": True}}, "completion_tokens"),
    "a count past max_tokens": ({"usage_override": {"completion_tokens": 99}}, "completion_tokens is 99"),
    "text that is not a string": ({"choice_override": {"text": None}}, "choices[0].text is None"),
}


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_a_bad_value_from_the_server_is_a_failure_row_naming_the_field_and_a_run_of_failures_exits_1(
    case: str, chat: Path, tmp_path: Path, openai_servers: tuple[Server, Server]
) -> None:
    """Nothing the server returns is written unchecked: each bad value fails its conversation, naming the
    field; a run whose every conversation failed exits 1; ``--retry-failed`` answers them again."""
    server = openai_servers[0]
    plan, named = BAD_VALUES[case]
    out = tmp_path / "answers.jsonl"
    server.faults(**plan)
    try:
        error = _one_error_line(CliRunner().invoke(main, _regenerate(server.url, chat, out)))
    finally:
        server.faults()
    assert "every one of the 4 records this run tried failed" in error
    assert "--retry-failed" in error
    rows = [json.loads(line) for line in (tmp_path / "answers.failures.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    assert all(named in row["detail"] for row in rows), [row["detail"] for row in rows]
    assert not out.exists() or not out.read_text().strip()
    skipped = CliRunner().invoke(main, _regenerate(server.url, chat, out))  # the failures are done...
    assert skipped.exit_code == 0, skipped.output
    assert "0 conversations written" in skipped.output
    assert "4 already done" in skipped.output
    retried = CliRunner().invoke(main, _regenerate(server.url, chat, out, "--retry-failed"))
    assert retried.exit_code == 0, retried.output
    assert len(out.read_text().splitlines()) == 4
    assert not (tmp_path / "answers.failures.jsonl").exists()


def test_a_server_dying_under_two_workers_is_one_line(
    chat: Path, tmp_path: Path, openai_servers: tuple[Server, Server]
) -> None:
    victim = openai_servers[1]
    victim.faults(die_after=5)  # the probes (this process's, then each worker's) are the first three
    out = tmp_path / "answers.jsonl"
    result = CliRunner().invoke(main, _regenerate(victim.url, chat, out, "--workers", "2", "--threads", "1"))
    error = _one_error_line(result)
    assert victim.url.removeprefix("http://") in error, error
    assert victim.process.wait(timeout=30) != 0


def test_the_failures_file_is_named_as_the_help_names_it(chat: Path, tmp_path: Path) -> None:
    """Every file name ``dflash regenerate --help`` gives for ``--out`` (``NAME…`` for ``--out NAME.jsonl``,
    or ``<out>…``) is one the command writes: here the failures file, every prompt being too long."""
    help_text = " ".join(CliRunner().invoke(main, ["regenerate", "--help"]).output.split())
    named = {
        n.replace("NAME", "answers").replace("<out>", "answers.jsonl").rstrip(".,;:)")
        for n in re.findall(r"(?:NAME|<out>)[\w./<>-]*", help_text)
    }
    out = tmp_path / "answers.jsonl"
    args = ["regenerate", "--target", "random:tiny", "--data", str(chat), "--out", str(out), "--no-progress",
            "--max-prompt-tokens", "1", "--threads", "1"]  # fmt: skip
    error = _one_error_line(CliRunner().invoke(main, args))  # every prompt is too long: every record fails
    assert "every one of the 4 records" in error
    failures = [p.name for p in tmp_path.iterdir() if "failures" in p.name]
    assert failures == ["answers.failures.jsonl"]
    assert failures[0] in named, sorted(named)
    assert RegenerateConfig(out=out).partial_path.name in named, sorted(named)
