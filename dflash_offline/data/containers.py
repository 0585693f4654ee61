"""What a ``--data`` path is, and its raw records, streamed with bounded memory.

Accepted (``ACCEPTED`` says it to the user):
  * a JSON array or JSONL file, plain or compressed with gzip or zstd. The compression is recognised by
    its magic bytes, so a gzip file without ``.gz`` is still read; a ``.gz``/``.zst`` suffix whose bytes
    are not that compression is refused (a renamed or half-downloaded file), never read as text.
  * a Parquet file, or a directory of them (every ``*.parquet`` below it, in sorted path order), read
    one batch of rows at a time.
  * a Hugging Face ``datasets`` ``save_to_disk`` directory: ``state.json`` lists its Arrow IPC stream
    files (``data-*.arrow``), read here with pyarrow alone (the ``datasets`` package is not needed).
    A saved ``DatasetDict`` (``dataset_dict.json``) is refused with its split names: pick one.
  * a single ``.arrow`` file (Arrow IPC stream or file format).
Parquet and Arrow rows become plain dicts (top-level nulls dropped, as a JSON record would omit the
key), so the same records give the same conversations, positions and sample ids in every container.
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal

from dflash_offline.config_fields import DATA, field_ref
from dflash_offline.data.jsonstream import RawRecord, iter_json_array, iter_jsonl
from dflash_offline.errors import DataError

ACCEPTED = (
    "accepted: a JSON array or JSONL file (.json, .jsonl), the same compressed with gzip or zstd "
    "(.gz, .zst), a Parquet file or a directory of Parquet files, or a Hugging Face datasets "
    "save_to_disk directory"
)
GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
PARQUET_MAGIC = b"PAR1"
ARROW_FILE_MAGIC = b"ARROW1"
ARROW_STREAM_MAGIC = b"\xff\xff\xff\xff"  # the IPC continuation marker that starts every stream message
_GZIP_SUFFIXES = (".gz", ".gzip")
_ZSTD_SUFFIXES = (".zst", ".zstd")
_JSONL_SUFFIXES = (".jsonl", ".ndjson")
_SNIFF_BYTES = 8192
_ROWS_PER_SLICE = 256
"""Arrow rows turned into Python dicts at a time: bounds the Python objects alive at once."""
KNOWN_COLUMNS = ("id", "conversations", "messages", "prompt", "response", "instruction", "input", "output")
"""Columns read from Parquet/Arrow when present (others are never decoded)."""

Compression = Literal["none", "gzip", "zstd"]
Kind = Literal["json", "jsonl", "parquet", "arrow"]


@dataclass(frozen=True, kw_only=True, slots=True)
class DataContainer:
    """A resolved ``--data`` path: which reader, which files, in which order."""

    path: Path
    """What the user named (a file or a directory)."""
    kind: Kind
    """``json`` (one array), ``jsonl`` (one value a line), ``parquet`` or ``arrow`` (IPC)."""
    files: tuple[Path, ...]
    """The files read, in record order (one for JSON/JSONL)."""
    compression: Compression
    """Of a JSON/JSONL file; ``none`` for Parquet/Arrow (their own codecs are internal)."""


def _suffixes(path: Path) -> list[str]:
    return [s.lower() for s in path.suffixes]


def open_container(path: Path) -> DataContainer:
    """Classify ``path`` by directory layout, magic bytes and suffix; a clear error for anything else."""
    if path.is_dir():
        return _open_directory(path)
    with open(path, "rb") as f:
        head = f.read(_SNIFF_BYTES)
    if not head:
        raise DataError(f"data file {str(path)!r} is empty; {ACCEPTED}")
    suffixes = _suffixes(path)
    if head.startswith(PARQUET_MAGIC):
        return DataContainer(path=path, kind="parquet", files=(path,), compression="none")
    if head.startswith(ARROW_FILE_MAGIC) or (head.startswith(ARROW_STREAM_MAGIC) and ".arrow" in suffixes):
        return DataContainer(path=path, kind="arrow", files=(path,), compression="none")
    compression: Compression = "none"
    if head.startswith(GZIP_MAGIC):
        compression = "gzip"
    elif head.startswith(ZSTD_MAGIC):
        compression = "zstd"
    last = suffixes[-1] if suffixes else ""
    promised = "gzip" if last in _GZIP_SUFFIXES else "zstd" if last in _ZSTD_SUFFIXES else None
    if promised is not None and promised != compression:
        raise DataError(
            f"data file {str(path)!r} is named like a {promised} file but its bytes are not {promised} "
            f"(starts with {head[:4].hex(' ')}); a damaged or renamed file? {ACCEPTED}"
        )
    text_head = head if compression == "none" else _decompressed_head(path, compression)
    if b"\x00" in text_head:
        raise DataError(
            f"data file {str(path)!r} is not text (it holds NUL bytes; starts with "
            f"{head[:8].hex(' ')}); {ACCEPTED}"
        )
    stripped = text_head.removeprefix(b"\xef\xbb\xbf").lstrip(b" \t\r\n")
    if not stripped:
        raise DataError(f"data file {str(path)!r} is empty; give a JSON array or a JSONL file")
    inner = [s for s in suffixes if s not in _GZIP_SUFFIXES + _ZSTD_SUFFIXES]
    # A .jsonl name wins over the first character: a JSONL file whose first line is a bad '[...' line
    # must stay JSONL (one bad line), not become one broken JSON array.
    is_jsonl = bool(inner) and inner[-1] in _JSONL_SUFFIXES
    kind: Kind = "jsonl" if is_jsonl or not stripped.startswith(b"[") else "json"
    return DataContainer(path=path, kind=kind, files=(path,), compression=compression)


def _decompressed_head(path: Path, compression: Compression) -> bytes:
    try:
        with open_bytes(path, compression) as f:
            return f.read(_SNIFF_BYTES)
    except Exception as e:  # gzip raises OSError/EOFError, zstandard its ZstdError (an Exception only)
        raise DataError(f"data file {str(path)!r}: cannot decompress its {compression} data ({e})") from e


def _open_directory(path: Path) -> DataContainer:
    if (path / "dataset_dict.json").is_file():
        try:
            splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        except (json.JSONDecodeError, AttributeError, OSError):
            splits = []
        hint = ", ".join(f"{path / s}" for s in splits) or "one of its split directories"
        raise DataError(
            f"{str(path)!r} is a saved datasets DatasetDict: pass one split, e.g. {field_ref(DATA)} {hint}"
        )
    state = path / "state.json"
    if state.is_file():
        try:
            names = [entry["filename"] for entry in json.loads(state.read_text())["_data_files"]]
        except (json.JSONDecodeError, KeyError, TypeError, OSError) as e:
            raise DataError(f"{str(state)!r} is not a datasets save_to_disk state file ({e})") from e
        files = tuple(path / name for name in names)
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise DataError(f"save_to_disk directory {str(path)!r} lacks its data files {missing}")
        return DataContainer(path=path, kind="arrow", files=files, compression="none")
    parquet = tuple(sorted(path.rglob("*.parquet"), key=lambda p: p.relative_to(path).as_posix()))
    if parquet:
        return DataContainer(path=path, kind="parquet", files=parquet, compression="none")
    raise DataError(
        f"data directory {str(path)!r} holds no .parquet file and no datasets save_to_disk state.json; "
        f"{ACCEPTED}"
    )


@contextmanager
def open_bytes(path: Path, compression: Compression) -> Iterator[BinaryIO]:
    """The decompressed bytes of ``path`` as a buffered binary stream."""
    if compression == "gzip":
        with gzip.open(path, "rb") as g:
            yield g  # type: ignore[misc]
    elif compression == "zstd":
        try:
            import zstandard
        except ImportError as e:  # a declared dependency; only a broken install lacks it
            raise DataError(f"{str(path)!r} is zstd-compressed: pip install zstandard") from e
        reader = zstandard.ZstdDecompressor().stream_reader(
            open(path, "rb"),  # noqa: SIM115 (closefd=True: the reader closes it)
            read_across_frames=True,
            closefd=True,
        )
        with io.BufferedReader(_CheckedZstd(reader, path), buffer_size=1 << 20) as f:
            yield f  # type: ignore[misc]
    else:
        with open(path, "rb") as f:
            yield f


class _CheckedZstd(io.RawIOBase):
    """zstandard's stream reader, made to raise ``EOFError`` at the end of a cut file.

    The reader itself just stops where the bytes stop (zstandard 0.25), which would silently drop the
    tail of a cut or half-downloaded file; at its end we walk the frame headers to prove it whole."""

    def __init__(self, reader: Any, path: Path) -> None:
        self._reader = reader
        self._path = path

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        data = self._reader.read(len(b))
        if not data:
            problem = zstd_frames_problem(self._path)
            if problem is not None:
                raise EOFError(problem)
            return 0
        b[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self._reader.close()
        super().close()


def zstd_frames_problem(path: Path) -> str | None:
    """None when ``path`` is a sequence of complete zstd (or skippable) frames, else what is wrong.

    Reads only frame and block headers (RFC 8878 §3.1), seeking over the block contents."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        pos = 0
        while pos < size:
            f.seek(pos)
            magic = f.read(4)
            if len(magic) < 4:
                return f"the zstd data ends inside a frame header at byte {pos} (the file is cut short)"
            number = int.from_bytes(magic, "little")
            if 0x184D2A50 <= number <= 0x184D2A5F:  # a skippable frame: 4-byte length, then its bytes
                length = f.read(4)
                pos += 8 + int.from_bytes(length, "little")
                if len(length) < 4 or pos > size:
                    return f"the zstd data ends inside a skippable frame (the file is cut short at {size})"
                continue
            if magic != ZSTD_MAGIC:
                return f"bytes {magic.hex(' ')} at offset {pos} are not a zstd frame"
            descriptor = f.read(1)
            if not descriptor:
                return "the zstd data ends inside a frame header (the file is cut short)"
            d = descriptor[0]
            single_segment = bool(d & 0x20)
            fcs_size = (1 if single_segment else 0, 2, 4, 8)[d >> 6]
            header = 5 + (0 if single_segment else 1) + (0, 1, 2, 4)[d & 0x3] + fcs_size
            pos += header
            last = False
            while not last:
                f.seek(pos)
                block = f.read(3)
                if len(block) < 3:
                    return f"the zstd data ends inside a frame at byte {size} (the file is cut short)"
                value = int.from_bytes(block, "little")
                last, kind, block_size = bool(value & 1), (value >> 1) & 3, value >> 3
                pos += 3 + (1 if kind == 1 else block_size)
            pos += 4 if d & 0x4 else 0  # the content checksum
            if pos > size:
                return f"the zstd data ends inside a frame at byte {size} (the file is cut short)"
    return None


