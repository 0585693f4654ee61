"""The samples a training run trains and validates on: the index snapshot of the committed samples
when it started (first part), and its split into training and validation samples (second part).

``dflash train`` trains on whatever the cache has committed when it starts, so a cache that a
generate run is still filling (or that was stopped) is usable. The snapshot freezes that set: it is
saved in the run directory, and a resume loads it instead of re-reading the index, so the plan (a pure
function of seed, epoch and snapshot) is the same even if generate has committed samples since.

Samples are kept in a canonical order (sorted by sample id), so the snapshot and every plan built on
it are independent of the order in which the cache's workers committed rows. ``reader_rows_N`` binds
the snapshot to one open ``CacheReader`` (it is never saved: rows may move when the index is rebuilt).

The validation split: samples of a run's snapshot held out of training, chosen by their id (or their
conversation) alone; in a follow segment, by the stores (last part).

A sample is a validation sample when a keyed hash of its group, read as a number in [0, 1), is below
``--val-fraction``; with ``--val-samples N`` the groups of smallest hash are held out, whole, until they
hold at least N samples. A sample's group is its own sample id (``--val-group sample``, the default) or
its conversation root (``--val-group root-id``: ShareGPT's records ``X_0``, ``X_11``, … of one long
conversation are held out together, or trained on together; below). The choice depends on
nothing else (not the seed, the world size, the step or the order of the cache): every resume and every
world size holds out the same samples, and runs over the same cache are validated on the same ones. The
run's training snapshot is the rest; the planner never sees a validation sample. The run writes its split
(``save_run_split``, ``run_split.py``), which ``dflash eval`` reads: the prompts of samples the run did
not train on are held out.

``--train-samples N`` then trains on part of the rest, chosen the same way under a second key (another
salt, so the choice does not lean on the validation key): the groups of smallest training key, whole, until
they hold at least N samples (exactly N with ``--val-group sample``). The validation split is taken first and
does not depend on N; the subset depends only on the ids and groups, so it is the same on every resume and
world size, and a larger N takes a superset of a smaller N's samples (a data-scaling curve compares nested
training sets against one validation split).

Conversation roots (``--val-group root-id``): a format-3 cache stores each sample's root in its row
(``dflash generate`` takes it from the record it parsed, ``data/sources.py:conversation_root``), so the
roots are read from the manifest and the data files are not opened. Rows of a format 1 or 2 cache store
none; for those samples alone the root comes from the data file itself, as before format 3: the files
are those the cache's ``dflash generate`` runs read (their configs are in the cache's runs table,
``data/generate_inputs.py``); every record is parsed as generate parsed it (the same source name, so the
same sample ids) and each sample without a stored root gets ``conversation_root`` of its record. A
sample whose record is in none of those files (the file changed or is gone) is an error: a split that
silently grouped some samples and not others would leak what it is meant to keep apart.

The roots are computed once, when the run starts, and saved beside the snapshot
(``validation_groups.parquet``): a resume reads them back, so it keeps the split even if the data file
has moved since.

A segment of ``dflash train --follow`` (train/follow.py) is split by the stores instead: generate routed
its validation samples, whole conversations, into validation stores (cache/window.py ``routing_key``),
and the follow run wrote the segment's samples of those stores beside its snapshot
(``validation_samples.parquet``, ``save_held_out``). The segment's run holds exactly those out; nothing
is hashed again on the training side, so training and validation are what generate stored, whatever the
run's ``--val-group``.

Shape legend: N = samples in the snapshot.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dflash_offline.config_fields import field_ref
from dflash_offline.errors import CacheFormatError, ConfigError
from dflash_offline.run_split import RunSplit, write_run_split
from dflash_offline.split_key import training_key, validation_key

# ─── The snapshot ───────────────────────────────────────────────────────────────────────────────────────────

SNAPSHOT_FILE = "snapshot.parquet"
"""A run's snapshot, in its run directory."""
SNAPSHOT_FORMAT_VERSION = 1
_META_VERSION = b"dflash_snapshot_version"
_META_ID = b"dflash_snapshot_id"


