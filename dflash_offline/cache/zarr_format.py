"""The Zarr v3 metadata of one shard group: create it, parse and validate it, update its shape.

Shape legend: R = token rows of an array, F = features per token (num_layers * hidden_size).

A group ``shards/<shard>.zarr`` holds three arrays along the token axis:
    features  uint16 [R, F]  bf16 bits ("bfloat16" in the attributes), codec from the fingerprint;
              or uint8 [R, W] rows of a lossy codec ("float8_e4m3fn" or "nf4" and the row layout in
              the attributes: fp8.py, nf4.py)
    input_ids int32  [R]     uncompressed
    loss_mask uint8  [R]     uncompressed
Each array uses the ``sharding_indexed`` codec: a shard (one file, ``c/<i>/0`` or ``c/<i>``) holds
``shard_rows`` rows as inner chunks of ``chunk_rows`` rows (one chunk per shard for the 1-D arrays),
with the chunk index at the end of the file. zarr-python creates the metadata; ``shard_file.py`` writes
and reads the shard files themselves; zarr-python and tensorstore read the groups as ordinary Zarr.
Only the layout written here is accepted when reading; anything else is refused (``CacheFormatError``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from zarr.storage import LocalStore

from dflash_offline.cache.codecs import IDS_CODEC, LOSSY_DTYPES, FeatureStorage, codec_spec, make_numcodec
from dflash_offline.cache.layout import write_atomic
from dflash_offline.errors import CacheDamageError, CacheFormatError

ARRAYS = ("features", "input_ids", "loss_mask")
DTYPES: dict[str, np.dtype] = {
    "features": np.dtype("<u2"),
    "input_ids": np.dtype("<i4"),
    "loss_mask": np.dtype("u1"),
}


def create_shard_group(
    group_path: Path,
    *,
    storage: FeatureStorage,
    chunk_rows: int,
    shard_rows: int,
    attributes: dict[str, Any],
) -> dict[str, ArrayFormat]:
    """Create a new, empty shard group (refuses an existing one); returns its arrays' formats."""
    feature_width = storage.width
    assert shard_rows % chunk_rows == 0, (shard_rows, chunk_rows)
    group = zarr.open_group(store=LocalStore(group_path), mode="w-", zarr_format=3, attributes=attributes)
    key_encoding: dict[str, Any] = {"name": "default", "separator": "/"}
    ids_compressors = codec_spec(IDS_CODEC).make_compressors()
    group.create_array(
        "features",
        shape=(0, feature_width),
        dtype=storage.dtype.name,
        chunks=(chunk_rows, feature_width),
        shards=(shard_rows, feature_width),
        compressors=storage.spec.make_compressors(),
        fill_value=0,
        chunk_key_encoding=key_encoding,
        attributes=storage.attributes,
    )
    for name, dtype in (("input_ids", "int32"), ("loss_mask", "uint8")):
        group.create_array(
            name,
            shape=(0,),
            dtype=dtype,
            chunks=(shard_rows,),
            shards=(shard_rows,),
            compressors=ids_compressors,
            fill_value=0,
            chunk_key_encoding=key_encoding,
        )
    return {name: parse_array_format(group_path / name, name) for name in ARRAYS}


def set_num_rows(fmt: ArrayFormat, num_rows: int, *, fsync: bool = False) -> None:
    """Rewrite the array's ``zarr.json`` with ``shape[0] = num_rows`` (temp file + rename), as
    zarr-python's ``resize`` does; other readers use it to bound their reads."""
    meta = json.loads((fmt.path / "zarr.json").read_text())
    meta["shape"][0] = int(num_rows)
    write_atomic(fmt.path / "zarr.json", (json.dumps(meta, indent=2) + "\n").encode(), fsync=fsync)


@dataclass(frozen=True, kw_only=True, slots=True)
class ArrayFormat:
    """How one array of a shard group is laid out on disk (parsed from its ``zarr.json``)."""

    path: Path
    """The array's folder (``.../<shard>.zarr/features``)."""
    name: str
    """``features``, ``input_ids`` or ``loss_mask``."""
    num_rows: int
    """``shape[0]`` in zarr.json: rows the writer had resized to. Not a commit marker
    (docs/cache.md#layout)."""
    width: int
    """F for features, 1 for the 1-D arrays."""
    dtype: np.dtype
    shard_rows: int
    chunk_rows: int
    codec: Any | None
    """numcodecs codec that encodes and decodes one inner chunk, or None when stored uncompressed."""

    @property
    def chunks_per_shard(self) -> int:
        return self.shard_rows // self.chunk_rows

    @property
    def row_bytes(self) -> int:
        return self.width * self.dtype.itemsize

    def shard_path(self, shard_index: int) -> Path:
        suffix = f"c/{shard_index}/0" if self.name == "features" else f"c/{shard_index}"
        return self.path / suffix


