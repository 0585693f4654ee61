"""Whether this process was started by ``torchrun`` (shared by generate and train, which both run
one worker per rank there)."""

from __future__ import annotations

import os


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)
