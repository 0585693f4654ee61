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
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from dflash_offline.cache.index import build_index
from dflash_offline.cli import main
from dflash_offline.regenerate.config import RegenerateConfig
from dflash_offline.train.launch import run_training
from tests.eval.helpers import export_untrained_for, write_chat_jsonl
from tests.process_helpers import reaped
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


# ---------------------------------------------------------------------------------------------------
# The index is not trusted, `dflash sql` stops at Ctrl-C and streams, strict JSON, statement names,
# verify's temp files. These cases run on copies of the golden cache (tests/assets/golden_cache/v2).
# ---------------------------------------------------------------------------------------------------

GOLDEN_V2 = Path(__file__).resolve().parent / "assets" / "golden_cache" / "v2"
DFLASH = [sys.executable, "-m", "dflash_offline"]
ENDLESS = "SELECT count(*) FROM range(9000000000000000000) a WHERE hash(a.range) % 7 = 3"
"""A query no test timeout lets finish (9e18 rows; DuckDB counts about 1e8 a second per core)."""


def _golden_copy(tmp_path: Path, *, index: bool) -> Path:
    cache = shutil.copytree(GOLDEN_V2, tmp_path / "cache")
    if index:
        build_index(cache)
    return cache


def _golden_samples() -> int:
    return sum(pq.read_metadata(p).num_rows for p in (GOLDEN_V2 / "manifest" / "samples").glob("*.parquet"))


def _outside_parts_view(cache: Path, con: duckdb.DuckDBPyConnection) -> None:
    """``parts`` replaced by a view of a CSV outside the cache holding the true rows: evaluated, it
    would make the index read as current (and its reader read a file it must not)."""
    rows = con.execute("SELECT manifest_table, file, mtime_ns FROM parts").fetchall()
    outside = cache.parent / "outside" / "parts.csv"
    outside.parent.mkdir()
    outside.write_text("manifest_table,file,mtime_ns\n" + "".join(f"{t},{f},{m}\n" for t, f, m in rows))
    con.execute("DROP TABLE parts")
    con.execute(f"CREATE VIEW parts AS SELECT * FROM read_csv('{outside}', header = true)")


TAMPERINGS: dict[str, tuple[Callable[[Path, duckdb.DuckDBPyConnection], None], str]] = {
    "a view where the parts table is": (_outside_parts_view, "a view parts where the schema has a table"),
    "a macro": (lambda c, con: con.execute("CREATE MACRO shadow(x) AS x + 1"), "a macro shadow not in"),
    "an extra table": (lambda c, con: con.execute("CREATE TABLE extra (a INTEGER)"), "a table extra not in"),
    "a changed column": (
        lambda c, con: con.execute("ALTER TABLE samples ALTER COLUMN worker TYPE BIGINT"),
        "a column samples.worker changed",
    ),
    "a view in another schema": (
        lambda c, con: (con.execute("CREATE SCHEMA s2"), con.execute("CREATE VIEW s2.v AS SELECT 1")),
        "a schema s2 not in the schema",
    ),
    "a dropped view": (lambda c, con: con.execute("DROP VIEW progress"), "a view progress missing"),
}


