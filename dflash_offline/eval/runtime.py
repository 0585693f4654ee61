"""Shared by eval and regenerate: device and dtype choice, and the target's end-of-turn ids."""

from __future__ import annotations

from typing import Any

import torch

from dflash_offline.errors import ConfigError
from dflash_offline.target_model.loader import DTYPES, compute_dtype

__all__ = ["DTYPES", "compute_dtype", "resolve_device", "stop_token_ids"]


def resolve_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as e:
        raise ConfigError(f"--device {device!r}: {e}") from e
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: CUDA is not available here; use --device cpu")
    return resolved


def stop_token_ids(tokenizer: Any, model: Any) -> frozenset[int]:
    """End-of-turn ids: the tokenizer's EOS and the generation config's (Qwen3 lists two)."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(gen_eos, int):
        ids.add(gen_eos)
    elif isinstance(gen_eos, list | tuple):
        ids |= {int(i) for i in gen_eos}
    return frozenset(ids)
