"""Writer subprocess for the crash test: a fork server, so that each killed writer is a real process
without paying torch's 2-3 s import each time.

Protocol (one line each way): the test writes ``run CACHE`` on stdin; this process forks a child that
writes samples 0..NUM_SAMPLES-1 of seed SEED into CACHE, skipping committed ids (a resume), and
answers ``pid <pid>``. The test may SIGKILL the child, then writes ``reap``; only then is the child
reaped (so its pid cannot be reused while the test may still signal it), and this process answers
``exit <pid> <status>``: the child's exit code, or -signal when it was killed.
Nothing touches zarr before the fork, so no event-loop thread is inherited.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from dflash_offline.cache.manifest import committed_sample_ids
from dflash_offline.cache.writer import ShardWriter
from tests.cache._samples import make_fingerprint, make_sample

NUM_SAMPLES = 300
SEED = 7
FINGERPRINT = make_fingerprint(codec="blosc-zstd-1-shuffle")


def write(cache: str) -> None:
    """One writer session: resume by skipping every committed sample id."""
    known = committed_sample_ids(cache) if Path(cache, "cache.json").exists() else set()
    with ShardWriter(
        cache,
        FINGERPRINT,
        worker=0,
        flush_seconds=0.05,  # many commits, so kills land between and inside them
        chunk_bytes=256,
        shard_bytes=2048,
        known_sample_ids=known,
    ) as writer:
        for index in range(NUM_SAMPLES):
            sample = make_sample(FINGERPRINT, index, seed=SEED)
            if sample.sample_id not in known:
                writer.add(sample)


def main() -> None:
    for line in sys.stdin:
        command, cache = line.split()
        assert command == "run", command
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            try:
                write(cache)
            except BaseException:
                import traceback

                traceback.print_exc()
                os._exit(1)
            os._exit(0)
        print(f"pid {pid}", flush=True)
        assert sys.stdin.readline().strip() == "reap"
        _, status = os.waitpid(pid, 0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        print(f"exit {pid} {code}", flush=True)


if __name__ == "__main__":
    main()