class _SampleTableLike(Protocol):
    sample_id: Any
    num_tokens: Any
    bucket_id: Any


class _ReaderLike(Protocol):
    @property
    def samples(self) -> Any: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class IndexSnapshot:
    """The committed samples a run trains on, in canonical (sample id) order."""

    sample_ids: tuple[str, ...]
    """[N] sample ids, sorted ascending."""
    num_tokens_N: np.ndarray
    """int64 [N]: tokens of each sample."""
    bucket_ids_N: np.ndarray
    """int64 [N]: bucket of each sample (as stored in the cache)."""
    snapshot_id: str
    """sha256 hex of (sample_id, num_tokens, bucket_id) for every sample: names the set in planner state."""
    reader_rows_N: np.ndarray
    """int64 [N]: row of each sample in the bound reader's SampleTable; -1 when not bound to a reader."""

    def __len__(self) -> int:
        return len(self.sample_ids)

    @property
    def total_tokens(self) -> int:
        return int(self.num_tokens_N.sum())


def compute_snapshot_id(
    sample_ids: tuple[str, ...] | pa.Array, num_tokens_N: np.ndarray, bucket_ids_N: np.ndarray
) -> str:
    """sha256 of the header, then ``f"{sample_id}\t{num_tokens}\t{bucket_id}\n"`` for every sample:
    the lines are built by Arrow in one pass (a Python loop took ≈ 1 s per million samples)."""
    digest = hashlib.sha256()
    digest.update(f"dflash-snapshot-v{SNAPSHOT_FORMAT_VERSION}\n".encode())
    ids = sample_ids if isinstance(sample_ids, pa.Array) else pa.array(list(sample_ids), pa.string())
    if len(ids) != len(num_tokens_N) or len(ids) != len(bucket_ids_N):
        raise CacheFormatError("snapshot columns differ in length")
    if len(ids):
        as_text = [
            ids.cast(pa.large_string()),
            pa.array(np.asarray(num_tokens_N, dtype=np.int64)).cast(pa.large_string()),
            pa.array(np.asarray(bucket_ids_N, dtype=np.int64)).cast(pa.large_string()),
        ]
        lines = pc.binary_join_element_wise(*as_text, pa.scalar("\t", pa.large_string()))
        lines = pc.binary_join_element_wise(
            lines, pa.scalar("", pa.large_string()), pa.scalar("\n", pa.large_string())
        )
        offsets = np.frombuffer(lines.buffers()[1], dtype=np.int64)
        start, end = int(offsets[lines.offset]), int(offsets[lines.offset + len(lines)])
        digest.update(memoryview(lines.buffers()[2])[start:end])
    return digest.hexdigest()


def snapshot_from_columns(
    sample_ids: Any,
    num_tokens: Any,
    bucket_ids: Any,
    reader_rows: Any | None = None,
    *,
    ids_are_str_objects: bool = False,
) -> IndexSnapshot:
    """Build a snapshot from parallel columns in any order (sorted here); ``reader_rows`` binds it.
    ``ids_are_str_objects``: ``sample_ids`` is a 1-D object ndarray of ``str`` (a reader's
    SampleTable), whose objects the snapshot then shares."""
    ids_arrow = _string_array(sample_ids)
    tokens = np.asarray(num_tokens, dtype=np.int64).reshape(-1)
    buckets = np.asarray(bucket_ids, dtype=np.int64).reshape(-1)
    rows = (
        np.full(len(ids_arrow), -1, dtype=np.int64)
        if reader_rows is None
        else np.asarray(reader_rows, dtype=np.int64).reshape(-1)
    )
    if not len(ids_arrow) == len(tokens) == len(buckets) == len(rows):
        raise CacheFormatError(
            f"snapshot columns differ in length: {len(ids_arrow)} ids, {len(tokens)} token counts, "
            f"{len(buckets)} bucket ids, {len(rows)} rows"
        )
    # Arrow sorts UTF-8 bytes, which is code point order, i.e. Python's str order; stable like the
    # numpy argsort it replaces (which compared Python objects: seconds per million ids).
    order = pc.sort_indices(ids_arrow).to_numpy()
    sorted_arrow = ids_arrow.take(pa.array(order))
    if len(sorted_arrow) > 1:
        same = pc.equal(sorted_arrow[1:], sorted_arrow[:-1]).to_numpy(zero_copy_only=False)
        if same.any():
            dup = sorted_arrow[int(np.argmax(same))].as_py()
            raise CacheFormatError(
                f"sample id {dup!r} appears more than once in the index; run `dflash verify`"
            )
    if ids_are_str_objects:
        # Share the caller's str objects: making a million new ones from Arrow took as long as the sort.
        ids_sorted = tuple(sample_ids[order].tolist())
    else:
        ids_sorted = tuple(sorted_arrow.to_numpy(zero_copy_only=False).tolist())
    tokens, buckets, rows = tokens[order], buckets[order], rows[order]
    return IndexSnapshot(
        sample_ids=ids_sorted,
        num_tokens_N=tokens,
        bucket_ids_N=buckets,
        snapshot_id=compute_snapshot_id(sorted_arrow, tokens, buckets),
        reader_rows_N=rows,
    )


