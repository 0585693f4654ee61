"""When a writer commits: the one home of the two defaults (plain constants: the CLI imports them
without importing torch). ``ShardWriter`` commits once either threshold is passed."""

from __future__ import annotations

DEFAULT_FLUSH_SECONDS = 10.0
"""Commit at least this often while samples arrive: what a kill can lose on a slow (CPU) worker."""
DEFAULT_FLUSH_BYTES = 1 << 30
"""...or once this many raw bytes wait uncommitted: what a kill can lose on a fast (GPU) worker,
about a second of an H200's 1.3 GB/s of features, while keeping manifest parts to about one a second
and worker (each commit also ends a shard file early: the rest of that shard is never stored)."""
