"""Host values to the device without waiting for the device.

On CUDA a copy from ordinary (pageable) host memory may wait for the work already queued on the stream;
the engine queues a decode step and then builds the next prefill forward on the host while the device
runs it (``DecodeEngine._launch``), so such a copy would put the two back in sequence. Through pinned memory
the copy is queued like a kernel and the host goes on; PyTorch's pinned allocator keeps the buffer until
the copy has run. On the CPU a plain copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def to_device(host: Tensor, device: torch.device) -> Tensor:
    """``host`` (a CPU tensor) on ``device``, queued without a host wait on CUDA."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def int64_on(values: Sequence[int] | Sequence[Sequence[int]], device: torch.device) -> Tensor:
    """int64 ``values`` on ``device`` (``to_device``)."""
    return to_device(torch.tensor(values, dtype=torch.int64), device)


def copy_into(dst: Tensor, host: Tensor) -> None:
    """Fill the device tensor ``dst`` from ``host`` (a CPU tensor of its shape), queued without a host
    wait on CUDA."""
    if dst.device.type != "cuda":
        dst.copy_(host)
        return
    dst.copy_(host.pin_memory(), non_blocking=True)
