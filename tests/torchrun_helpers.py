"""Launch ``dflash`` under ``torchrun`` with CPU ranks (gloo) and find one rank's process."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from tests.process_helpers import descendants


def torchrun_cmd(*dflash_args: str, nproc: int = 2) -> list[str]:
    """``python -m torch.distributed.run --standalone`` on a free port, running ``dflash ARGS``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
        "--master-port", str(port), "-m", "dflash_offline", *dflash_args,
    ]  # fmt: skip


def torchrun_env() -> dict[str, str]:
    # One thread per rank: the test machine has few cores and two ranks share them.
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def rank_pid(launcher_pid: int, rank: int) -> int | None:
    """The process of ``rank`` below a torchrun launcher (its environment says RANK=<rank>)."""
    for pid in descendants(launcher_pid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and b"LOCAL_RANK=" + str(rank).encode() in environ:
            return pid
    return None