def _bad(path: Path, what: str) -> CacheDamageError:
    # Damage, not a format of its own: the samples of this shard group cannot be read, the others can
    # (``dflash verify`` lists them, ``train --on-damaged skip`` skips them).
    return CacheDamageError(f"{path}/zarr.json: {what}; not a shard written by dflash-offline format v1")


def read_meta(path: Path) -> dict[str, Any]:
    """The JSON object in a ``zarr.json`` (``CacheDamageError`` when missing, unreadable or not an object)."""
    try:
        meta = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise CacheDamageError(f"{path} is missing: the shard group is incomplete") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CacheDamageError(f"{path} is not valid JSON ({e})") from e
    if not isinstance(meta, dict):
        raise CacheDamageError(f"{path} is not a JSON object")
    return meta


def parse_array_format(array_dir: Path, name: str) -> ArrayFormat:
    """Parse and validate ``<array_dir>/zarr.json``."""
    return array_format_from_meta(read_meta(array_dir / "zarr.json"), array_dir, name)


def array_format_from_meta(meta: dict[str, Any], array_dir: Path, name: str) -> ArrayFormat:
    """Validate the metadata of the array at ``array_dir`` (as parsed from its ``zarr.json``)."""
    try:
        return _array_format(meta, array_dir, name)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
        if isinstance(e, CacheFormatError):
            raise
        raise _bad(array_dir, f"malformed ({type(e).__name__}: {e})") from e


def _array_format(meta: dict[str, Any], array_dir: Path, name: str) -> ArrayFormat:
    if meta.get("zarr_format") != 3 or meta.get("node_type") != "array":
        raise _bad(array_dir, "not a Zarr v3 array")
    dtype = DTYPES[name]
    if name == "features" and meta.get("attributes", {}).get("dtype") in LOSSY_DTYPES:
        dtype = np.dtype("u1")  # fp8 or nf4 rows; readers check the layout against the fingerprint
    if meta.get("data_type") != dtype.name:
        raise _bad(array_dir, f"data_type {meta.get('data_type')!r}, expected {dtype.name!r}")
    shape = meta["shape"]
    ndim = 2 if name == "features" else 1
    if len(shape) != ndim:
        raise _bad(array_dir, f"shape {shape} has {len(shape)} dimensions, expected {ndim}")
    width = int(shape[1]) if ndim == 2 else 1
    encoding = meta.get("chunk_key_encoding", {})
    if encoding.get("name") != "default" or encoding.get("configuration", {}).get("separator", "/") != "/":
        raise _bad(array_dir, f"chunk_key_encoding {encoding}")
    shard_shape = meta["chunk_grid"]["configuration"]["chunk_shape"]
    codecs = meta.get("codecs", [])
    if len(codecs) != 1 or codecs[0].get("name") != "sharding_indexed":
        raise _bad(array_dir, f"codecs {codecs} (expected one sharding_indexed codec)")
    sharding = codecs[0]["configuration"]
    chunk_shape = sharding["chunk_shape"]
    if ndim == 2 and (shard_shape[1] != width or chunk_shape[1] != width):
        raise _bad(array_dir, f"shards {shard_shape} / chunks {chunk_shape} do not span the {width} features")
    shard_rows, chunk_rows = int(shard_shape[0]), int(chunk_shape[0])
    if shard_rows % chunk_rows:
        raise _bad(array_dir, f"shard rows {shard_rows} not a multiple of chunk rows {chunk_rows}")
    inner = sharding["codecs"]
    # Single-byte dtypes have no endianness, and zarr-python then omits it.
    serializer_ok = inner and inner[0].get("name") == "bytes"
    endian = inner[0].get("configuration", {}).get("endian") if serializer_ok else None
    if not serializer_ok or not (endian == "little" or (endian is None and dtype.itemsize == 1)):
        raise _bad(array_dir, f"inner codecs {inner} (expected little-endian bytes first)")
    index_codecs = [c.get("name") for c in sharding.get("index_codecs", [])]
    if index_codecs != ["bytes", "crc32c"] or sharding.get("index_location", "end") != "end":
        raise _bad(
            array_dir, f"shard index {sharding.get('index_codecs')} at {sharding.get('index_location')}"
        )
    return ArrayFormat(
        path=array_dir,
        name=name,
        num_rows=int(shape[0]),
        width=width,
        dtype=dtype,
        shard_rows=shard_rows,
        chunk_rows=chunk_rows,
        codec=make_numcodec(inner[1:], str(array_dir)),
    )