def iter_container(container: DataContainer) -> Iterator[RawRecord]:
    """Every raw record of the container in order, ``source_index`` counting from 0 across files."""
    if container.kind in ("json", "jsonl"):
        (path,) = container.files
        with open_bytes(path, container.compression) as f:
            yield from (iter_json_array(f) if container.kind == "json" else iter_jsonl(f, name=str(path)))
        return
    index = 0
    for path in container.files:
        for local, row, error in _iter_arrow_rows(path, container.kind):
            where = f"row {index}" if len(container.files) == 1 else f"row {index} ({path.name} row {local})"
            if error is not None:
                yield RawRecord(source_index=index, where=where, value=None, error=error, truncated=True)
                return  # a damaged file cannot be read past the damage
            yield RawRecord(source_index=index, where=where, value=row, error=None, truncated=False)
            index += 1


def _iter_arrow_rows(path: Path, kind: Kind) -> Iterator[tuple[int, dict[str, Any] | None, str | None]]:
    """(row number in this file, row as a dict, None) per row; (n, None, error) once if it is damaged."""
    import pyarrow as pa

    local = 0
    try:
        for batch in _iter_batches(path, kind):
            for start in range(0, batch.num_rows, _ROWS_PER_SLICE):
                for row in batch.slice(start, _ROWS_PER_SLICE).to_pylist():
                    yield local, {k: v for k, v in row.items() if v is not None}, None
                    local += 1
    except (pa.ArrowException, OSError) as e:
        yield local, None, f"{path.name} cannot be read from row {local} on ({type(e).__name__}: {e})"


def _iter_batches(path: Path, kind: Kind) -> Iterator[Any]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if kind == "parquet":
        pf = pq.ParquetFile(path)
        yield from pf.iter_batches(batch_size=_ROWS_PER_SLICE, columns=_columns(pf.schema_arrow.names))
        return
    with pa.OSFile(str(path)) as f:
        head = f.read(len(ARROW_FILE_MAGIC))
        f.seek(0)
        if head == ARROW_FILE_MAGIC:
            reader = pa.ipc.open_file(f)
            for i in range(reader.num_record_batches):
                yield _select(reader.get_batch(i))
        else:
            for batch in pa.ipc.open_stream(f):
                yield _select(batch)


def _columns(names: list[str]) -> list[str]:
    """The known columns present, or every column when none is (so the failure lists the keys)."""
    known = [n for n in names if n in KNOWN_COLUMNS]
    return known or list(names)


def _select(batch: Any) -> Any:
    return batch.select(_columns(batch.schema.names))
