"""One shard file of one array: write it once (writer), read rows from it (reader).

Shape legend: R = rows of a shard (at most ``shard_rows``), F = features per token.

Layout (Zarr v3 ``sharding_indexed``, index at the end): the encoded inner chunks back to back, then
the index, ``chunks_per_shard`` pairs of little-endian uint64 (offset, nbytes) with 2^64 - 1 for a chunk
never written, then the crc32c of the index (little-endian uint32). Inner chunks are always stored at
their full shape: the last one of a partial shard is padded with the fill value (0).

Why our own code for it, when zarr-python can write and tensorstore read the same bytes (the tests check
both): in ``bench/cache_io.py`` zarr-python read at 0.06–0.08× this reader and tensorstore at 0.4–0.5×
(uncompressed, random samples, page cache warm), and zarr-python wrote whole uncompressed shards at about
a quarter of this writer's speed. Here an uncompressed piece of rows is one ``preadv`` straight into the
caller's buffer, a compressed chunk one ``pread`` plus one numcodecs decode into it, and a shard file one
buffered write of the encoded chunks (encoded on a thread pool). Files are written to a temp name and
renamed, and never rewritten.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from dflash_offline.cache.checksum import crc32c_extend
from dflash_offline.cache.layout import temp_path
from dflash_offline.cache.zarr_format import ArrayFormat
from dflash_offline.errors import CacheDamageError

EMPTY = np.uint64(2**64 - 1)
"""Index entry of an inner chunk that was never written (Zarr v3 sharding spec)."""


def write_shard_file(
    fmt: ArrayFormat, shard_index: int, rows_R: np.ndarray, *, pool: ThreadPoolExecutor | None, fsync: bool
) -> int:
    """Write rows_R (the shard's first R rows, C-contiguous) as shard ``shard_index`` of the array, a new
    file (temp name, then rename); compressed chunks are encoded on ``pool``. Returns the file's size."""
    cr = fmt.chunk_rows
    num_rows = rows_R.shape[0]
    assert 0 < num_rows <= fmt.shard_rows
    assert rows_R.dtype == fmt.dtype
    assert rows_R.flags.c_contiguous
    chunks = []
    for c in range(math.ceil(num_rows / cr)):
        chunk = rows_R[c * cr : (c + 1) * cr]
        if chunk.shape[0] < cr:  # zarr stores edge chunks at full shape, padded with the fill value
            padded = np.zeros((cr, *rows_R.shape[1:]), dtype=rows_R.dtype)
            padded[: chunk.shape[0]] = chunk
            chunk = padded
        chunks.append(chunk)
    if fmt.codec is None:
        encoded: list = [_bytes_of(chunk) for chunk in chunks]
    elif pool is not None and len(chunks) > 1:
        encoded = list(pool.map(fmt.codec.encode, chunks))
    else:
        encoded = [fmt.codec.encode(chunk) for chunk in chunks]
    index = np.full((fmt.chunks_per_shard, 2), EMPTY, dtype="<u8")
    offset = 0
    for c, data in enumerate(encoded):
        index[c] = (offset, len(data))
        offset += len(data)
    crc = np.array([crc32c_extend(0, index)], dtype="<u4")
    path = fmt.shard_path(shard_index)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        with open(tmp, "xb") as f:  # FileIO.write retries short writes itself
            for data in (*encoded, index, crc):
                f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    return offset + index.nbytes + crc.nbytes


class ShardFile:
    """One shard file of one array: its chunk index (read once: shard files are written once and never
    rewritten) and row reads into caller-provided buffers.

    Thread-safe: reads are positional (``pread``/``preadv``) on a descriptor opened once; it is closed
    when the object is garbage-collected, i.e. when no thread uses it any more (callers bound how many
    they keep, hence how many descriptors are open)."""

    def __init__(self, fmt: ArrayFormat, shard_index: int) -> None:
        self.fmt = fmt
        self.shard_index = shard_index
        self.path = fmt.shard_path(shard_index)
        self._fd = -1
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise CacheDamageError(f"{self.path} is missing: rows point past written data") from None
        size = os.fstat(self._fd).st_size
        n = fmt.chunks_per_shard
        index_bytes = 16 * n + 4
        if size < index_bytes:
            raise CacheDamageError(f"{self.path}: {size} bytes, too short to hold its chunk index")
        tail = os.pread(self._fd, index_bytes, size - index_bytes)
        table = np.frombuffer(tail, dtype="<u8", count=2 * n).reshape(n, 2)
        stored_crc = int.from_bytes(tail[-4:], "little")
        if crc32c_extend(0, table) != stored_crc:
            raise CacheDamageError(f"{self.path}: the chunk index fails its crc32c (damaged file)")
        written = table[:, 0] != EMPTY
        ends = table[written, 0] + table[written, 1]
        if ends.size and int(ends.max()) > size - index_bytes:
            raise CacheDamageError(
                f"{self.path}: the chunk index points past the end of the file (truncated)"
            )
        self.size = size
        self.offsets = table[:, 0].astype(np.int64, copy=True)  # EMPTY becomes -1
        self.nbytes = table[:, 1].astype(np.int64, copy=True)
        # Fast path: uncompressed chunks stored in order, back to back (what zarr-python writes), so
        # that row r of the written prefix lies at byte base + r * row_bytes: one preadv per piece.
        chunk_bytes = fmt.chunk_rows * fmt.row_bytes
        num_written = int(np.argmin(written)) if not written.all() else n
        prefix = np.arange(num_written, dtype=np.int64)
        self.linear_rows = 0
        if (
            fmt.codec is None
            and num_written
            and not written[num_written:].any()
            and (self.offsets[:num_written] == self.offsets[0] + prefix * chunk_bytes).all()
            and (self.nbytes[:num_written] == chunk_bytes).all()
        ):
            self.linear_rows = num_written * fmt.chunk_rows

    def __del__(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def read_pieces(self, pieces: Sequence[Piece], scratch: np.ndarray | None) -> None:
        """Fill each piece's ``out`` with its rows of this shard, reading and decoding every inner chunk
        once however many pieces share it. Pieces must be sorted by ``row0`` (they may overlap).
        ``scratch`` (at least one inner chunk of bytes) holds chunks that no single piece covers;
        None allocates."""
        _check_pieces(pieces, self.fmt.shard_rows)
        if all(piece.row1 <= self.linear_rows for piece in pieces):
            base, rb = int(self.offsets[0]), self.fmt.row_bytes
            for piece in pieces:
                self._preadv([_bytes_of(piece.out)], base + piece.row0 * rb)
            return
        by_chunk = _pieces_by_chunk(pieces, self.fmt.chunk_rows)
        if self.fmt.codec is None:
            self._read_uncompressed(by_chunk)
        else:
            self._read_compressed(by_chunk, scratch)

    def _read_uncompressed(self, by_chunk: dict[int, list[tuple[Piece, int, int]]]) -> None:
        """Runs of file-contiguous bytes across the chunks, each read by one preadv into several buffers."""
        cr, rb = self.fmt.chunk_rows, self.fmt.row_bytes
        chunk_bytes = cr * rb
        runs: list[tuple[int, list[np.ndarray]]] = []  # (file offset, buffers)
        run_end = -1
        for c in sorted(by_chunk):
            offset, nbytes = int(self.offsets[c]), int(self.nbytes[c])
            if offset < 0:
                raise self._never_written(c)
            if nbytes != chunk_bytes:
                raise CacheDamageError(f"{self.path}: chunk {c} has {nbytes} bytes, not {chunk_bytes}")
            for piece, a, b in by_chunk[c]:
                file_offset = offset + (a - c * cr) * rb
                dest = _bytes_of(piece.out)[(a - piece.row0) * rb : (b - piece.row0) * rb]
                if file_offset == run_end:
                    runs[-1][1].append(dest)
                else:
                    runs.append((file_offset, [dest]))
                run_end = file_offset + len(dest)
        for file_offset, buffers in runs:
            for start in range(0, len(buffers), _IOV_MAX):
                batch = buffers[start : start + _IOV_MAX]
                self._preadv(batch, file_offset)
                file_offset += sum(len(b) for b in batch)

    def _read_compressed(
        self, by_chunk: dict[int, list[tuple[Piece, int, int]]], scratch: np.ndarray | None
    ) -> None:
        """One pread and one decode per chunk: straight into the one piece that wants all of it, else into
        ``scratch`` and copied out to each piece."""
        cr, rb = self.fmt.chunk_rows, self.fmt.row_bytes
        chunk_bytes = cr * rb
        for c in sorted(by_chunk):
            offset, nbytes = int(self.offsets[c]), int(self.nbytes[c])
            if offset < 0:
                raise self._never_written(c)
            raw = os.pread(self._fd, nbytes, offset)
            if len(raw) != nbytes:
                raise CacheDamageError(f"{self.path}: chunk {c} is truncated")
            parts = by_chunk[c]
            piece, a, b = parts[0]
            in_place = len(parts) == 1 and b - a == cr  # one piece wants the whole chunk: decode into it
            if in_place:
                target = _bytes_of(piece.out)[(a - piece.row0) * rb : (b - piece.row0) * rb]
            else:
                target = (scratch if scratch is not None else np.empty(chunk_bytes, np.uint8))[:chunk_bytes]
            self._decode(raw, target, c)
            if not in_place:
                for piece, a, b in parts:
                    dest = _bytes_of(piece.out)[(a - piece.row0) * rb : (b - piece.row0) * rb]
                    dest[:] = target[(a - c * cr) * rb : (b - c * cr) * rb]

    def _never_written(self, c: int) -> CacheDamageError:
        return CacheDamageError(f"{self.path}: inner chunk {c} was never written (rows past the data)")

    def _preadv(self, buffers: list[np.ndarray], offset: int) -> None:
        want = sum(b.nbytes for b in buffers)
        if os.preadv(self._fd, buffers, offset) != want:  # type: ignore[arg-type]
            raise CacheDamageError(f"{self.path}: short read at byte {offset} (truncated file)")

    def _decode(self, raw: bytes, target: np.ndarray, chunk: int) -> None:
        assert self.fmt.codec is not None
        try:
            decoded = self.fmt.codec.decode(raw, out=target)
        except Exception as e:  # numcodecs raises RuntimeError/ValueError on corrupt input
            raise CacheDamageError(f"{self.path}: chunk {chunk} does not decode ({e})") from e
        if np.asarray(decoded).nbytes != target.nbytes:
            raise CacheDamageError(f"{self.path}: chunk {chunk} decodes to the wrong size")


_IOV_MAX = 512
"""Buffers per preadv call (Linux allows 1024)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Piece:
    """A request for rows [row0, row1) of one shard file (rows counted from the shard's first row)."""

    row0: int
    row1: int
    out: np.ndarray
    """C-contiguous destination, [row1 - row0, F] or [row1 - row0], of the array's dtype."""


def _bytes_of(array: np.ndarray) -> np.ndarray:
    return array.reshape(-1).view(np.uint8)


def _check_pieces(pieces: Sequence[Piece], shard_rows: int) -> None:
    for piece in pieces:
        assert 0 <= piece.row0 < piece.row1 <= shard_rows, (piece.row0, piece.row1, shard_rows)
        assert piece.out.shape[0] == piece.row1 - piece.row0
        assert piece.out.flags.c_contiguous


def _pieces_by_chunk(pieces: Sequence[Piece], chunk_rows: int) -> dict[int, list[tuple[Piece, int, int]]]:
    """Inner chunk index -> (piece, first row, end row) of each piece overlapping it, in row order."""
    by_chunk: dict[int, list[tuple[Piece, int, int]]] = {}
    for piece in pieces:
        for c in range(piece.row0 // chunk_rows, (piece.row1 - 1) // chunk_rows + 1):
            a, b = max(piece.row0, c * chunk_rows), min(piece.row1, (c + 1) * chunk_rows)
            by_chunk.setdefault(c, []).append((piece, a, b))
    return by_chunk