def subset_snapshot(snapshot: IndexSnapshot, keep_N: np.ndarray) -> IndexSnapshot:
    """The samples where ``keep_N`` (bool [N]) is True, in the same (canonical) order, with their own
    snapshot id and the same reader binding."""
    positions = np.flatnonzero(keep_N)
    ids = tuple(snapshot.sample_ids[i] for i in positions.tolist())
    tokens, buckets = snapshot.num_tokens_N[positions], snapshot.bucket_ids_N[positions]
    return IndexSnapshot(
        sample_ids=ids,
        num_tokens_N=tokens,
        bucket_ids_N=buckets,
        snapshot_id=compute_snapshot_id(ids, tokens, buckets),
        reader_rows_N=snapshot.reader_rows_N[positions],
    )


def _string_array(values: Any) -> pa.Array:
    """The ids as an Arrow string array (anything else is converted with ``str`` first)."""
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if isinstance(values, pa.Array) and pa.types.is_string(values.type):
        return values
    try:
        return pa.array(values if isinstance(values, np.ndarray) else list(values), pa.string())
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return pa.array([str(v) for v in values], pa.string())


def take_snapshot(reader: _ReaderLike) -> IndexSnapshot:
    """The samples the reader's index has committed now, bound to that reader's rows."""
    table: _SampleTableLike = reader.samples
    num_rows = len(np.asarray(table.num_tokens))
    return snapshot_from_columns(
        table.sample_id,
        table.num_tokens,
        table.bucket_id,
        np.arange(num_rows),
        ids_are_str_objects=isinstance(table.sample_id, np.ndarray) and table.sample_id.dtype == object,
    )


def save_snapshot(snapshot: IndexSnapshot, path: str | os.PathLike[str]) -> None:
    """Write the snapshot as Parquet (temp file, then rename: a crash never leaves half a snapshot)."""
    path = Path(path)
    table = pa.table(
        {
            "sample_id": pa.array(list(snapshot.sample_ids), type=pa.string()),
            "num_tokens": pa.array(snapshot.num_tokens_N, type=pa.int64()),
            "bucket_id": pa.array(snapshot.bucket_ids_N, type=pa.int64()),
        }
    ).replace_schema_metadata(
        {_META_VERSION: str(SNAPSHOT_FORMAT_VERSION).encode(), _META_ID: snapshot.snapshot_id.encode()}
    )
    _write_table_durably(table, path)


