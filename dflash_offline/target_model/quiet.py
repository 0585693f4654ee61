"""transformers' log output silenced around the calls that load or run a target (one home for both the
loader and the GGUF weight conversion, which each load through transformers)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' warnings off for the block: the ones it prints on load and on ``generate`` are
    about settings we override on purpose (e.g. top_k under greedy)."""
    from transformers.utils import logging as hf_logging

    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(previous)
