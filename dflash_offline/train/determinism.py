"""``--deterministic``: seeds everything and enforces deterministic kernels (a refactor must not
change the loss curve under it). Enforced, not advised: an operation without a deterministic kernel
raises where it runs instead of warning and silently breaking the "same loss curve" promise."""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from dflash_offline.config_fields import flag
from dflash_offline.errors import ConfigError
from dflash_offline.train.config import TrainConfig

CUBLAS_ENV = "CUBLAS_WORKSPACE_CONFIG"
DETERMINISTIC_CUBLAS = (":4096:8", ":16:8")
"""The workspace settings under which cuBLAS is deterministic (CUDA docs, "Results reproducibility")."""


class DeterminismError(ConfigError):
    """``--deterministic`` was asked for where determinism cannot be had."""


def seed_everything(seed: int, *, deterministic: bool) -> None:
    """The one determinism switch: seeds Python, numpy and torch; with ``deterministic``, turns on
    deterministic kernels (no ``warn_only``) and cuBLAS's deterministic workspace, or raises."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if not deterministic:
        return
    cublas = os.environ.setdefault(CUBLAS_ENV, DETERMINISTIC_CUBLAS[0])
    if cublas not in DETERMINISTIC_CUBLAS:
        raise DeterminismError(
            f"{flag(TrainConfig, 'deterministic')}: ${CUBLAS_ENV}={cublas!r} makes cuBLAS non-deterministic; "
            f"unset it or set it to {' or '.join(DETERMINISTIC_CUBLAS)}"
        )
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