def read_snapshot(path: str | os.PathLike[str]) -> IndexSnapshot:
    """Read a saved snapshot, unbound (``reader_rows_N`` = -1); checks its version and its id."""
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowInvalid) as exc:
        raise CacheFormatError(f"cannot read the index snapshot {str(path)!r}: {exc}") from exc
    meta = table.schema.metadata or {}
    version = meta.get(_META_VERSION, b"?").decode()
    if version != str(SNAPSHOT_FORMAT_VERSION):
        raise CacheFormatError(
            f"index snapshot {str(path)!r} has format version {version!r}; this dflash reads "
            f"version {SNAPSHOT_FORMAT_VERSION}: resume with the dflash version that started the run"
        )
    snap = snapshot_from_columns(
        table.column("sample_id"),
        table.column("num_tokens").to_numpy(),
        table.column("bucket_id").to_numpy(),
    )
    stored_id = meta.get(_META_ID, b"").decode()
    if stored_id != snap.snapshot_id:
        raise CacheFormatError(
            f"index snapshot {str(path)!r} is damaged: its content hashes to {snap.snapshot_id[:12]}…, "
            f"its header says {stored_id[:12]}…"
        )
    return snap


def bind_snapshot(snapshot: IndexSnapshot, reader: _ReaderLike) -> IndexSnapshot:
    """The same snapshot with ``reader_rows_N`` pointing into ``reader``'s SampleTable.

    Raises ``CacheFormatError`` when the cache no longer holds a snapshot sample, or holds it with a
    different length or bucket (the cache was rebuilt under the run).
    """
    table: _SampleTableLike = reader.samples
    found = pc.index_in(_string_array(snapshot.sample_ids), value_set=_string_array(table.sample_id))
    rows = found.fill_null(-1).to_numpy().astype(np.int64)
    missing = [snapshot.sample_ids[i] for i in np.flatnonzero(rows < 0)[:1].tolist()]
    num_missing = int((rows < 0).sum())
    if missing:
        raise CacheFormatError(
            f"the cache no longer holds {num_missing} of the run's {len(snapshot)} samples "
            f"(first: {missing[0]!r}); resume against the cache the run started on"
        )
    cache_tokens = np.asarray(table.num_tokens, dtype=np.int64)[rows]
    cache_buckets = np.asarray(table.bucket_id, dtype=np.int64)[rows]
    bad = np.flatnonzero((cache_tokens != snapshot.num_tokens_N) | (cache_buckets != snapshot.bucket_ids_N))
    if bad.size:
        i = int(bad[0])
        raise CacheFormatError(
            f"sample {snapshot.sample_ids[i]!r} has {int(cache_tokens[i])} tokens in bucket "
            f"{int(cache_buckets[i])} in the cache but {int(snapshot.num_tokens_N[i])} tokens in bucket "
            f"{int(snapshot.bucket_ids_N[i])} in the run's snapshot; the cache was rebuilt under the run"
        )
    return IndexSnapshot(
        sample_ids=snapshot.sample_ids,
        num_tokens_N=snapshot.num_tokens_N,
        bucket_ids_N=snapshot.bucket_ids_N,
        snapshot_id=snapshot.snapshot_id,
        reader_rows_N=rows,
    )


def load_snapshot(path: str | os.PathLike[str], reader: _ReaderLike) -> IndexSnapshot:
    """Read the run's saved snapshot and bind it to ``reader`` (see ``bind_snapshot``)."""
    return bind_snapshot(read_snapshot(path), reader)


# ─── The split ──────────────────────────────────────────────────────────────────────────────────────────────

GROUPS_FILE = "validation_groups.parquet"
_GROUPS_META_VERSION = b"dflash_groups_version"
GROUPS_FORMAT_VERSION = 1
HELD_OUT_FILE = "validation_samples.parquet"
"""A follow segment's validation samples: those of its snapshot in validation stores (module docstring)."""
_HELD_OUT_META_VERSION = b"dflash_held_out_version"
HELD_OUT_FORMAT_VERSION = 1


VAL_GROUPS = ("sample", "root-id")
"""``--val-group`` values: what is held out together (module docstring)."""