@pytest.mark.parametrize("name", list(TAMPERINGS))
def test_an_index_unlike_the_schema_is_never_queried(name: str, tmp_path: Path) -> None:
    tamper, phrase = TAMPERINGS[name]
    cache = _golden_copy(tmp_path, index=True)
    con = duckdb.connect(str(cache / "index.duckdb"))
    tamper(cache, con)
    con.close()
    status = CliRunner().invoke(main, ["status", str(cache)])
    assert status.exit_code == 0, status.output
    (line,) = [line for line in status.output.splitlines() if line.startswith("index ")]
    assert line.split()[1] == "unreadable:", line
    assert phrase in line, line
    assert f"rebuild it with `dflash index {cache}`" in line
    auto = CliRunner().invoke(main, ["sql", str(cache), "SELECT count(*) FROM samples", "--format", "csv"])
    assert (auto.exit_code, auto.output) == (0, f"count_star()\n{_golden_samples()}\n")
    table = CliRunner().invoke(main, ["sql", str(cache), "SELECT count(*) FROM samples"])
    assert table.output.splitlines()[-1] == "(1 row, from the manifest)"
    refused = CliRunner().invoke(main, ["sql", str(cache), "SELECT 1", "--source", "index"])
    assert refused.exit_code == 1
    assert "Traceback" not in refused.output
    (error,) = refused.output.splitlines()
    assert error.startswith(f"Error: {cache / 'index.duckdb'}: "), error
    assert phrase in error, error


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
def test_status_does_not_touch_a_file_an_index_view_reads(tmp_path: Path) -> None:
    cache = _golden_copy(tmp_path, index=True)
    con = duckdb.connect(str(cache / "index.duckdb"))
    _outside_parts_view(cache, con)
    con.close()
    trace = tmp_path / "trace"
    done = subprocess.run(
        ["strace", "-f", "-e", "trace=%file", "-o", str(trace), *DFLASH, "status", str(cache)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode != 0 and "ptrace" in done.stderr:
        pytest.skip(f"strace cannot trace here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    assert "unreadable" in done.stdout
    assert "parts.csv" not in trace.read_text()
    assert str(cache / "index.duckdb") in trace.read_text()  # the trace does see the index opened


def test_status_tells_an_unreadable_index_from_a_stale_one(tmp_path: Path) -> None:
    cache = _golden_copy(tmp_path, index=True)

    def index_line() -> str:
        out = CliRunner().invoke(main, ["status", str(cache)]).output
        return next(line for line in out.splitlines() if line.startswith("index "))

    assert index_line().split()[1] == "current"
    part = sorted((cache / "manifest" / "samples").glob("*.parquet"))[0]
    os.utime(part, ns=(part.stat().st_atime_ns, part.stat().st_mtime_ns + 10**9))
    assert index_line().split()[1] == "stale"
    index = cache / "index.duckdb"
    index.write_bytes(index.read_bytes()[:5000])
    assert index_line().split()[1:4] == ["unreadable:", "it", "cannot"]


def _holds_open(pid: int, path: Path) -> bool:
    """Whether process ``pid`` has ``path`` open (read from /proc)."""
    fds = Path(f"/proc/{pid}/fd")
    try:
        return any(os.readlink(fd) == str(path) for fd in fds.iterdir())
    except FileNotFoundError:  # a descriptor closed while listed
        return False


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="reads /proc")
@pytest.mark.parametrize("sigint", ["inherited", "ignored by the parent"])
def test_sigint_stops_a_long_query_with_one_line_and_130(sigint: str, tmp_path: Path) -> None:
    cache = _golden_copy(tmp_path, index=True)
    ignore = sigint != "inherited"  # a script's `cmd &` starts it with SIGINT ignored
    process = subprocess.Popen(
        [*DFLASH, "sql", str(cache), ENDLESS, "--source", "index"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore else None,
    )
    try:
        # The index open: the command runs, its query starts now (and never ends by itself).
        while not _holds_open(process.pid, (cache / "index.duckdb").resolve()):
            assert process.poll() is None, process.communicate()
            time.sleep(0.1)
        time.sleep(0.5)
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=120)  # the query itself cannot end within any timeout
    finally:
        process.kill()
    assert process.returncode == 130, err
    assert (out, err) == ("", "interrupted: the query was stopped\n")


_MEASURE = (
    "import resource, subprocess, sys\n"
    "with open(sys.argv[1], 'w') as out:\n"
    "    code = subprocess.call(sys.argv[2:], stdout=out)\n"
    "print(code, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
)
"""Runs a command from a small fresh process: Linux counts the RSS a child had at fork (a copy of its
parent: here the test process, hundreds of MiB) in its peak, so the command must be forked from a small
one."""


def _max_rss_mib(command: list[str], out: Path) -> int:
    done = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(out), *command], capture_output=True, text=True, timeout=300
    )
    code, max_rss_kib = done.stdout.split()
    assert code == "0", done.stderr
    return int(max_rss_kib) // 1024


