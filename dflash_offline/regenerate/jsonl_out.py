"""An append-only JSONL file that a killed run can resume: one flushed line per finished record.

On open, a last line without its newline (the process died mid-write) is cut off, so the rerun
rewrites that record whole; every complete line must parse, else the file is not ours to extend.
Each line carries a key field (``source_sample_id``) whose values are the records already done.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO, Any

from dflash_offline.config_fields import field_ref
from dflash_offline.errors import DataError
from dflash_offline.regenerate.config import RegenerateConfig

KEY = "source_sample_id"
"""The key field of regenerate's JSONL files (output, failures, partial file): the record's sample id."""


class ResumableJsonl:
    """Keys of the complete lines of ``path`` (created when missing), and an appender for new lines."""

    def __init__(self, path: Path, *, key: str) -> None:
        self.path = path
        self.key = key
        self.keys: set[str] = set()
        """Key values of every complete line."""
        self.repaired_bytes = 0
        """Bytes of a partial last line cut off on open (0 when the file ended cleanly)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            self._load_and_repair()
        self._file: IO[str] | None = None

    def _load_and_repair(self) -> None:
        # Streamed (line by line, the tail found from the end): memory grows with the keys, not the file.
        with open(self.path, "r+b") as f:
            size = f.seek(0, os.SEEK_END)
            end = size
            while end > 0:
                f.seek(max(0, end - 65536))
                chunk = f.read(end - max(0, end - 65536))
                at = chunk.rfind(b"\n")
                if at >= 0:
                    end = max(0, end - 65536) + at + 1
                    break
                end = max(0, end - 65536)
            if end < size:  # a partial last line (0 when there is no complete line at all)
                self.repaired_bytes = size - end
                f.truncate(end)
                f.flush()
                os.fsync(f.fileno())
            f.seek(0)
            for number, raw in enumerate(f, start=1):
                if not raw.strip():
                    continue
                try:
                    value = json.loads(raw)
                except json.JSONDecodeError as e:
                    raise DataError(
                        f"{self.path}:{number} is not valid JSON ({e}): not a file this command wrote; "
                        f"move it aside or choose another {field_ref(RegenerateConfig, 'out')}"
                    ) from e
                if not isinstance(value, dict) or not isinstance(value.get(self.key), str):
                    raise DataError(
                        f"{self.path}:{number} has no string {self.key!r}: not a file this command wrote; "
                        f"move it aside or choose another {field_ref(RegenerateConfig, 'out')}"
                    )
                self.keys.add(value[self.key])

    def append(self, record: dict[str, Any]) -> None:
        """Write one line and flush it (a kill loses at most the line being written)."""
        assert isinstance(record.get(self.key), str), f"record lacks its {self.key!r}"
        if self._file is None:
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (held open for the run)
        self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._file.flush()
        self.keys.add(record[self.key])

    def flush(self) -> None:
        """Make the appended lines durable (fsync) before a part they came from is deleted."""
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> ResumableJsonl:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def merge_parts(target: ResumableJsonl, parts: list[Path]) -> int:
    """Append the complete lines of ``parts`` whose key ``target`` lacks (a torn last line is cut first), then
    delete each part; returns the lines added. Streams line by line, so a rerun after a kill in the middle of
    a merge adds what is missing and nothing twice."""
    added = 0
    for part in parts:
        ResumableJsonl(part, key=target.key).close()  # repairs a torn last line, checks every line parses
        with open(part, encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                record = json.loads(line)
                if record[target.key] not in target.keys:
                    target.append(record)
                    added += 1
        target.flush()
        part.unlink()
    return added
