"""Check that an output path can be written before the work that fills it starts.

A run that writes its result at the end (``dflash eval --json``) or creates its directory first
(``generate --cache``, ``train --out``, ``export --out``, ``regenerate --out``) should fail in one line
naming the path when it cannot write there (a read-only file system, a path under a file, ``/proc``),
not with a traceback, and not after the whole evaluation ran. The check creates (and removes) one
small file in the output's nearest existing folder, so it also catches what mode bits do not say
(read-only mounts, root on NFS, special file systems); it creates no folder itself.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from dflash_offline.errors import DflashError


class OutputPathError(DflashError):
    """An output path cannot be created or written."""


_PROBE_PREFIX = ".dflash-write-check-"


def check_writable_dir(path: str | Path, *, option: str) -> None:
    """``path`` is (or can be created as) a folder this process can write files into."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputPathError(f"{option} {path}: exists and is not a directory")
    _probe(path if path.is_dir() else _nearest_existing(path, option=option), path, option=option)


def check_writable_file(path: str | Path, *, option: str) -> None:
    """``path`` is a file this process can write (or create, its folders included)."""
    path = Path(path)
    if path.is_dir():
        raise OutputPathError(f"{option} {path}: is a directory; name a file")
    if path.exists() and not os.access(path, os.W_OK):
        raise OutputPathError(f"{option} {path}: the file is not writable")
    parent = path.parent if path.parent.is_dir() else _nearest_existing(path.parent, option=option)
    _probe(parent, path, option=option)


def _nearest_existing(path: Path, *, option: str) -> Path:
    """The nearest folder above ``path`` that exists (a file there is an error naming it)."""
    for ancestor in path.absolute().parents:
        if ancestor.exists():
            if not ancestor.is_dir():
                raise OutputPathError(f"{option} {path}: {ancestor} is a file, not a directory")
            return ancestor
    raise OutputPathError(f"{option} {path}: no folder above it exists")  # pragma: no cover - / exists


def _probe(folder: Path, path: Path, *, option: str) -> None:
    try:
        fd, name = tempfile.mkstemp(prefix=_PROBE_PREFIX, dir=folder)
    except OSError as e:
        where = "" if folder == path else f" (in {folder})"
        raise OutputPathError(f"{option} {path}: cannot write there{where}: {e.strerror}") from None
    os.close(fd)
    os.unlink(name)
