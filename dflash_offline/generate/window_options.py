"""The spelling of generate's disk-window sizes (``--window-limit``, ``--store-size``): bytes with a unit."""

from __future__ import annotations

import re

from dflash_offline.errors import ConfigError

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """``"40GB"`` -> 40·10⁹ bytes; ``"512MiB"``, ``"300kB"``, ``"4096"`` (bytes) likewise."""
    match = _SIZE_RE.match(str(text))
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ConfigError(
            f"size {text!r}: give a number of bytes with an optional unit (B, kB, MB, GB, TB, KiB, MiB, GiB, "
            "TiB), e.g. 40GB"
        )
    size = int(float(match.group(1)) * _UNITS[unit])
    if size < 1:
        raise ConfigError(f"size {text!r} is less than one byte; give a positive size, e.g. 40GB")
    return size


def format_size(size: int | None) -> str:
    return "off" if size is None else f"{size}B"