def _group_names(sample_ids: Sequence[str], groups: Mapping[str, str] | None) -> Sequence[str]:
    """Each sample's group name (its own id when ``groups`` is None)."""
    if groups is None:
        return sample_ids
    missing = [s for s in sample_ids if s not in groups]
    if missing:
        raise CacheFormatError(
            f"{len(missing)} samples of the run (first: {missing[0]!r}) have no validation group; "
            "the run's validation_groups.parquet does not belong to its snapshot"
        )
    return [groups[s] for s in sample_ids]


def _smallest(keys_N: np.ndarray, num_samples: int) -> np.ndarray:
    """bool [N]: the smallest keys up to the ``num_samples``-th sample's, whole groups (a group's samples
    share its key); all of them when there are no more."""
    if num_samples >= len(keys_N):
        return np.ones(len(keys_N), dtype=bool)
    return keys_N <= np.sort(keys_N)[num_samples - 1]


def validation_mask(
    sample_ids: Sequence[str],
    *,
    fraction: float,
    num_samples: int | None,
    groups: Mapping[str, str] | None = None,
) -> np.ndarray:
    """bool [N]: which of ``sample_ids`` are validation samples (module docstring); ``groups`` maps each
    sample id to its group (None: every sample is its own)."""
    names = _group_names(sample_ids, groups)
    keys_N = np.fromiter((validation_key(g) for g in names), dtype=np.float64, count=len(sample_ids))
    if num_samples is None:
        return keys_N < fraction
    return _smallest(keys_N, num_samples)


def training_mask(
    sample_ids: Sequence[str], *, num_samples: int, groups: Mapping[str, str] | None = None
) -> np.ndarray:
    """bool [N]: the ``--train-samples`` subset of ``sample_ids`` (the samples not held out; module
    docstring); refuses ``num_samples`` beyond them."""
    if num_samples > len(sample_ids):
        raise ConfigError(
            f"{field_ref('DataConfig', 'train_samples')} {num_samples} asks for more samples than "
            f"the run has to train on: {len(sample_ids)} (the snapshot's samples less the validation "
            "split); ask for at "
            f"most {len(sample_ids)}, or generate more samples and train into a new run"
        )
    names = _group_names(sample_ids, groups)
    keys_N = np.fromiter((training_key(g) for g in names), dtype=np.float64, count=len(sample_ids))
    return _smallest(keys_N, num_samples)


@dataclass(frozen=True, kw_only=True, slots=True)
class SplitSnapshots:
    """A run's snapshot split in two."""

    train: IndexSnapshot
    """What the planner plans over: the samples not held out (the whole snapshot when nothing is), or their
    ``--train-samples`` subset."""
    validation: IndexSnapshot | None
    """The held-out samples; None when the split is off or empty."""
    num_not_held_out: int
    """How many samples are not held out (``train`` is all of them without ``--train-samples``)."""
    snapshot: IndexSnapshot
    """The whole snapshot that was split."""


def split_snapshot(
    snapshot: IndexSnapshot,
    *,
    fraction: float,
    num_samples: int | None,
    groups: Mapping[str, str] | None = None,
    train_samples: int | None = None,
    held_out: frozenset[str] | None = None,
) -> SplitSnapshots:
    """Split ``snapshot`` (``groups``: sample id → group, None: by sample), then keep ``train_samples`` of
    the rest to train on (None: all); refuses a split that leaves nothing to train on, and more training
    samples than the split leaves. ``held_out``: the validation samples as the stores hold them (a follow
    segment's, ``HELD_OUT_FILE``), taken as they are instead of the hash."""
    if held_out is None:
        mask = _validation_mask(snapshot, fraction=fraction, num_samples=num_samples, groups=groups)
    else:
        mask = np.fromiter((s in held_out for s in snapshot.sample_ids), dtype=bool, count=len(snapshot))
    split = _split_validation(snapshot, mask, fraction=fraction, num_samples=num_samples)
    if train_samples is None:
        return split
    keep = training_mask(split.train.sample_ids, num_samples=train_samples, groups=groups)
    if keep.all():
        return split
    return SplitSnapshots(
        train=subset_snapshot(split.train, keep),
        validation=split.validation,
        num_not_held_out=split.num_not_held_out,
        snapshot=snapshot,
    )