@pytest.mark.slow
@pytest.mark.parametrize("output_format", ["csv", "jsonl"])
def test_a_million_rows_stream_in_bounded_memory(output_format: str, tmp_path: Path) -> None:
    cache = _golden_copy(tmp_path, index=False)
    query = "SELECT range AS n, range * 2 AS twice, 'row ' || range AS label FROM range(1000000)"
    out = tmp_path / "out"
    baseline = _max_rss_mib([*DFLASH, "sql", str(cache), "SELECT 1", "--format", output_format], out)
    streamed = _max_rss_mib([*DFLASH, "sql", str(cache), query, "--format", output_format], out)
    lines = out.read_text().splitlines()
    if output_format == "csv":
        assert (len(lines), lines[1], lines[-1]) == (1_000_001, "0,0,row 0", "999999,1999998,row 999999")
    else:
        assert len(lines) == 1_000_000
        assert json.loads(lines[-1]) == {"n": 999999, "twice": 1999998, "label": "row 999999"}
    materialise = (
        "from pathlib import Path; from dflash_offline.cache.sql import SqlConfig, run_sql; "
        f"print(len(run_sql(SqlConfig(root=Path({str(cache)!r}), sql={query!r}, query_name=None)).rows))"
    )
    materialised = _max_rss_mib([sys.executable, "-c", materialise], out)
    assert out.read_text() == "1000000\n"
    # What holding the rows costs, against what streaming them costs above the same start-up.
    assert streamed - baseline < (materialised - baseline) / 4, (baseline, streamed, materialised)


def test_table_format_shows_the_first_rows_and_counts_the_rest(tmp_path: Path) -> None:
    cache = _golden_copy(tmp_path, index=False)
    result = CliRunner().invoke(main, ["sql", str(cache), "SELECT range AS n FROM range(2500)"])
    lines = result.output.splitlines()
    assert result.exit_code == 0
    assert [line.strip() for line in lines[2:4]] == ["0", "1"]
    assert lines[-2].strip() == "999"
    assert lines[-1] == (
        "(2,500 rows, from the manifest; the first 1,000 shown, 1,500 more rows: "
        "--format csv, json or jsonl writes every row)"
    )


