"""The keyed hashes of the validation split, in one home: ``dflash train``'s split (train/snapshot.py) and
``dflash generate``'s routing of validation samples into stores of their own under a disk window
(cache/window.py, docs/follow.md) both read a sample's place in [0, 1) here, so the two agree.

A key is 64 bits of a keyed blake2b of a group's name, read as a number in [0, 1): below the validation
fraction, the group is held out. A group is a sample id (``--val-group sample``) or a conversation root
(``--val-group root-id``, and always the routing under a window: ``split_group``)."""

from __future__ import annotations

import hashlib

VALIDATION_SALT = b"dflash-validation-split-v1\x00"
TRAINING_SALT = b"dflash-training-subset-v1\x00"


def validation_key(group: str) -> float:
    """The group's place in [0, 1) in the validation split (its name: a sample id or a root)."""
    return _key(VALIDATION_SALT, group)


def training_key(group: str) -> float:
    """The group's place in [0, 1) in the training order of ``--train-samples`` (``validation_key``'s rule
    under another salt, so the choice does not lean on the validation key)."""
    return _key(TRAINING_SALT, group)


def split_group(*, sample_id: str, conversation_root: str | None) -> str:
    """The group a sample is held out with, whole conversations together: its conversation root
    (``data/sources.py:conversation_root``; ShareGPT's ``X_0`` and ``X_11`` share ``X``), or its own id
    where no root is known."""
    return conversation_root or sample_id


def _key(salt: bytes, group: str) -> float:
    digest = hashlib.blake2b(salt + group.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64
