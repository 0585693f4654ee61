"""``CacheReader``: open a cache by path, list its samples, read many of them concurrently.

Shape legend: N = committed samples, T = tokens of one sample, F = features per token.

The Parquet manifest is the truth (``index.duckdb`` may be stale or absent), so a cache that is still
being written is readable and ``refresh()`` sees newly committed samples. The sample table is loaded
once into numpy columns (no per-sample SQL: a DuckDB point lookup costs ≈ 1 ms: docs/facts.md#duckdb).

A batch read splits every sample's rows at shard-file boundaries, groups the pieces by shard (adjacent
samples share their boundary chunks: each chunk is read and decoded once), and runs one task per shard
file index (features, input_ids and loss_mask together) on a thread pool, the calling thread taking
one itself; ``pread``/``preadv`` and the numcodecs decoders release the GIL. Each sample gets its own
freshly allocated tensors (no hidden views into a shared buffer), unless the caller passes
``features_out`` to have the features packed into its own (e.g. pinned, reused) buffer.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from dflash_offline.cache.checksum import sample_checksum
from dflash_offline.cache.codecs import FeatureStorage
from dflash_offline.cache.fingerprint import CacheFingerprint
from dflash_offline.cache.layout import CacheLayout, read_fingerprint, read_format_version
from dflash_offline.cache.lossy import decode_rows
from dflash_offline.cache.manifest import read_parts
from dflash_offline.cache.rows import CachedSample
from dflash_offline.cache.shard_file import Piece, ShardFile
from dflash_offline.cache.window import retired_in_parts
from dflash_offline.cache.zarr_format import ARRAYS, DTYPES, ArrayFormat, parse_array_format
from dflash_offline.errors import CacheDamageError, SampleError

_SHARD_FILE_CACHE = 768
"""Shard files kept open with their parsed index (one descriptor each; they never change once written)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SampleTable:
    """Columnar numpy view of the committed samples, one entry per distinct sample_id.

    Order: by (source_index, sample_id), a pure function of the committed set (not of which worker or
    session wrote a sample), so that plans built from it are reproducible across world sizes. When a
    sample_id was committed twice (not possible through ``ShardWriter``, but a hand-made cache could),
    the first commit (created_at, shard, row_start) wins, as in ``dflash index``."""

    sample_id: np.ndarray
    """object (str) [N]."""
    source_index: np.ndarray
    """int64 [N]."""
    shard: np.ndarray
    """object (str) [N]: shard group name; the strings are shared with ``shard_names``."""
    shard_code: np.ndarray
    """int32 [N]: index into ``shard_names``."""
    shard_names: tuple[str, ...]
    row_start: np.ndarray
    """int64 [N]: first token row in the shard group."""
    num_tokens: np.ndarray
    """int32 [N]."""
    num_loss_tokens: np.ndarray
    """int32 [N]."""
    bucket_id: np.ndarray
    """int32 [N]."""
    checksum: np.ndarray
    """uint32 [N]: crc32c of features, input_ids, loss_mask bytes."""
    worker: np.ndarray
    """int32 [N]."""
    created_at: np.ndarray
    """datetime64[us] [N] (UTC)."""
    num_duplicates: int
    """Rows dropped because their sample_id was committed earlier."""

    def __len__(self) -> int:
        return int(self.sample_id.shape[0])

    @classmethod
    def from_arrow(cls, samples: pa.Table) -> SampleTable:
        """Build from the concatenated ``samples`` manifest parts."""
        num_duplicates = 0
        if samples.num_rows and pc.count_distinct(samples["sample_id"]).as_py() != samples.num_rows:
            by_commit = samples.sort_by(
                [("created_at", "ascending"), ("shard", "ascending"), ("row_start", "ascending")]
            )
            ids = by_commit["sample_id"].to_numpy(zero_copy_only=False)
            _, first = np.unique(ids, return_index=True)  # stable: the first commit of each id
            num_duplicates = samples.num_rows - len(first)
            samples = by_commit.take(pa.array(np.sort(first)))
        samples = samples.sort_by([("source_index", "ascending"), ("sample_id", "ascending")])
        shard_dict = pc.dictionary_encode(samples["shard"]).combine_chunks()
        shard_names = tuple(shard_dict.dictionary.to_pylist())
        shard_code = shard_dict.indices.to_numpy(zero_copy_only=False).astype(np.int32)
        names_obj = np.empty(len(shard_names), dtype=object)
        names_obj[:] = shard_names

        def col(name: str, dtype: str) -> np.ndarray:
            return samples[name].to_numpy().astype(dtype, copy=False)

        return cls(
            sample_id=samples["sample_id"].to_numpy(zero_copy_only=False).astype(object),
            source_index=col("source_index", "int64"),
            shard=names_obj[shard_code],
            shard_code=shard_code,
            shard_names=shard_names,
            row_start=col("row_start", "int64"),
            num_tokens=col("num_tokens", "int32"),
            num_loss_tokens=col("num_loss_tokens", "int32"),
            bucket_id=col("bucket_id", "int32"),
            checksum=col("checksum", "uint32"),
            worker=col("worker", "int32"),
            created_at=samples["created_at"].cast(pa.timestamp("us")).to_numpy(),
            num_duplicates=num_duplicates,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class DamagedSample:
    """A sample whose stored bytes, read back, fail their checksum or cannot be read at all (a missing
    or truncated shard file, a chunk that does not decode, a zarr.json unlike the writer's)."""

    sample_id: str
    shard: str
    """Shard group name."""
    row_start: int
    problem: str
    """``checksum mismatch (stored 0x…, read 0x…)`` or the decode error."""

    def describe(self) -> str:
        return f"sample {self.sample_id!r} in shard {self.shard} (rows from {self.row_start}): {self.problem}"


def _damage_error(damaged: Sequence[DamagedSample], root: Path) -> CacheDamageError:
    """One line naming the damaged samples (the first few) and their shards."""
    shards = sorted({d.shard for d in damaged})
    more = f"; and {len(damaged) - 3} more" if len(damaged) > 3 else ""
    return CacheDamageError(
        f"{len(damaged)} sample(s) cannot be read: "
        + "; ".join(d.describe() for d in damaged[:3])
        + more
        + f"; run `dflash verify {root}` (shards {', '.join(shards)})"
    )


OnDamaged = Callable[[DamagedSample], None]
"""Called (from a reader thread) for each damaged sample when the caller chose to skip them."""


@dataclass(frozen=True, kw_only=True, slots=True)
class _ReadTarget:
    """Where one ``read_rows`` call puts the stored feature rows, and whether it decodes them."""

    stored: np.ndarray | None = None
    """[sum of T, W] block the samples' stored rows are packed into, in request order; None: a fresh
    array per sample."""
    decode_into: np.ndarray | None = None
    """uint16 [sum of T, F]: where fp8 rows are decoded to bf16 (None: fresh arrays)."""
    device_decode: bool = False
    """fp8 rows stay encoded (``stored_TW``), for a decode on the training device."""


class CacheReader:
    """Reads committed samples of one cache, bit-exactly, many at a time."""

    def __init__(
        self,
        root: str | Path,
        *,
        num_threads: int = 8,
        check_checksums: bool = False,
        on_damaged: OnDamaged | None = None,
        skip_parts: frozenset[Path] = frozenset(),
    ) -> None:
        self.layout = CacheLayout.at(root)
        self.fingerprint: CacheFingerprint = read_fingerprint(root)
        self._legacy_names = read_format_version(root) == 1
        self._skip_parts = skip_parts
        self.storage: FeatureStorage = self.fingerprint.storage
        self.num_threads = max(1, int(num_threads))
        self.check_checksums = check_checksums
        self.on_damaged = on_damaged
        self._pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix="dflash-read")
        self._local = threading.local()
        self._lock = threading.Lock()
        self._formats: dict[str, dict[str, ArrayFormat]] = {}
        self._shard_files: OrderedDict[tuple[str, str, int], ShardFile] = OrderedDict()
        self._parts: dict[Path, pa.Table] = {}
        self._id_order: np.ndarray | None = None
        self.samples: SampleTable = SampleTable.from_arrow(read_parts("samples", []))
        self.refresh()

    @classmethod
    def open(
        cls,
        root: str | Path,
        *,
        num_threads: int = 8,
        check_checksums: bool = False,
        on_damaged: OnDamaged | None = None,
        skip_parts: frozenset[Path] = frozenset(),
    ) -> CacheReader:
        """Open a cache (reads cache.json and the manifest). ``check_checksums`` re-checksums every
        sample read (≈ 12 GB/s a core) and raises ``CacheDamageError`` naming every damaged sample
        of the read; with ``on_damaged`` it instead zeroes a damaged sample's features, ids and loss
        mask (so it carries no loss and no NaN) and reports it through the callback.

        Every manifest part is checked against the sha256 in its name as it is loaded: a damaged one
        raises ``ManifestDamageError`` naming it. ``skip_parts`` leaves parts out (``verify`` and
        ``repair`` pass the damaged ones they report)."""
        return cls(
            root,
            num_threads=num_threads,
            check_checksums=check_checksums,
            on_damaged=on_damaged,
            skip_parts=skip_parts,
        )

    def __enter__(self) -> CacheReader:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def refresh(self) -> None:
        """Re-read the manifest: parts are immutable once renamed, so only new ones are loaded (and
        checked against their sha256)."""
        for path in self.layout.parts("samples"):
            if path not in self._parts and path not in self._skip_parts:
                self._parts[path] = read_parts("samples", [path], legacy_names=self._legacy_names)
        tables = list(self._parts.values())
        merged = pa.concat_tables(tables) if tables else read_parts("samples", [])
        # A retired store's samples are intentionally gone (docs/follow.md): never listed, never read.
        retired = retired_in_parts(
            [p for p in self.layout.parts("retirements") if p not in self._skip_parts],
            legacy_names=self._legacy_names,
        )
        if retired:
            merged = merged.filter(pc.invert(pc.is_in(merged["shard"], pa.array(sorted(retired)))))
        self.samples = SampleTable.from_arrow(merged)
        self._id_order = None

    # ----------------------------------------------------------------------------------------------
    def positions(self, sample_ids: Sequence[str]) -> np.ndarray:
        """int64 positions in ``self.samples`` of the given ids; unknown ids raise ``SampleError``."""
        table = self.samples
        if self._id_order is None:
            self._id_order = np.argsort(table.sample_id, kind="stable")
        sorted_ids = table.sample_id[self._id_order]
        query = np.array(list(sample_ids), dtype=object)
        if len(sorted_ids) == 0:
            if len(query):
                raise SampleError(
                    f"sample {query[0]!r} is not committed in {self.layout.root} (the cache is empty)"
                )
            return np.zeros(0, dtype=np.int64)
        where = np.searchsorted(sorted_ids, query)
        clipped = np.minimum(where, len(sorted_ids) - 1)
        missing = sorted_ids[clipped] != query
        if missing.any():
            bad = query[np.flatnonzero(missing)[0]]
            raise SampleError(f"sample {bad!r} is not committed in {self.layout.root}")
        return self._id_order[clipped].astype(np.int64)

    def read(self, sample_ids: Sequence[str]) -> list[CachedSample]:
        """Read samples by id, in the requested order (repeats allowed)."""
        return self.read_rows(self.positions(sample_ids))

    def read_rows(
        self,
        rows: Sequence[int] | np.ndarray,
        *,
        features_out: np.ndarray | None = None,
        stored_out: np.ndarray | None = None,
    ) -> list[CachedSample]:
        """Read samples by position in ``self.samples`` (the trainer's fast path). Thread-safe.

        ``features_out``: optional C-contiguous uint16 [sum of T, F] array; sample i's features are then
        written to rows [T_0 + ... + T_(i-1), + T_i) of it, in request order, and its ``features_TF``
        is a bf16 view of those rows (saves the packing copy). Lossy (fp8) caches are decoded to bf16
        on the CPU, into it or into fresh arrays.
        ``stored_out``: instead, an array of ``self.storage`` dtype [sum of T, W] that receives the
        stored (still encoded) rows the same way, for a decode on the training device: each sample's
        ``stored_TW`` is a view of its rows and its ``features_TF`` is empty [T, 0]."""
        table = self.samples  # one snapshot even if refresh() runs meanwhile
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= len(table)):
            raise SampleError(f"row {int(rows.max())} out of range: the cache has {len(table)} samples")
        needed = int(table.num_tokens[rows].astype(np.int64).sum())
        self._check_out_arrays(needed, features_out, stored_out)
        try:
            return self._read_checked(table, rows, features_out, stored_out)
        except CacheDamageError:
            if len(rows) == 1 and self.on_damaged is None:
                raise  # its message is about this one sample already
        # Something in the read cannot be read (a missing or truncated file, a chunk that does not
        # decode, a malformed zarr.json, a failed checksum): read the samples one by one to find out
        # which ones it hurts, so that the error (or the skip) names exactly those.
        damaged: list[DamagedSample] = []
        samples = self._read_alone(table, rows, features_out, stored_out, damaged)
        if self.on_damaged is None:
            if damaged:
                raise _damage_error(damaged, self.layout.root)
            return samples  # the damage did not show again
        for d in damaged:
            self.on_damaged(d)
        return samples

    def _read_checked(
        self,
        table: SampleTable,
        rows: np.ndarray,
        features_out: np.ndarray | None,
        stored_out: np.ndarray | None,
    ) -> list[CachedSample]:
        """Read, checksum (when asked) and wrap ``rows``; any damage raises ``CacheDamageError`` (a failed
        checksum too, unless ``on_damaged`` is set: then those samples are zeroed and reported)."""
        needed = int(table.num_tokens[rows].astype(np.int64).sum())
        target = self._read_target(needed, features_out, stored_out)
        outputs, tasks = self._plan_reads(table, rows, target.stored)
        self._run_tasks(tasks)
        if self.check_checksums:
            self._check(table, rows, outputs)
        return self._to_samples(table, rows, outputs, target)

    def _check_out_arrays(
        self, needed: int, features_out: np.ndarray | None, stored_out: np.ndarray | None
    ) -> None:
        """Refuse caller arrays of the wrong dtype, shape or layout for ``needed`` token rows."""
        for name, out, dtype, w in (
            ("features_out", features_out, np.dtype(np.uint16), self.fingerprint.feature_width),
            ("stored_out", stored_out, self.storage.dtype, self.storage.width),
        ):
            if out is not None and (
                out.dtype != dtype
                or out.ndim != 2
                or out.shape[1] != w
                or out.shape[0] < needed
                or not out.flags.c_contiguous
            ):
                raise SampleError(
                    f"{name} must be C-contiguous {dtype} [>= {needed}, {w}], "
                    f"got {out.dtype} {tuple(out.shape)}"
                )
        if features_out is not None and stored_out is not None:
            raise SampleError("pass features_out or stored_out, not both")

    def _read_target(
        self, needed: int, features_out: np.ndarray | None, stored_out: np.ndarray | None
    ) -> _ReadTarget:
        if self.storage.lossy is None:
            return _ReadTarget(stored=features_out if features_out is not None else stored_out)
        if stored_out is not None:
            return _ReadTarget(stored=stored_out, device_decode=True)  # the caller decodes (on its device)
        # The stored rows land in one scratch block, decoded by _to_samples.
        return _ReadTarget(
            stored=np.empty((needed, self.storage.width), dtype=self.storage.dtype), decode_into=features_out
        )

    def _plan_reads(
        self, table: SampleTable, rows: np.ndarray, dest: np.ndarray | None
    ) -> tuple[list[dict[str, np.ndarray]], list[tuple[tuple[str, int], dict[str, list[Piece]]]]]:
        """Each sample's output arrays (features packed into ``dest`` when given), and the read tasks:
        its rows split at shard-file boundaries, grouped by (shard, shard file index)."""
        width = self.fingerprint.feature_width
        outputs = []
        packed = 0
        # (shard, shard index) -> array name -> pieces: one task reads one shard index of all arrays
        work: dict[tuple[str, int], dict[str, list[Piece]]] = {}
        for row in rows.tolist():
            shard = table.shard_names[table.shard_code[row]]
            start, num = int(table.row_start[row]), int(table.num_tokens[row])
            if dest is not None:
                features = dest[packed : packed + num]
                packed += num
            else:
                features = np.empty((num, width), dtype=DTYPES["features"])
            bufs = {
                "features": features,
                "input_ids": np.empty(num, dtype=DTYPES["input_ids"]),
                "loss_mask": np.empty(num, dtype=DTYPES["loss_mask"]),
            }
            outputs.append(bufs)
            shard_rows = self._format(shard, "features").shard_rows
            r = start
            while r < start + num:
                index = r // shard_rows
                stop = min(start + num, (index + 1) * shard_rows)
                task = work.setdefault((shard, index), {name: [] for name in ARRAYS})
                for name in ARRAYS:
                    task[name].append(
                        Piece(
                            row0=r - index * shard_rows,
                            row1=stop - index * shard_rows,
                            out=bufs[name][r - start : stop - start],
                        )
                    )
                r = stop
        return outputs, list(work.items())

    def _to_samples(
        self, table: SampleTable, rows: np.ndarray, outputs: list[dict[str, np.ndarray]], target: _ReadTarget
    ) -> list[CachedSample]:
        """The read arrays as ``CachedSample``s; lossy rows decoded to bf16 here unless the caller decodes."""
        lossy = self.storage.lossy
        samples = []
        packed = 0
        for row, bufs in zip(rows.tolist(), outputs):
            stored_TW = None
            num = int(bufs["input_ids"].shape[0])
            if lossy is None:
                features_TF = torch.from_numpy(bufs["features"]).view(torch.bfloat16)
            elif target.device_decode:
                stored_TW = torch.from_numpy(bufs["features"])
                features_TF = torch.empty((num, 0), dtype=torch.bfloat16)
            else:  # decode the lossy rows to bf16 on the CPU (after the checksum of the stored bytes)
                out_TF = (
                    target.decode_into[packed : packed + num]
                    if target.decode_into is not None
                    else np.empty((num, self.fingerprint.feature_width), dtype=np.uint16)
                )
                features_TF = torch.from_numpy(out_TF).view(torch.bfloat16)
                decode_rows(torch.from_numpy(bufs["features"]), lossy, features_TF)
            packed += num
            samples.append(
                CachedSample(
                    sample_id=str(table.sample_id[row]),
                    input_ids_T=torch.from_numpy(bufs["input_ids"]),
                    loss_mask_T=torch.from_numpy(bufs["loss_mask"]),
                    features_TF=features_TF,
                    bucket_id=int(table.bucket_id[row]),
                    stored_TW=stored_TW,
                )
            )
        return samples

    def _run_tasks(self, tasks: list[tuple[tuple[str, int], dict[str, list[Piece]]]]) -> None:
        # The calling thread takes the first task itself instead of idling while the pool works.
        futures = [self._pool.submit(self._read_task, key, pieces) for key, pieces in tasks[1:]]
        try:
            if tasks:
                self._read_task(*tasks[0])
        finally:
            for future in futures:
                future.result()  # re-raises CacheDamageError from a worker thread

    def _read_alone(
        self,
        table: SampleTable,
        rows: np.ndarray,
        features_out: np.ndarray | None,
        stored_out: np.ndarray | None,
        damaged: list[DamagedSample],
    ) -> list[CachedSample]:
        """``rows`` read one sample at a time; each one that cannot be read is zeroed (features, ids and
        loss mask: it carries no loss and no anchor) and appended to ``damaged``."""
        samples, packed = [], 0
        for row in rows.tolist():
            num = int(table.num_tokens[row])
            f_out = None if features_out is None else features_out[packed : packed + num]
            s_out = None if stored_out is None else stored_out[packed : packed + num]
            packed += num
            try:
                samples.extend(self._read_checked(table, np.array([row], dtype=np.int64), f_out, s_out))
                continue
            except CacheDamageError as e:
                problem = str(e)
            damaged.append(
                DamagedSample(
                    sample_id=str(table.sample_id[row]),
                    shard=str(table.shard[row]),
                    row_start=int(table.row_start[row]),
                    problem=problem,
                )
            )
            samples.append(self._zero_sample(table, row, f_out, s_out))
        return samples

    def _zero_sample(
        self, table: SampleTable, row: int, f_out: np.ndarray | None, s_out: np.ndarray | None
    ) -> CachedSample:
        """A damaged sample's stand-in: all zeros, in the caller's buffer when it gave one."""
        num = int(table.num_tokens[row])
        stored_TW = None
        if s_out is not None:
            s_out[...] = 0
            stored_TW = torch.from_numpy(s_out)
            features_TF = torch.empty((num, 0), dtype=torch.bfloat16)
        else:
            features = np.zeros((num, self.fingerprint.feature_width), np.uint16) if f_out is None else f_out
            features[...] = 0
            features_TF = torch.from_numpy(features).view(torch.bfloat16)
        return CachedSample(
            sample_id=str(table.sample_id[row]),
            input_ids_T=torch.from_numpy(np.zeros(num, dtype=DTYPES["input_ids"])),
            loss_mask_T=torch.from_numpy(np.zeros(num, dtype=DTYPES["loss_mask"])),
            features_TF=features_TF,
            bucket_id=int(table.bucket_id[row]),
            stored_TW=stored_TW,
        )

    def _check(self, table: SampleTable, rows: np.ndarray, outputs: list[dict[str, np.ndarray]]) -> None:
        damaged = []
        for row, bufs in zip(rows.tolist(), outputs):
            crc = sample_checksum(bufs["features"], bufs["input_ids"], bufs["loss_mask"])
            if crc != int(table.checksum[row]):
                damaged.append(
                    DamagedSample(
                        sample_id=str(table.sample_id[row]),
                        shard=str(table.shard[row]),
                        row_start=int(table.row_start[row]),
                        problem=f"checksum mismatch (stored {int(table.checksum[row]):#010x}, "
                        f"read {crc:#010x})",
                    )
                )
                if self.on_damaged is not None:
                    for buf in bufs.values():
                        buf[...] = 0
        if not damaged:
            return
        if self.on_damaged is None:
            raise _damage_error(damaged, self.layout.root)
        for d in damaged:
            self.on_damaged(d)

    # ----------------------------------------------------------------------------------------------
    def use_formats(self, shard: str, formats: dict[str, ArrayFormat]) -> None:
        """Read ``shard`` through these array formats instead of its ``zarr.json`` files (verify and
        repair pass the rebuilt metadata of a group whose ``zarr.json`` is damaged)."""
        self._check_features(shard, formats["features"])
        self._formats[shard] = formats

    def _check_features(self, shard: str, fmt: ArrayFormat) -> None:
        # Damage of this group (its samples cannot be read), not of the cache: verify lists them, train
        # --on-damaged skip skips them.
        if fmt.width != self.storage.width or fmt.dtype != self.storage.dtype:
            raise CacheDamageError(
                f"{self.layout.shard_group(shard)}: features are {fmt.dtype} [{fmt.width}] a token, "
                f"cache.json's codec {self.storage.codec!r} stores {self.storage.dtype} "
                f"[{self.storage.width}]"
            )

    def _format(self, shard: str, name: str) -> ArrayFormat:
        """The shard group's array format; one that does not fit cache.json is damage of that group."""
        formats = self._formats.get(shard)
        if formats is None:
            group = self.layout.shard_group(shard)
            formats = {array: parse_array_format(group / array, array) for array in ARRAYS}
            self._check_features(shard, formats["features"])
            self._formats[shard] = formats
        return formats[name]

    def _shard_file(self, shard: str, name: str, index: int) -> ShardFile:
        key = (shard, name, index)
        with self._lock:
            found = self._shard_files.get(key)
            if found is not None:
                self._shard_files.move_to_end(key)
                return found
        shard_file = ShardFile(self._format(shard, name), index)  # outside the lock: it does I/O
        with self._lock:
            self._shard_files[key] = shard_file
            while len(self._shard_files) > _SHARD_FILE_CACHE:
                self._shard_files.popitem(last=False)
        return shard_file

    def _scratch(self, nbytes: int) -> np.ndarray:
        scratch = getattr(self._local, "scratch", None)
        if scratch is None or scratch.nbytes < nbytes:
            scratch = np.empty(nbytes, dtype=np.uint8)
            self._local.scratch = scratch
        return scratch

    def _read_task(self, key: tuple[str, int], pieces_by_array: dict[str, list[Piece]]) -> None:
        shard, index = key
        for name, pieces in pieces_by_array.items():
            shard_file = self._shard_file(shard, name, index)
            pieces.sort(key=lambda p: p.row0)
            fmt = shard_file.fmt
            shard_file.read_pieces(pieces, self._scratch(fmt.chunk_rows * fmt.row_bytes))
