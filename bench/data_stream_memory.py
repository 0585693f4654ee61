"""Peak RSS while streaming ~1 GiB of JSONL through ``iter_records``, compressed with zstd or gzip.

    python bench/data_stream_memory.py zst|gz [DIR]

Writes DIR/big.jsonl.<kind> once (16,558 records of ~64 KiB: very compressible), then reads it in this
process and prints the records, the compressed size, peak RSS before and after, and the seconds.
"""

import gzip
import json
import resource
import sys
import time
from pathlib import Path

import zstandard

from dflash_offline.data.sources import iter_records

kind = sys.argv[1]
where = Path(sys.argv[2]) if len(sys.argv) > 2 else Path("/tmp")
path = where / f"big.jsonl.{kind}"
filler = "lorem ipsum dolor sit amet " * 2400
total = 0
if not path.exists():
    with open(path, "wb") as raw:
        w = (
            zstandard.ZstdCompressor(level=1).stream_writer(raw)
            if kind == "zst"
            else gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=1)
        )
        with w:
            i = 0
            while total < 1 << 30:
                line = (json.dumps({"id": i, "prompt": f"q{i}", "response": filler}) + "\n").encode()
                w.write(line)
                total += len(line)
                i += 1
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.perf_counter()
n = sum(1 for _ in iter_records(path))
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(
    f"{kind}: {n} records, {path.stat().st_size / 2**20:.1f} MiB compressed, peak RSS "
    f"{before / 1024:.0f} -> {after / 1024:.0f} MiB, {time.perf_counter() - t:.1f} s"
)