def _validation_mask(
    snapshot: IndexSnapshot, *, fraction: float, num_samples: int | None, groups: Mapping[str, str] | None
) -> np.ndarray | None:
    """bool [N]: the hashed validation split (``validation_mask``); None when nothing is held out."""
    if num_samples is None and fraction <= 0.0:
        return None
    return validation_mask(snapshot.sample_ids, fraction=fraction, num_samples=num_samples, groups=groups)


def _split_validation(
    snapshot: IndexSnapshot, mask: np.ndarray | None, *, fraction: float, num_samples: int | None
) -> SplitSnapshots:
    """The validation split alone (``split_snapshot``): ``mask`` (bool [N]) holds out, None nothing."""
    everything = SplitSnapshots(
        train=snapshot, validation=None, num_not_held_out=len(snapshot), snapshot=snapshot
    )
    if mask is None:
        return everything
    if mask.all():
        what = (
            f"{field_ref('DataConfig', 'val_samples')} {num_samples}"
            if num_samples is not None
            else f"{field_ref('DataConfig', 'val_fraction')} {fraction}"
        )
        raise ConfigError(
            f"{what} holds out all {len(snapshot)} samples of the cache, leaving none to train on: "
            "hold out fewer, or generate more samples"
        )
    if not mask.any():
        return everything
    train = subset_snapshot(snapshot, ~mask)
    return SplitSnapshots(
        train=train,
        validation=subset_snapshot(snapshot, mask),
        num_not_held_out=len(train),
        snapshot=snapshot,
    )


def save_run_split(run_dir: Path, split: SplitSnapshots) -> None:
    """Write the run's split file (``run_split.py``: what ``dflash eval`` reads)."""
    validation = () if split.validation is None else split.validation.sample_ids
    write_run_split(
        run_dir,
        RunSplit.of(
            snapshot_ids=split.snapshot.sample_ids, train=split.train.sample_ids, validation=validation
        ),
    )


# Conversation roots (``--val-group root-id``): module docstring, last part.


def conversation_groups(
    cache_dir: Path, sample_ids: Sequence[str], *, source: str, progress: bool = False
) -> dict[str, str]:
    """Sample id → conversation root for every id of ``sample_ids`` (module docstring); ``source`` is
    the cache's data source name (its fingerprint's)."""
    roots = stored_roots(cache_dir, sample_ids)
    if len(roots) < len(set(sample_ids)):  # rows of a format 1 or 2 cache: no root stored
        unstored = [s for s in sample_ids if s not in roots]
        roots.update(reparsed_roots(cache_dir, unstored, source=source, progress=progress))
    return roots


def stored_roots(cache_dir: Path, sample_ids: Sequence[str]) -> dict[str, str]:
    """Sample id → the conversation root stored in its manifest row, for the ids of ``sample_ids`` whose
    row stores one (every row of a format-3 cache written by ``dflash generate``)."""
    from dflash_offline.cache.manifest import read_table

    wanted = set(sample_ids)
    table = read_table(cache_dir, "samples", ["sample_id", "conversation_root"])
    ids, roots = table.column("sample_id").to_pylist(), table.column("conversation_root").to_pylist()
    return {s: r for s, r in zip(ids, roots, strict=True) if r is not None and s in wanted}


