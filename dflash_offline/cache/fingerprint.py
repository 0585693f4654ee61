"""The run fingerprint stored in ``CACHE/cache.json``: what must match for two runs to share a cache."""

from __future__ import annotations

from dataclasses import Field, dataclass, field, fields
from typing import Any

from dflash_offline.cache.codecs import FeatureStorage, feature_storage
from dflash_offline.errors import CacheFormatError, FingerprintMismatchError

CACHE_FORMAT_VERSION = 3
"""Bump when the on-disk layout changes; readers refuse versions they do not know. Format 2 put the
sha256 of each manifest part's bytes into its name (cache/manifest.py); format 3 stores each sample's
conversation root in its row (``conversation_root``), so that training groups a conversation's samples
without reading the data files again."""
READABLE_FORMAT_VERSIONS = (1, 2, 3)
"""Format 1 caches are still read (and appended to, staying format 1): their manifest parts carry no
sha256, so damage to a part is not detected there. Format 1 and 2 rows have no conversation root (read
as None); a format-1 or 2 cache appended to stays at its format, its new rows carrying their roots."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CacheFingerprint:
    """Everything that determines the bytes a sample is stored as. Two runs may append to one cache
    only when their fingerprints are equal; otherwise the first differing field is named."""

    target_id: str
    """How the target was named: a path, ``default`` or ``random:<preset>``."""
    weights_hash: str
    """Hash of the target's weights (or of the preset and seed for random targets)."""
    num_target_layers: int
    layer_ids: tuple[int, ...]
    """Captured decoder layers, ascending; a feature is the residual stream after that layer."""
    hidden_size: int
    storage_dtype: str
    """``bfloat16`` (stored as uint16 bits)."""
    codec: str
    """Compression codec name (see ``dflash_offline.cache.codecs``)."""
    tokenizer_hash: str
    chat_template_hash: str
    max_length: int
    too_long: str
    """``truncate`` or ``skip``: changes which tokens a sample holds."""
    bucket_edges: tuple[int, ...]
    data_source: str
    """Name of the data source (file name or ``sharegpt-default``); sample ids derive from it."""
    compute_dtype: str
    """The target's compute dtype (``float32`` / ``bfloat16``): it changes the features' bits."""
    storage: FeatureStorage = field(init=False, repr=False, compare=False)
    """``codec`` resolved, once, when the fingerprint is built (``codecs.feature_storage``: the stored
    row's dtype, width and lossy layout, and the codec chain); not stored in cache.json, which names the
    codec. An unknown codec, or a hidden size it cannot store, is refused here."""

    def __post_init__(self) -> None:
        storage = feature_storage(self.codec, num_layers=len(self.layer_ids), hidden_size=self.hidden_size)
        object.__setattr__(self, "storage", storage)  # frozen: set once, here

    @property
    def feature_width(self) -> int:
        return len(self.layer_ids) * self.hidden_size

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {}
        for f in _stored_fields(self):
            value = getattr(self, f.name)
            d[f.name] = list(value) if isinstance(value, tuple) else value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CacheFingerprint:
        names = {f.name for f in _stored_fields(cls)}
        if not isinstance(d, dict):
            raise CacheFormatError(f"its fingerprint is {type(d).__name__}, not an object")
        missing = names - d.keys()
        if missing:
            unknown = sorted(d.keys() - names)
            also = f" (and has unknown fields {unknown})" if unknown else ""
            raise CacheFormatError(f"its fingerprint lacks fields {sorted(missing)}{also}")
        kwargs = {name: d[name] for name in names}
        kwargs["layer_ids"] = tuple(int(i) for i in kwargs["layer_ids"])
        kwargs["bucket_edges"] = tuple(int(e) for e in kwargs["bucket_edges"])
        return cls(**kwargs)

    def first_difference(self, other: CacheFingerprint) -> str | None:
        """Name of the first field whose value differs, or None when the fingerprints are equal."""
        for f in _stored_fields(self):
            if getattr(self, f.name) != getattr(other, f.name):
                return f.name
        return None

    def check_same(self, new: CacheFingerprint) -> None:
        """Raise ``FingerprintMismatchError`` naming the first field where ``new`` differs from ``self``."""
        name = self.first_difference(new)
        if name is not None:
            raise FingerprintMismatchError(name, getattr(self, name), getattr(new, name))


def _stored_fields(of: Any) -> list[Field[Any]]:
    """The fields cache.json stores (``storage`` is derived from them)."""
    return [f for f in fields(of) if f.init]
