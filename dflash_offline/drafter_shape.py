"""The DFlash drafter's default shape and its bounds: the one home of these numbers, read by the drafter
(``drafter/config.py``) and by ``dflash train``'s options (``train/config.py``). A module of its own
because the drafter package imports torch and ``dflash train --help`` should not."""

from __future__ import annotations

DEFAULT_NUM_LAYERS = 5
"""Drafter decoder layers (docs/drafter.md#defaults)."""

DEFAULT_BLOCK_SIZE = 16
"""Tokens per draft block: the anchor and B − 1 masked slots."""

MIN_BLOCK_SIZE = 2
"""The anchor and one drafted token."""

MAX_BLOCK_SIZE = 128
"""A block is drafted in one forward and its attention holds num_anchors × block_size queries per row
(B × A × (S + A·B) mask entries): DFlash drafters use 8–16; 100,000 would try to allocate terabytes."""

DEFAULT_NUM_ANCHORS = 512
"""Anchors (blocks) per document / microbatch row."""