def _strict(text: str) -> object:
    def refuse(constant: str) -> object:
        raise AssertionError(f"not strict JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_json_and_jsonl_write_null_for_non_finite_values(tmp_path: Path) -> None:
    cache = _golden_copy(tmp_path, index=False)
    query = "SELECT 'nan'::DOUBLE AS a, '-inf'::DOUBLE AS b, 1.5 AS c UNION ALL SELECT 'inf'::DOUBLE, 2, 3"
    as_json = CliRunner().invoke(main, ["sql", str(cache), query, "--format", "json"])
    expected = [{"a": None, "b": None, "c": 1.5}, {"a": None, "b": 2.0, "c": 3.0}]
    assert _strict(as_json.output) == expected
    as_jsonl = CliRunner().invoke(main, ["sql", str(cache), query, "--format", "jsonl"])
    assert [_strict(line) for line in as_jsonl.output.splitlines()] == expected


def test_metrics_lines_write_null_for_a_non_finite_loss(tmp_path: Path) -> None:
    from dflash_offline.train.metrics import MetricsLog, StepMetrics, recorded_loss

    nan, inf = float("nan"), float("inf")
    metrics = StepMetrics(
        step=1, epoch=0, loss=nan, lr=1e-4, grad_norm=inf, acc_by_position=[0.5, nan], simulated_tau=1.5,
        tokens=10, tokens_per_s=2.0, step_seconds=0.1, data_wait_fraction=0.0, buckets=[0], num_blocks=1,
    )  # fmt: skip
    log = MetricsLog(tmp_path / "metrics.jsonl", resume_from_step=0)
    log.write(metrics)
    log.close()
    (line,) = (tmp_path / "metrics.jsonl").read_text().splitlines()
    record = _strict(line)
    assert isinstance(record, dict)
    assert (record["loss"], record["grad_norm"], record["acc_by_position"]) == (None, None, [0.5, None])
    assert math.isnan(recorded_loss(tmp_path / "metrics.jsonl", step=1) or 0.0)  # read back as NaN


REFUSED_STATEMENTS = {
    "INSTALL httpfs": "an INSTALL statement",
    "FORCE INSTALL httpfs": "a FORCE INSTALL statement",
    "LOAD httpfs": "a LOAD statement",
    "ATTACH 'x.duckdb' AS x": "an ATTACH statement",
    "PIVOT samples ON shard USING count(*)": "a PIVOT statement",
    "USE memory": "a USE statement",
    "UPDATE EXTENSIONS": "an UPDATE statement",
    "WITH x AS (SELECT 1) INSERT INTO t SELECT * FROM x": "an INSERT statement",
    "/* why */ EXPLAIN SELECT 1": "an EXPLAIN statement",
    "COPY samples TO 'x.csv'": "a COPY statement",
}


@pytest.mark.parametrize("statement", list(REFUSED_STATEMENTS))
def test_a_refused_statement_is_named_as_typed(statement: str, tmp_path: Path) -> None:
    cache = _golden_copy(tmp_path, index=True)
    result = CliRunner().invoke(main, ["sql", str(cache), statement])
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    (error,) = result.output.splitlines()
    assert f"refused: {REFUSED_STATEMENTS[statement]};" in error, error
    assert error.endswith(f"`duckdb {cache}/index.duckdb`")  # the index is current: no `dflash index`


def test_the_shell_hint_asks_for_dflash_index_only_when_needed(tmp_path: Path) -> None:
    cache = _golden_copy(tmp_path, index=False)

    def hint() -> str:
        return CliRunner().invoke(main, ["sql", str(cache), "SET threads = 1"]).output.strip()

    assert hint().endswith(f"(after `dflash index {cache}`)")
    build_index(cache)
    assert hint().endswith(f"`duckdb {cache}/index.duckdb`")
    part = sorted((cache / "manifest" / "runs").glob("*.parquet"))[0]
    os.utime(part, ns=(part.stat().st_atime_ns, part.stat().st_mtime_ns + 10**9))
    assert hint().endswith(f"(after refreshing it with `dflash index {cache}`)")


@pytest.mark.parametrize("name", ["w000-golden-a-000000.tmp-99-1.parquet", ".tmp-99-1.parquet"])
def test_a_tmp_named_part_is_a_part_not_a_temp_file(name: str, tmp_path: Path) -> None:
    cache = _golden_copy(tmp_path, index=False)
    samples = cache / "manifest" / "samples"
    shutil.copy(sorted(samples.glob("*.parquet"))[0], samples / name)
    own_temp = samples / "x.parquet.tmp-5-6"  # what a killed writer leaves
    own_temp.write_bytes(b"partial")
    plan = CliRunner().invoke(main, ["verify", str(cache), "--repair", "--dry-run", "--no-progress"])
    assert f"manifest/samples/{name} (" in plan.output  # moved aside as a damaged part
    assert f"{name}: " not in plan.output.replace(f"manifest/samples/{name} (", "")  # and not deleted
    assert "manifest/samples/x.parquet.tmp-5-6: 7 bytes, stale temp file" in plan.output
    assert not re.search(r"files of\s*:", plan.output), plan.output  # no empty shard name
    CliRunner().invoke(main, ["verify", str(cache), "--repair", "--yes", "--no-progress"])
    aside = cache / "manifest" / "damaged" / "samples" / name
    assert aside.is_file()
    assert not own_temp.exists()
    after = CliRunner().invoke(main, ["verify", str(cache), "--no-progress"])
    assert after.exit_code == 0, after.output
    assert "stale temp file" not in after.output, after.output
    again = CliRunner().invoke(main, ["verify", str(cache), "--repair", "--yes", "--no-progress"])
    assert "nothing to repair" in again.output, again.output
    assert aside.is_file()


# --------------------------------------------------------------------------------------------------------
# Drafter directories: a diverged run, exports that would land on a run or a
# cache, and damaged drafter directories read by `dflash eval --drafter` and `dflash train --init-from`.
# --------------------------------------------------------------------------------------------------------


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _one_error(args: list[str], cwd: Path | None = None) -> str:
    """Run ``dflash ARGS``: it must fail with exit 1 and one ``Error:`` line, no traceback; the line."""
    here = Path.cwd()
    if cwd is not None:
        os.chdir(cwd)
    try:
        result = CliRunner().invoke(main, args)
    finally:
        os.chdir(here)
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        f"{type(result.exception).__name__}: {result.exception}"
    )
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.output
    return errors[0]


def test_a_diverged_run_exits_1_naming_the_step(scene: Scene) -> None:
    out = scene.root / "diverged"
    args = ["train", "--cache", str(scene.cache), "--out", str(out), *TRAIN_ARGS, "--lr", "1e12",
            "--max-steps", "6", "--checkpoint-every", "1"]  # fmt: skip
    error = _one_error(args)
    assert "training diverged" in error, error
    assert "at step 2;" in error, error
    assert not (out / "drafter").exists()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000001"]


