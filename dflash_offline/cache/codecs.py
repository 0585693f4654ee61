"""Compression codecs a cache can store features with, by the name recorded in the fingerprint.

A codec name maps to the Zarr v3 codec chain declared in each array's ``zarr.json`` (built with
zarr-python's codec classes); ``make_numcodec`` turns that declaration back into the numcodecs codec that
encodes (writer) and decodes (reader) one inner chunk with exactly those parameters. Every codec here is
lossless and readable by zarr-python and tensorstore alike (tensorstore cannot read ``numcodecs.shuffle``,
so byte-shuffling goes through blosc).
``input_ids`` and ``loss_mask`` are always stored uncompressed, whatever the feature codec: they are 5 bytes
a token against 2 × F for the features (< 0.1 %), and reading them raw avoids decoding a whole shard's
ids for every sample read.

Measured by ``bench/cache_io.py`` (2-core development machine, page cache warm), stored/raw of real
SmolLM2-135M features (layers 1, 8, 14, 20, 27; 11k ShareGPT tokens; order-0 byte entropy 0.696):
none 1.00, zstd-1 0.81, blosc-zstd-1-shuffle 0.70, blosc-lz4-bitshuffle 0.85. Random reads, 5×576 and
5×4096 wide: none 8.9–9.9 GB/s (2.3–2.7× per-sample torch.load, 0.9–1.0× raw pread), the compressed
codecs 1.2–2.8 GB/s (decode-bound: about 1 GB/s a core); writes: none 1.0–1.1× torch.save,
blosc-zstd-1-shuffle ≈ 0.45× (compression-bound on 2 cores).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from dflash_offline.errors import CacheFormatError

if TYPE_CHECKING:
    from dflash_offline.cache.lossy import LossyLayout

MIB = 1 << 20


@dataclass(frozen=True, kw_only=True, slots=True)
class CodecSpec:
    """One named compression scheme for the feature array."""

    name: str
    """Name stored in ``CacheFingerprint.codec`` and the ``shards`` table."""
    description: str
    """One line for ``--help`` and reports."""
    make_compressors: Callable[[], tuple[Any, ...]]
    """Builds the zarr-python ``BytesBytesCodec`` chain applied after the ``bytes`` serializer."""
    fp8: Fp8Scheme | None = None
    """For the lossy fp8 codecs: how features are quantised before the lossless chain (``fp8.py``)."""
    nf4: Nf4Scheme | None = None
    """For the lossy nf4 codecs: how features are quantised before the lossless chain (``nf4.py``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Fp8Scheme:
    """The scaling granularity of an fp8 codec (resolved against the hidden size by ``feature_storage``)."""

    group_dims: int | None
    """Dims per scale; None = one scale per (token, layer)."""
    num_outliers: int
    """Largest-|x| dims of each (token, layer) stored exactly as bf16."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Nf4Scheme:
    """The scaling granularity of an nf4 codec (``nf4.py``)."""

    group_dims: int
    """Dims per power-of-two scale."""
    num_outliers: int
    """Largest-|x| dims of each (token, layer) stored exactly as bf16."""


def _none() -> tuple[Any, ...]:
    return ()


def _zstd1() -> tuple[Any, ...]:
    from zarr.codecs import ZstdCodec

    return (ZstdCodec(level=1),)


def _blosc_zstd1_shuffle() -> tuple[Any, ...]:
    from zarr.codecs import BloscCodec

    # 1 MiB blocks: blosc's default block size splits a chunk into small blocks that compress to
    # ≈ 1.29× instead of ≈ 1.45× on real features (docs/facts.md#compression).
    return (BloscCodec(cname="zstd", clevel=1, shuffle="shuffle", typesize=2, blocksize=MIB),)


def _blosc_lz4_bitshuffle() -> tuple[Any, ...]:
    from zarr.codecs import BloscCodec

    return (BloscCodec(cname="lz4", clevel=5, shuffle="bitshuffle", typesize=2, blocksize=0),)


CODECS: dict[str, CodecSpec] = {
    spec.name: spec
    for spec in (
        CodecSpec(name="none", description="uncompressed uint16 bits", make_compressors=_none),
        CodecSpec(name="zstd-1", description="zstd level 1", make_compressors=_zstd1),
        CodecSpec(
            name="blosc-zstd-1-shuffle",
            description="blosc: zstd level 1, byte-shuffle, 1 MiB blocks",
            make_compressors=_blosc_zstd1_shuffle,
        ),
        CodecSpec(
            name="blosc-lz4-bitshuffle",
            description="blosc: lz4 level 5, bit-shuffle",
            make_compressors=_blosc_lz4_bitshuffle,
        ),
    )
}

FP8_SCHEME = Fp8Scheme(group_dims=None, num_outliers=2)
"""Chosen by ``bench/fp8_error.py`` on real SmolLM2 features (bench/RESULTS.md, "fp8 scaling"): the
non-outlier dims lose the same ≈ 2.6 % (e4m3's 3 mantissa bits) whatever the scale granularity, since
e4m3 spans 2^17.8 and a scale set by |x| ≈ 24,800 keeps |x| ≥ 1 normal; what the outliers buy is the
massive activations themselves, exact: layer-14..27 error 1.1–1.3 % → 0.35–0.9 % with 2 of them
(0.43–0.97 % with 1, 0.30–0.84 % with 4), at 0.0034 of raw each. Two cover dims 507 and 247."""

CODECS["fp8"] = CodecSpec(
    name="fp8",
    description="lossy: float8 e4m3, a power-of-two scale per (token, layer), 2 outliers kept as bf16",
    make_compressors=_none,
    fp8=FP8_SCHEME,
)
CODECS["fp8-zstd-1"] = CodecSpec(
    name="fp8-zstd-1",
    description="fp8, then zstd level 1 over each 1 MiB chunk",
    make_compressors=_zstd1,
    fp8=FP8_SCHEME,
)

NF4_SCHEME = Nf4Scheme(group_dims=32, num_outliers=2)
"""Chosen by ``bench/fp8_error.py --format nf4`` on 54.8k tokens of real SmolLM2 features (``nf4.py``): a
scale (one int8 exponent) per 32 dims costs 1/64 of raw and 2 outliers 4 · 2 bytes a (token, layer):
0.273 of raw at hidden 576 (1,570 B a token; 1,573 on disk over 10.3M tokens), 0.267 at 4,096. Relative
error, layers 1/8/14/20/27: .111 .096 .019 .025 .042; 64-dim groups .130 .113 .023 .030 .048 (0.265),
no outliers .160 .153 .056 .060 .086 (0.266), 4 outliers .091 .078 .015 .019 .036 at 0.2795, which
leaves no margin under 0.28 for the shard files' own bytes. 16-dim groups would cost 0.29 at 576."""

CODECS["nf4"] = CodecSpec(
    name="nf4",
    description="lossy: nf4, a power-of-two scale per 32 dims, 2 outliers a layer kept as bf16",
    make_compressors=_none,
    nf4=NF4_SCHEME,
)
CODECS["nf4-zstd-1"] = CodecSpec(
    name="nf4-zstd-1",
    description="nf4, then zstd level 1 over each 1 MiB chunk",
    make_compressors=_zstd1,
    nf4=NF4_SCHEME,
)

DEFAULT_CODEC = "blosc-zstd-1-shuffle"
"""The only candidate within the ≤ 0.72 × raw goal on real features (0.70). It buys 30 % less disk and
1.4× the effective bandwidth where generate and cold reads are disk-bound (docs/facts.md#generate), for
decode CPU (≈ 1 GB/s a core). Choose ``none`` for a cache that fits in the page cache on a machine short of
cores: its warm random reads are 4–5× faster there."""

IDS_CODEC = "none"
"""Codec of the ``input_ids`` and ``loss_mask`` arrays."""


def codec_spec(name: str) -> CodecSpec:
    """The spec of a codec name; unknown names raise ``CacheFormatError`` listing the known ones."""
    spec = CODECS.get(name)
    if spec is None:
        raise CacheFormatError(f"unknown feature codec {name!r}; known codecs: {', '.join(CODECS)}")
    return spec


@dataclass(frozen=True, kw_only=True, slots=True)
class FeatureStorage:
    """How one token's features are stored under a fingerprint's codec: the codec resolved once, when the
    fingerprint is built (``CacheFingerprint.storage``); writers, readers, the prefetcher and verify read
    it there instead of looking the codec's name up again."""

    codec: str
    """The codec's name (``CacheFingerprint.codec``)."""
    spec: CodecSpec
    """What the name stands for: the lossless chain (``make_compressors``) and the lossy scheme, if any."""
    dtype: np.dtype
    """uint16 (bf16 bits) or uint8 (the rows of a lossy codec)."""
    width: int
    """Stored elements per token: F for bf16, the lossy row's bytes W otherwise."""
    attributes: dict[str, Any]
    """Attributes of the feature array (what the bytes mean)."""
    lossy: LossyLayout | None
    """The row layout of a lossy codec (fp8 or nf4: ``cache/lossy.py``), None for the lossless codecs."""

    @property
    def storage_dtype(self) -> str:
        """``CacheFingerprint.storage_dtype`` that goes with the codec (``storage_dtype``)."""
        return str(self.attributes["dtype"])

    @property
    def row_bytes(self) -> int:
        return self.width * self.dtype.itemsize

    @property
    def token_bytes(self) -> int:
        """Bytes one token occupies in the shards before compression: features, id and loss mask."""
        return self.row_bytes + ID_AND_MASK_BYTES


ID_AND_MASK_BYTES = 4 + 1
"""Per-token bytes of the 1-D shard arrays: int32 ``input_ids`` and uint8 ``loss_mask``."""


def raw_token_bytes(feature_width: int) -> int:
    """Uncompressed bytes one token stands for: its bf16 features plus its id and loss mask (the
    ``raw_bytes`` of writer stats and ``dflash status``, whatever the codec)."""
    return feature_width * 2 + ID_AND_MASK_BYTES


LOSSY_DTYPES = ("float8_e4m3fn", "nf4")
"""``storage_dtype`` of the lossy codecs: their feature arrays hold uint8 rows."""


def storage_dtype(codec: str) -> str:
    """``CacheFingerprint.storage_dtype`` for a codec name."""
    spec = codec_spec(codec)
    if spec.fp8 is not None:
        return "float8_e4m3fn"
    return "nf4" if spec.nf4 is not None else "bfloat16"


def feature_storage(codec: str, *, num_layers: int, hidden_size: int) -> FeatureStorage:
    """The stored row format of a codec for features of ``num_layers`` × ``hidden_size`` (a cache's is
    ``CacheFingerprint.storage``); unknown names and sizes the codec cannot store raise
    ``CacheFormatError``."""
    spec = codec_spec(codec)
    scheme = spec.fp8 or spec.nf4
    if scheme is None:
        width = num_layers * hidden_size
        return FeatureStorage(
            codec=codec,
            spec=spec,
            dtype=np.dtype("<u2"),
            width=width,
            attributes={"dtype": "bfloat16", "codec": codec},
            lossy=None,
        )
    from dflash_offline.cache.fp8 import Fp8Layout
    from dflash_offline.cache.nf4 import Nf4Layout

    group = scheme.group_dims or hidden_size
    if hidden_size % group:
        raise CacheFormatError(
            f"codec {codec!r}: scale groups of {group} dims do not divide the hidden size {hidden_size}"
        )
    kind = "fp8" if spec.fp8 is not None else "nf4"
    make = Fp8Layout if kind == "fp8" else Nf4Layout
    layout = make(
        num_layers=num_layers, hidden_size=hidden_size, group_dims=group, num_outliers=scheme.num_outliers
    )
    return FeatureStorage(
        codec=codec,
        spec=spec,
        dtype=np.dtype("u1"),
        width=layout.row_bytes,
        attributes={"dtype": storage_dtype(codec), "codec": codec, kind: layout.to_attributes()},
        lossy=layout,
    )


_BLOSC_SHUFFLE = {"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}


def make_numcodec(codec_json: list[dict[str, Any]], where: str) -> Any | None:
    """The numcodecs codec equivalent to the bytes-to-bytes part of an inner chunk's codec chain as
    written in ``zarr.json`` (after the ``bytes`` serializer), with the same parameters, so that it
    both decodes what zarr-python wrote and encodes what zarr-python and tensorstore read; None for
    uncompressed chunks. Only the chains this module writes are accepted: anything else is refused
    rather than misread."""
    import numcodecs

    if not codec_json:
        return None
    if len(codec_json) == 1:
        name = codec_json[0].get("name")
        config = codec_json[0].get("configuration", {})
        if name == "zstd":
            return numcodecs.Zstd(
                level=int(config.get("level", 0)), checksum=bool(config.get("checksum", False))
            )
        if name == "blosc" and config.get("shuffle", "noshuffle") in _BLOSC_SHUFFLE:
            return numcodecs.Blosc(
                cname=str(config.get("cname", "zstd")),
                clevel=int(config.get("clevel", 5)),
                shuffle=_BLOSC_SHUFFLE[config.get("shuffle", "noshuffle")],
                blocksize=int(config.get("blocksize", 0)),
            )
    raise CacheFormatError(
        f"{where}: unsupported inner codec chain {codec_json!r}; this version reads "
        f"uncompressed, zstd and blosc chunks only (was the store written by another tool?)"
    )
