"""A worker's device, bound in the worker's own process."""

from __future__ import annotations

from typing import Any

import torch

from dflash_offline.workers.records import WorkerSpec


def bind_device(spec: WorkerSpec[Any]) -> torch.device:
    """``spec``'s device made current on CUDA; on the CPU, its torch thread count (``--threads`` is per
    CPU worker)."""
    device = torch.device(spec.device)
    if device.type == "cuda":
        if device.index is None:  # `--device cuda`: the current device (set_device needs an index)
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    elif spec.cpu_threads is not None:
        torch.set_num_threads(spec.cpu_threads)
    return device
