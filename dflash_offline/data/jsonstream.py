"""Stream the raw records of a JSON-array or JSONL byte stream (plain or decompressed) with bounded memory.

A JSON array is decoded one element at a time with ``json.JSONDecoder.raw_decode`` over a sliding text
buffer, so a 125 MB file never becomes 125 MB of Python objects. A file that ends inside an element
(the embedded ShareGPT V3 file does) yields a final record with ``truncated=True``; a syntax error
inside the array yields one record with ``error`` set and ends the stream, because an array cannot be
resynchronised reliably after a syntax error. A JSONL file is read line by line; a bad line is one
error record and the following lines are read normally.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO, TextIO

from dflash_offline.errors import DataError

_CHUNK_CHARS = 1 << 20
"""Characters read at a time; an element larger than the buffer grows it geometrically."""
_WHITESPACE = " \t\r\n"
_WHITESPACE_BYTES = b" \t\r\n"
_NEAR_END = 16
"""A decode error this close to the end of the buffered text may just mean 'not read yet'."""
_TOO_DEEP = "invalid JSON: nested too deeply for the JSON parser"


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


_DAMAGED_STREAM = (OSError, EOFError)
"""What gzip raises on a damaged or cut stream (zstandard raises its own ZstdError: caught by name)."""


def _stream_error(e: BaseException) -> bool:
    return isinstance(e, _DAMAGED_STREAM) or type(e).__name__ == "ZstdError"


def iter_jsonl(f: BinaryIO, *, name: str) -> Iterator[RawRecord]:
    """One record per non-blank line of a binary stream; a bad line is one error record.

    Lines are decoded one at a time, so invalid UTF-8 bytes, JSON nested too deeply for Python's
    parser, or a syntax error spoil only their own line. A damaged compressed stream ends the file with
    a ``truncated`` record after the lines read so far. The loop stays in one function (error records
    are built by ``_error``): it runs once per line."""
    index = 0
    lineno = 0
    lines = iter(f)
    while True:
        try:
            line_bytes = next(lines)
        except StopIteration:
            return
        except Exception as e:
            if not _stream_error(e):
                raise
            detail = f"the data stream is damaged or cut short here ({type(e).__name__}: {e})"
            yield _error(index, f"line {lineno + 1}", detail, truncated=True)
            return
        lineno += 1
        if lineno == 1:
            line_bytes = line_bytes.removeprefix(b"\xef\xbb\xbf")
        stripped = line_bytes.strip(_WHITESPACE_BYTES)
        if not stripped:
            continue
        if index == 0 and stripped == b"{":
            raise DataError(
                f"{name!r} starts with a pretty-printed JSON object; expected a JSON array of "
                "records or one JSON object per line (JSONL)"
            )
        where = f"line {lineno}"
        try:
            value = json.loads(line_bytes.decode("utf-8"))
        except UnicodeDecodeError as e:
            detail = (
                f"invalid UTF-8 at byte {e.start} of the line ({e.reason}: {e.object[e.start : e.end]!r})"
            )
            yield _error(index, where, detail)
        except json.JSONDecodeError as e:
            # Only the last line can be cut short; it is the one without a newline.
            yield _error(index, where, f"invalid JSON: {e}", truncated=not line_bytes.endswith(b"\n"))
        except RecursionError:
            yield _error(index, where, _TOO_DEEP)
        else:
            yield RawRecord(source_index=index, where=where, value=value, error=None, truncated=False)
        index += 1


def _error(index: int, where: str, error: str, *, truncated: bool = False) -> RawRecord:
    """The record of data that does not decode."""
    return RawRecord(source_index=index, where=where, value=None, error=error, truncated=truncated)


class _Buffer:
    """A sliding window over a text file with line counting for messages."""

    def __init__(self, f: TextIO) -> None:
        self.f = f
        self.text = ""
        self.eof = False
        self.stream_error: str | None = None
        """Why the (decompressed) stream ended early, when it did."""
        self._counted_pos = 0  # line count is known up to this position of ``text``
        self._counted_line = 1

    def read_more(self, pending: int) -> bool:
        """Append at least one chunk (or as much as is pending, so big elements cost O(n)); False at EOF."""
        if self.eof:
            return False
        try:
            more = self.f.read(max(_CHUNK_CHARS, pending))
        except Exception as e:
            if not _stream_error(e):
                raise
            self.stream_error = f"the data stream is damaged or cut short ({type(e).__name__}: {e})"
            more = ""
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


def iter_json_array(f: BinaryIO) -> Iterator[RawRecord]:
    """One record per element of the JSON array in the binary stream ``f``.

    Decoded with ``surrogateescape``: an invalid UTF-8 byte inside a string becomes a lone surrogate
    that the record's parser reports (that element fails, the array goes on); one outside a string is
    a syntax error like any other. The loop stays in one function (error records are built by the
    helpers below): it runs once per element."""
    decoder = json.JSONDecoder()
    with io.TextIOWrapper(f, encoding="utf-8-sig", errors="surrogateescape") as text_f:
        buf = _Buffer(text_f)
        pos = buf.skip_ws(0)
        assert buf.text[pos] == "["  # open_container checked it
        pos += 1
        index = 0
        while True:
            pos = buf.skip_ws(pos)
            if pos >= len(buf.text):  # EOF right after '[' or ',': no partial element is lost
                yield from _damaged_tail(buf, index)
                return
            if buf.text[pos] == "]":
                return
            if index > 0:
                if buf.text[pos] != ",":
                    yield _missing_comma(buf, pos, index)
                    return
                pos = buf.skip_ws(pos + 1)
                if pos >= len(buf.text):
                    yield from _damaged_tail(buf, index)
                    return
            where = f"element {index} (line {buf.line_at(pos)})"
            while True:
                try:
                    value, end = decoder.raw_decode(buf.text, pos)
                except RecursionError:
                    yield _error(index, where, _TOO_DEEP + "; the rest of the array cannot be read")
                    return
                except json.JSONDecodeError as e:
                    incomplete = _maybe_incomplete(e, len(buf.text))
                    if incomplete and buf.read_more(len(buf.text) - pos):
                        continue
                    yield _undecodable_element(e, buf, pos, index, where, incomplete=incomplete)
                    return
                break
            yield RawRecord(source_index=index, where=where, value=value, error=None, truncated=False)
            index += 1
            pos = buf.compact(end)


def _missing_comma(buf: _Buffer, pos: int, index: int) -> RawRecord:
    return _error(
        index,
        f"element {index} (line {buf.line_at(pos)})",
        "invalid JSON: expected ',' or ']' between array elements, found "
        f"{buf.text[pos]!r}; the rest of the array cannot be read",
    )


def _undecodable_element(
    e: json.JSONDecodeError, buf: _Buffer, pos: int, index: int, where: str, *, incomplete: bool
) -> RawRecord:
    """The record of an element that does not decode: cut short (``incomplete``: the text ended inside
    it) or a syntax error, after which the rest of the array cannot be read."""
    # e.lineno/e.colno count from the buffer start, not the file's: use our line count.
    detail = f"invalid JSON: {e.msg} (line {buf.line_at(max(e.pos, pos))})"
    if not incomplete:
        detail += "; the rest of the array cannot be read"
    elif buf.stream_error:
        detail += f"; {buf.stream_error}"
    return _error(index, where, detail, truncated=incomplete)


def _damaged_tail(buf: _Buffer, index: int) -> Iterator[RawRecord]:
    """A truncated record when the array ended because its compressed stream broke, else nothing."""
    if buf.stream_error is not None:
        yield _error(
            index, f"element {index} (line {buf.line_at(len(buf.text))})", buf.stream_error, truncated=True
        )
