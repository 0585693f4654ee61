"""Stream the raw records of a JSON-array or JSONL file with bounded memory.

A JSON array is decoded one element at a time with ``json.JSONDecoder.raw_decode`` over a sliding text
buffer, so a 125 MB file never becomes 125 MB of Python objects. A file that ends inside an element
(the embedded ShareGPT V3 file does) yields a final record with ``truncated=True``; a syntax error
inside the array yields one record with ``error`` set and ends the stream, because an array cannot be
resynchronised reliably after a syntax error. A JSONL file is read line by line; a bad line is one
error record and the following lines are read normally.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from dflash_offline.errors import DataError

_CHUNK_CHARS = 1 << 20
"""Characters read at a time; an element larger than the buffer grows it geometrically."""
_WHITESPACE = " \t\r\n"
_NEAR_END = 16
"""A decode error this close to the end of the buffered text may just mean 'not read yet'."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RawRecord:
    """One element of a JSON array or one non-blank JSONL line, decoded or not."""

    source_index: int
    """0-based position of the record in the file (array element or non-blank line)."""
    where: str
    """Where it starts, for messages: ``"line 12"`` (JSONL) or ``"element 3 (line 40)"`` (array)."""
    value: Any
    """The decoded JSON value; None when ``error`` is set."""
    error: str | None
    """The JSON decode error, or None."""
    truncated: bool
    """The file ends inside this record (its tail is missing)."""


def detect_format(path: Path) -> str:
    """``"json"`` when the first non-blank character is ``[``, else ``"jsonl"``."""
    with open(path, encoding="utf-8-sig") as f:
        while True:
            chunk = f.read(4096)
            if not chunk:
                raise DataError(f"data file {str(path)!r} is empty; give a JSON array or a JSONL file")
            stripped = chunk.lstrip(_WHITESPACE)
            if stripped:
                return "json" if stripped[0] == "[" else "jsonl"


def iter_raw_records(path: Path) -> Iterator[RawRecord]:
    """Yield every record of ``path`` in file order (format detected from the first character)."""
    if detect_format(path) == "json":
        yield from _iter_json_array(path)
    else:
        yield from _iter_jsonl(path)


def _iter_jsonl(path: Path) -> Iterator[RawRecord]:
    index = 0
    with open(path, encoding="utf-8-sig") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip(_WHITESPACE):
                continue
            if index == 0 and line.strip(_WHITESPACE) == "{":
                raise DataError(
                    f"{str(path)!r} starts with a pretty-printed JSON object; expected a JSON array of "
                    "records or one JSON object per line (JSONL)"
                )
            where = f"line {lineno}"
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                # Only the last line can be cut short; it is the one without a newline.
                truncated = not line.endswith("\n")
                yield RawRecord(
                    source_index=index, where=where, value=None, error=str(e), truncated=truncated
                )
            else:
                yield RawRecord(source_index=index, where=where, value=value, error=None, truncated=False)
            index += 1


class _Buffer:
    """A sliding window over a text file with line counting for messages."""

    def __init__(self, f: TextIO) -> None:
        self.f = f
        self.text = ""
        self.eof = False
        self._counted_pos = 0  # line count is known up to this position of ``text``
        self._counted_line = 1

    def read_more(self, pending: int) -> bool:
        """Append at least one chunk (or as much as is pending, so big elements cost O(n)); False at EOF."""
        if self.eof:
            return False
        more = self.f.read(max(_CHUNK_CHARS, pending))
        if not more:
            self.eof = True
            return False
        self.text += more
        return True

    def line_at(self, pos: int) -> int:
        assert pos >= self._counted_pos
        self._counted_line += self.text.count("\n", self._counted_pos, pos)
        self._counted_pos = pos
        return self._counted_line

    def skip_ws(self, pos: int) -> int:
        """Position of the next non-whitespace character, reading as needed; len(text) at EOF."""
        while True:
            while pos < len(self.text) and self.text[pos] in _WHITESPACE:
                pos += 1
            if pos < len(self.text) or not self.read_more(0):
                return pos

    def compact(self, pos: int) -> int:
        """Drop consumed text before ``pos``; return the new position (0)."""
        if pos < _CHUNK_CHARS:
            return pos
        self.line_at(pos)
        self.text = self.text[pos:]
        self._counted_pos = 0
        return 0


def _maybe_incomplete(err: json.JSONDecodeError, text_len: int) -> bool:
    # An unterminated string means no closing quote and no raw newline before the end of the buffer
    # (json rejects raw control characters inside strings), so it always means "read more".
    return err.pos >= text_len - _NEAR_END or err.msg.startswith("Unterminated string")


def _iter_json_array(path: Path) -> Iterator[RawRecord]:
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8-sig") as f:
        buf = _Buffer(f)
        pos = buf.skip_ws(0)
        assert buf.text[pos] == "["  # detect_format checked it
        pos += 1
        index = 0
        while True:
            pos = buf.skip_ws(pos)
            if pos >= len(buf.text):
                return  # EOF right after '[' or ',': no partial element is lost
            if buf.text[pos] == "]":
                return
            if index > 0:
                if buf.text[pos] != ",":
                    line = buf.line_at(pos)
                    yield RawRecord(
                        source_index=index,
                        where=f"element {index} (line {line})",
                        value=None,
                        error=f"expected ',' or ']' between array elements, found {buf.text[pos]!r}; "
                        "the rest of the array cannot be read",
                        truncated=False,
                    )
                    return
                pos = buf.skip_ws(pos + 1)
                if pos >= len(buf.text):
                    return
            where = f"element {index} (line {buf.line_at(pos)})"
            while True:
                try:
                    value, end = decoder.raw_decode(buf.text, pos)
                except json.JSONDecodeError as e:
                    incomplete = _maybe_incomplete(e, len(buf.text))
                    if incomplete and buf.read_more(len(buf.text) - pos):
                        continue
                    # e.lineno/e.colno count from the buffer start, not the file's: use our line count.
                    detail = f"{e.msg} (line {buf.line_at(max(e.pos, pos))})"
                    if not incomplete:
                        detail += "; the rest of the array cannot be read"
                    yield RawRecord(
                        source_index=index, where=where, value=None, error=detail, truncated=incomplete
                    )
                    return
                break
            yield RawRecord(source_index=index, where=where, value=value, error=None, truncated=False)
            index += 1
            pos = buf.compact(end)
