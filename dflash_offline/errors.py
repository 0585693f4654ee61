"""The error hierarchy: everything a user, a file or the data can cause is a ``DflashError``.

Each message names the offending value and, where there is one, the fix. ``assert`` is kept for
programmer invariants only. The CLI turns a ``DflashError`` into a one-line message and exit code 1;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path


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


class NoSpaceError(DflashError):
    """The disk filled up while writing; everything committed before stays valid."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        super().__init__(f"no space left on device at {path}; free space and rerun the same command")


_NO_SPACE_TEXT = "No space left on device"
"""How ENOSPC reads inside messages of libraries that do not raise OSError (DuckDB)."""


def find_no_space(exc: BaseException | None) -> tuple[BaseException, str | None] | None:
    """The ENOSPC error in ``exc``'s cause/context chain (and its file name, when it names one)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, NoSpaceError):
            return exc, exc.path
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return exc, None if exc.filename is None else str(exc.filename)
        if _NO_SPACE_TEXT in str(exc):
            return exc, None
        exc = exc.__cause__ or exc.__context__
    return None


_LOW_SPACE_BYTES = 64 << 20
"""Free space below which a failed write is put down to a full disk (torch.save's writer reports a
short write as ``unexpected pos``, without the errno)."""


def is_no_space(error: BaseException, path: Path) -> bool:
    """True when ``error`` (an OSError, or torch's RuntimeError from its zip writer) came from a full
    disk under ``path``."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if _NO_SPACE_TEXT in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    if isinstance(error, OSError | RuntimeError):
        try:
            return shutil.disk_usage(path).free < _LOW_SPACE_BYTES
        except OSError:
            return False
    return False


def as_no_space_error(exc: BaseException, path: str | Path) -> BaseException:
    """``NoSpaceError`` at ``path`` (the directory the user can free space for: the cache, not one
    temp file in it) when ``exc`` is, or was caused by, a full disk; else ``exc`` itself."""
    found = find_no_space(exc)
    if found is None:
        return exc
    return found[0] if isinstance(found[0], NoSpaceError) else NoSpaceError(path)


class DivergedError(DflashError):
    """Training produced a non-finite loss, gradient norm or weight (a NaN or an Inf): the run stopped, or a
    file holding such weights was refused."""