EXPORT_OUTS: dict[str, Callable[[Scene], str]] = {
    "the run itself": lambda s: str(s.run),
    "the run, spelled with ..": lambda s: str(s.run / ".." / s.run.name),
    "a symlink to the run": lambda s: str(_symlink(s, "run-link", s.run)),
    "a new folder inside the run": lambda s: str(s.run / "exported"),
    "the run's checkpoints": lambda s: str(s.run / "checkpoints"),
    "the cache": lambda s: str(s.cache),
    "a folder inside the cache": lambda s: str(s.cache / "drafter"),
    "a symlink into the cache": lambda s: str(_symlink(s, "cache-link", s.cache) / "drafter"),
    "a parent of the run": lambda s: str(s.run.parent),
    "a model directory (config.json not an export's)": lambda s: str(_model_dir(s)),
}


def _symlink(scene: Scene, name: str, to: Path) -> Path:
    link = scene.root / name
    if not link.is_symlink():
        link.symlink_to(to, target_is_directory=True)
    return link


def _model_dir(scene: Scene) -> Path:
    folder = scene.root / "model-dir"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    return folder


@pytest.mark.parametrize("name", list(EXPORT_OUTS))
def test_export_never_writes_into_a_run_a_cache_or_over_what_is_not_an_export(
    name: str, scene: Scene
) -> None:
    out = EXPORT_OUTS[name](scene)
    before_run, before_cache = _files(scene.run), _files(scene.cache)
    before_out = _files(Path(out)) if Path(out).is_dir() else None
    error = _one_error(["export", str(scene.run), "--out", out])
    assert f"--out {out}" in error, error
    assert _files(scene.run) == before_run
    assert _files(scene.cache) == before_cache
    if before_out is not None and not name.startswith("a parent"):
        assert _files(Path(out)) == before_out


def test_export_replaces_an_earlier_export(scene: Scene) -> None:
    out = scene.root / "export-twice"
    for _ in range(2):
        result = CliRunner().invoke(main, ["export", str(scene.run), "--out", str(out)])
        assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]


def test_train_and_eval_never_replace_an_export_or_a_run_config(scene: Scene) -> None:
    export = scene.root / "kept-export"
    assert CliRunner().invoke(main, ["export", str(scene.run), "--out", str(export)]).exit_code == 0
    before_export, before_run = _files(export), _files(scene.run)
    error = _one_error(["train", "--cache", str(scene.cache), "--out", str(export), *TRAIN_ARGS])
    assert f"--out {export}" in error
    report = str(scene.run / "config.json")
    args = ["eval", "--target", "random:tiny", "--drafter", str(scene.drafter), "--data", str(scene.data),
            "--limit", "1", "--max-new-tokens", "4", "--json", report, "--no-progress"]  # fmt: skip
    error = _one_error(args)
    assert f"--json {report}" in error
    assert _files(export) == before_export
    assert _files(scene.run) == before_run


@pytest.fixture(scope="module")
def init_drafter(scene: Scene) -> Path:
    """A float32 export of ``scene.run``: a drafter of the shape TRAIN_ARGS trains (for --init-from) and of
    random:tiny (for eval)."""
    from dflash_offline.train.checkpoint import export_run

    return export_run(scene.run, scene.root / "init-drafter", dtype="float32")


def _edit_config(edit: Callable[[dict], object]) -> Callable[[Path], str]:
    def damage(drafter: Path) -> str:
        config = json.loads((drafter / "config.json").read_text())
        edit(config)  # in place
        (drafter / "config.json").write_text(json.dumps(config))
        return "config.json"

    return damage


def _edit_weights(edit: Callable[[dict], None]) -> Callable[[Path], str]:
    def damage(drafter: Path) -> str:
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(drafter / "model.safetensors"))
        edit(tensors)
        save_file(tensors, str(drafter / "model.safetensors"))
        return "model.safetensors"

    return damage


def _rewrite(name: str, data: Callable[[bytes], bytes]) -> Callable[[Path], str]:
    def damage(drafter: Path) -> str:
        path = drafter / name
        path.write_bytes(data(path.read_bytes()))
        return name

    return damage


