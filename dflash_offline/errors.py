"""The error hierarchy: everything a user, a file or the data can cause is a ``DflashError``.

Each message names the offending value and, where there is one, the fix. ``assert`` is kept for
programmer invariants only. The CLI turns a ``DflashError`` into a one-line message and exit code 2;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class DflashError(ValueError):
    """Base class of every error the user can act on."""


class CacheFormatError(DflashError):
    """A cache on disk is missing, of an unknown format version, or internally inconsistent."""


class CacheDamageError(CacheFormatError):
    """Stored bytes are missing, truncated, fail to decode or fail their checksum (run ``dflash verify``)."""


class FingerprintMismatchError(DflashError):
    """An append or resume was asked with a run fingerprint that differs from the cache's."""

    def __init__(self, field: str, cache_value: object, new_value: object) -> None:
        self.field = field
        self.cache_value = cache_value
        self.new_value = new_value
        super().__init__(
            f"the cache was written with {field}={cache_value!r}, this run has {field}={new_value!r}; "
            f"use the same {field} to resume, or write to a new cache directory"
        )


class SampleError(DflashError):
    """A sample handed to the cache writer is malformed (wrong width, duplicate id, bad dtype)."""


class DataError(DflashError):
    """A data set file or record cannot be read."""


class TargetError(DflashError):
    """A target model specification cannot be resolved or loaded."""


class ConfigError(DflashError):
    """Command-line or config values that do not fit together."""


class ResumeError(DflashError):
    """A checkpoint or planner state cannot be resumed in the current topology."""


class WorkerError(DflashError):
    """A worker thread or process failed; the message carries its traceback."""


class DrafterFormatError(DflashError):
    """An exported drafter directory is missing files, has an unknown layout, or mismatched tensors."""