def reparsed_roots(
    cache_dir: Path, sample_ids: Sequence[str], *, source: str, progress: bool = False
) -> dict[str, str]:
    """Sample id → conversation root of each of ``sample_ids``, read from the data files the cache's
    generate runs read (module docstring); refuses samples none of those files holds."""
    from tqdm import tqdm

    from dflash_offline.data.conversations import Conversation
    from dflash_offline.data.generate_inputs import generate_inputs
    from dflash_offline.data.sources import conversation_root, iter_records, resolve_data_path
    from dflash_offline.errors import DataError

    wanted = set(sample_ids)
    roots: dict[str, str] = {}
    inputs = generate_inputs(cache_dir)
    unreadable: list[str] = []
    for item in inputs:
        if len(roots) == len(wanted):
            break
        try:
            resolve_data_path(item.data)
        except DataError as e:
            unreadable.append(f"{item.data or 'the embedded ShareGPT file'} ({e})")
            continue
        name = item.data or "the embedded ShareGPT file"
        bar = tqdm(desc=f"conversation roots: {name}", unit="rec", file=sys.stderr, disable=not progress)
        with bar:
            for record in iter_records(item.data, data_format=item.data_format, source=source):
                bar.update(1)
                if isinstance(record, Conversation) and record.sample_id in wanted:
                    roots[record.sample_id] = conversation_root(record.record_id, record.sample_id)
    missing = len(wanted) - len(roots)
    if missing:
        example = next(s for s in sample_ids if s not in roots)
        read = ", ".join(str(i.data or "default") for i in inputs) or "none (no generate run is recorded)"
        gone = f"; not readable: {'; '.join(unreadable)}" if unreadable else ""
        val_group = field_ref("DataConfig", "val_group")
        raise ConfigError(
            f"{val_group} root-id needs the record id of every sample, read from the data files the "
            f"cache's generate runs read when the cache does not store it (format 1 or 2) ({read}{gone}); "
            f"{missing} of {len(wanted)} samples (first: {example!r}) are in none of them. Put the file "
            f"generate read back in place (unchanged), or use {val_group} sample"
        )
    return roots


def save_groups(groups: Mapping[str, str], path: Path) -> None:
    """Write sample id → root as Parquet (temp file, then rename)."""
    ids = sorted(groups)
    table = pa.table(
        {"sample_id": pa.array(ids, pa.string()), "root": pa.array([groups[s] for s in ids], pa.string())}
    ).replace_schema_metadata({_GROUPS_META_VERSION: str(GROUPS_FORMAT_VERSION).encode()})
    _write_table_durably(table, path)


def read_groups(path: Path) -> dict[str, str]:
    """The saved sample id → root map (``save_groups``)."""
    table = _read_versioned_table(path, "validation groups", _GROUPS_META_VERSION, GROUPS_FORMAT_VERSION)
    return dict(zip(table.column("sample_id").to_pylist(), table.column("root").to_pylist(), strict=True))


# A follow segment's validation samples, as the stores hold them (module docstring, last part).


def save_held_out(sample_ids: Sequence[str], path: Path) -> None:
    """Write the validation sample ids of a follow segment as Parquet (temp file, then rename)."""
    table = pa.table({"sample_id": pa.array(sorted(sample_ids), pa.string())}).replace_schema_metadata(
        {_HELD_OUT_META_VERSION: str(HELD_OUT_FORMAT_VERSION).encode()}
    )
    _write_table_durably(table, path)


def held_out_of_run(run_dir: Path) -> frozenset[str] | None:
    """The validation samples saved in ``run_dir`` (``save_held_out``: a follow segment's run); None in
    any other run, which hashes its split."""
    path = run_dir / HELD_OUT_FILE
    if not path.is_file():
        return None
    table = _read_versioned_table(path, "validation samples", _HELD_OUT_META_VERSION, HELD_OUT_FORMAT_VERSION)
    return frozenset(table.column("sample_id").to_pylist())


def _write_table_durably(table: pa.Table, path: Path) -> None:
    """Write ``table`` as Parquet: a temp file, fsynced, then renamed, so a crash never leaves half a file."""
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _read_versioned_table(path: Path, what: str, key: bytes, version: int) -> pa.Table:
    """The Parquet file of a run's ``what`` (validation groups, samples), refused unless readable and of
    format ``version`` (schema metadata ``key``)."""
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowInvalid) as exc:
        raise CacheFormatError(f"cannot read the {what} {str(path)!r}: {exc}") from exc
    found = (table.schema.metadata or {}).get(key, b"?").decode()
    if found != str(version):
        raise CacheFormatError(
            f"{what} {str(path)!r} have format version {found!r}; this dflash reads version {version}: "
            "resume with the dflash version that started the run"
        )
    return table