def _remove(name: str) -> Callable[[Path], str]:
    def damage(drafter: Path) -> str:
        (drafter / name).unlink()
        return name

    return damage


def _set_nan(tensors: dict) -> None:
    tensors["norm.weight"][3] = float("nan")


DRAFTER_DAMAGE: dict[str, tuple[Callable[[Path], str], str]] = {
    "config.json missing": (_remove("config.json"), "missing"),
    "model.safetensors missing": (_remove("model.safetensors"), "missing"),
    "config.json truncated": (_rewrite("config.json", lambda b: b[: len(b) // 2]), "not valid JSON"),
    "config.json not UTF-8": (_rewrite("config.json", lambda b: b"\xff\xfe" + b), "not valid JSON"),
    "config.json a JSON list": (_rewrite("config.json", lambda b: b"[1, 2]"), "JSON list"),
    "no num_attention_heads": (_edit_config(lambda c: c.pop("num_attention_heads")), "num_attention_heads"),
    "hidden_size a string": (_edit_config(lambda c: c.update(hidden_size="64")), "hidden_size"),
    "head_dim a float": (_edit_config(lambda c: c.update(head_dim=16.5)), "head_dim"),
    "num_hidden_layers 0": (_edit_config(lambda c: c.update(num_hidden_layers=0)), "num_layers"),
    "dflash_config a list": (_edit_config(lambda c: c.update(dflash_config=[1])), "dflash_config"),
    "target_layer_ids a number": (
        _edit_config(lambda c: c["dflash_config"].update(target_layer_ids=2)),
        "target_layer_ids",
    ),
    "no mask_token_id": (_edit_config(lambda c: c["dflash_config"].pop("mask_token_id")), "mask_token_id"),
    "rope_parameters a string": (_edit_config(lambda c: c.update(rope_parameters="x")), "rope_parameters"),
    "model.safetensors truncated": (
        _rewrite("model.safetensors", lambda b: b[: len(b) // 2]),
        "not a readable safetensors file",
    ),
    "model.safetensors random bytes": (
        _rewrite("model.safetensors", lambda b: os.urandom(len(b))),
        "not a readable safetensors file",
    ),
    "a tensor missing": (_edit_weights(lambda t: t.pop("norm.weight")), "norm.weight"),
    "a tensor of the wrong shape": (
        _edit_weights(lambda t: t.update({"norm.weight": t["norm.weight"][:-1].clone()})),
        "norm.weight",
    ),
    "an integer tensor": (
        _edit_weights(lambda t: t.update({"norm.weight": t["norm.weight"].long()})),
        "dtype",
    ),
    "a NaN in a tensor": (_edit_weights(_set_nan), "norm.weight"),
}


@pytest.mark.parametrize("command", ["eval", "train --init-from"])
@pytest.mark.parametrize("damage", list(DRAFTER_DAMAGE))
def test_a_damaged_drafter_is_one_line_naming_the_file(
    damage: str, command: str, scene: Scene, init_drafter: Path
) -> None:
    slug = "".join(ch if ch.isalnum() else "-" for ch in f"{damage}-{command}")
    drafter = shutil.copytree(init_drafter, scene.root / f"damaged-{slug}")
    apply, what = DRAFTER_DAMAGE[damage]
    file = str(drafter / apply(drafter))
    if command == "eval":
        args = ["eval", "--target", "random:tiny", "--drafter", str(drafter), "--data", str(scene.data),
                "--limit", "1", "--max-new-tokens", "4", "--no-progress"]  # fmt: skip
    else:
        out = scene.root / f"init-run-{slug}"
        args = [
            "train",
            "--cache",
            str(scene.cache),
            "--out",
            str(out),
            *TRAIN_ARGS,
            "--init-from",
            str(drafter),
        ]
    error = _one_error(args)
    assert file in error, error
    assert what in error, error


# --- dflash regenerate --engine openai: a server's bad values, bad URLs, failed runs ---


@pytest.fixture(scope="module")
def openai_servers() -> Iterator[tuple[Server, Server]]:
    """A fake OpenAI-compatible server (tests/regenerate/openai_server.py) and one the cases kill."""
    processes = [start_server(), start_server()]
    with reaped(processes[0]), reaped(processes[1]):
        healthy, victim = (ready(p) for p in processes)
        yield healthy, victim


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


@pytest.mark.slow
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
