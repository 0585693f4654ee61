"""crc32c of numpy buffers without copying them.

``google_crc32c.value`` only accepts ``bytes`` (its C entry point parses ``y#``, which refuses numpy
buffers and memoryviews), so checksumming a 40 MB feature block would first copy it at ≈ 1 GB/s. We call
the C library that ships inside the google-crc32c wheel through ctypes instead (≈ 12 GB/s a core on the
development machine, and ctypes releases the GIL during the call). If that library cannot be found (a
differently packaged google-crc32c), we fall back to ``google_crc32c.extend`` on a copy: slower, same
values.

The sample checksum (``SampleRow.checksum``) is crc32c over the raw, uncompressed bytes of the sample's
features as stored (uint16 bits, or the uint8 rows of the fp8 codecs; row-major), then its input_ids
(int32, little-endian), then its loss_mask (uint8).
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable
from pathlib import Path

import google_crc32c
import numpy as np


def _load_extend() -> Callable[[int, np.ndarray], int] | None:
    package_dir = Path(google_crc32c.__file__).resolve().parent
    candidates = sorted((package_dir.parent / "google_crc32c.libs").glob("libcrc32c*"))
    candidates += sorted(package_dir.glob("libcrc32c*"))
    for path in candidates:
        try:
            lib = ctypes.CDLL(str(path))
            fn = lib.crc32c_extend
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_uint32
        fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]

        def extend(crc: int, array: np.ndarray, _fn: ctypes._CFuncPtr = fn) -> int:  # type: ignore[name-defined]
            return int(_fn(crc, array.ctypes.data, array.nbytes))

        return extend
    return None


_EXTEND = _load_extend()
if _EXTEND is None:  # pragma: no cover - depends on how google-crc32c was packaged
    print("dflash: libcrc32c not found next to google_crc32c; checksums copy their input", file=sys.stderr)


def crc32c_extend(crc: int, array: np.ndarray) -> int:
    """Extend ``crc`` with the bytes of a C-contiguous array (any dtype)."""
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    if array.nbytes == 0:
        return crc
    if _EXTEND is not None:
        return _EXTEND(crc, array)
    return int(google_crc32c.extend(crc, array.tobytes()))


def sample_checksum(features_TF: np.ndarray, input_ids_T: np.ndarray, loss_mask_T: np.ndarray) -> int:
    """The stored checksum of one sample: features as stored (uint16 bf16 bits, or uint8 fp8 rows),
    input_ids (int32), loss_mask (uint8)."""
    assert features_TF.dtype in (np.uint16, np.uint8)
    assert input_ids_T.dtype == np.int32
    assert loss_mask_T.dtype == np.uint8
    crc = crc32c_extend(0, features_TF)
    crc = crc32c_extend(crc, input_ids_T.astype("<i4", copy=False))
    return crc32c_extend(crc, loss_mask_T)
