"""Write the same records in every container ``--data`` accepts (written by the libraries people use)."""

from __future__ import annotations

import gzip
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CONTAINERS = ("jsonl", "jsonl.gz", "jsonl.zst", "parquet", "parquet-dir", "save_to_disk")


def jsonl_bytes(records: Sequence[Any]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")


def write_container(records: Sequence[dict[str, Any]], kind: str, where: Path, *, stem: str = "d") -> Path:
    """``records`` written as ``kind`` under directory ``where``; the path to pass to ``--data``."""
    where.mkdir(parents=True, exist_ok=True)
    if kind == "jsonl":
        path = where / f"{stem}.jsonl"
        path.write_bytes(jsonl_bytes(records))
    elif kind == "jsonl.gz":
        path = where / f"{stem}.jsonl.gz"
        with gzip.open(path, "wb") as f:
            f.write(jsonl_bytes(records))
    elif kind == "jsonl.zst":
        import zstandard

        path = where / f"{stem}.jsonl.zst"
        path.write_bytes(zstandard.ZstdCompressor(level=3).compress(jsonl_bytes(records)))
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = where / f"{stem}.parquet"
        # Small row groups: the reader must cross row-group boundaries.
        pq.write_table(pa.Table.from_pylist(list(records)), path, row_group_size=3)
    elif kind == "parquet-dir":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = where / stem
        (path / "data").mkdir(parents=True)
        half = (len(records) + 1) // 2
        # Hugging Face hub layout; sorted path order is record order.
        for k, part in enumerate((records[:half], records[half:])):
            pq.write_table(
                pa.Table.from_pylist(list(part)), path / "data" / f"train-{k:05d}-of-00002.parquet"
            )
    elif kind == "save_to_disk":
        import datasets

        path = where / stem
        # Several shards: the reader must follow state.json's file order.
        datasets.Dataset.from_list(list(records)).save_to_disk(str(path), num_shards=2)
    else:
        raise ValueError(kind)
    return path
