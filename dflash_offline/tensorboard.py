"""TensorBoard event files (an optional extra, never required): whether they can be written, and the writer.

Written with ``torch.utils.tensorboard.SummaryWriter``, which needs the ``tensorboard`` package:
``pip install 'dflash-offline[tensorboard]'``. What goes into them is written where the values live:
training's per-step tags beside ``StepMetrics`` (``train/metrics.py``: the very values of
``metrics.jsonl``), the eval τ table beside ``EvalReport`` (``eval/report.py``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from dflash_offline.errors import ConfigError

INSTALL_HINT = "pip install 'dflash-offline[tensorboard]'"


def tensorboard_available() -> bool:
    """Whether ``torch.utils.tensorboard`` can write (the ``tensorboard`` package is importable)."""
    return importlib.util.find_spec("tensorboard") is not None


def require_tensorboard(flag: str = "--tensorboard") -> None:
    """Fail before any work when event files are asked for and cannot be written."""
    if not tensorboard_available():
        raise ConfigError(f"{flag} needs the tensorboard package: {INSTALL_HINT}")


def open_writer(log_dir: Path, *, purge_step: int | None = None) -> Any:
    """A ``SummaryWriter`` on ``log_dir``. ``purge_step``: hide events of earlier runs at steps >= it
    (a resumed run rewrites the steps after its checkpoint, as ``metrics.jsonl`` does)."""
    require_tensorboard()
    from torch.utils.tensorboard import SummaryWriter

    log_dir.mkdir(parents=True, exist_ok=True)
    return SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)
