"""An out-of-memory error of a training step or a validation, turned into one that says which options set a
microbatch's size and what to give instead."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from dflash_offline.config_fields import flag
from dflash_offline.errors import ConfigError
from dflash_offline.placement import DistInfo
from dflash_offline.train.config import TrainConfig


@contextlib.contextmanager
def out_of_memory_named(config: TrainConfig, info: DistInfo, during: str) -> Iterator[None]:
    """An out-of-memory error becomes one that names the options setting a microbatch's size and what to
    give instead: the same tokens and blocks a step in more, smaller microbatches. The defaults on GPUs
    (one microbatch of 32k tokens and 2,048 blocks) need ≈ 6 GiB at SmolLM2 width and ≈ 59 GiB at
    Qwen3-8B width (bench/RESULTS.md)."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        tokens_flag = flag(TrainConfig, "tokens_per_microbatch")
        anchors_flag = flag(TrainConfig, "num_anchors")
        accum_flag = flag(TrainConfig, "grad_accum")
        tokens, anchors, accum = config.tokens_per_microbatch, config.num_anchors, config.grad_accum
        smaller = (
            f"{tokens_flag} {max(2, tokens // 4)} {anchors_flag} {max(1, anchors // 4)} "
            f"{accum_flag} {accum * 4}"
        )
        if config.fuse_microbatches:  # its rows hold the whole step: smaller ones need it off
            smaller += f" without {flag(TrainConfig, 'fuse_microbatches')}"
        said = str(e).splitlines()[0] if str(e) else "out of memory"
        raise ConfigError(
            f"{during} ran out of memory on {info.device} with {tokens_flag} {tokens}, "
            f"{anchors_flag} {anchors} and {accum_flag} {accum}: a microbatch holds too much; start the "
            f"run again with smaller microbatches, e.g. {smaller} (the same tokens and blocks a step; a "
            f"resume keeps {anchors_flag}, so give a new {flag(TrainConfig, 'out_dir')} or "
            f"{flag(TrainConfig, 'resume')} never). The allocator said: {said}"
        ) from None
