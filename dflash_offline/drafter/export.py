"""Export a drafter in z-lab's DFlash layout, and load that layout back (docs/drafter.md#export-layout).

A directory with
  config.json        Qwen3 fields (model_type "qwen3", width, heads, head_dim, MLP, eps, RoPE, vocab,
                     num_hidden_layers, full attention everywhere) plus ``architectures:
                     ["DFlashDraftModel"]``, ``block_size``, ``num_target_layers`` and ``dflash_config:
                     {mask_token_id, target_layer_ids}``; our own training settings sit under
                     ``dflash_offline`` (format version, γ, anchors), which other loaders ignore.
  model.safetensors  ``layers.N.self_attn.{q,k,v,o}_proj.weight``,
                     ``layers.N.self_attn.{q,k}_norm.weight``, ``layers.N.mlp.{gate,up,down}_proj.weight``,
                     ``layers.N.{input,post_attention}_layernorm.weight``, ``fc.weight``,
                     ``hidden_norm.weight``, ``norm.weight``: no embedding, no LM head (the target's).
  README.md          the model card (``model_card.py``), when the caller gives one (``dflash export``).

What the serving engines read of it (their loaders' contracts are pinned, with the upstream files, in
tests/drafter/test_export_consumers.py): vLLM maps ``DFlashDraftModel`` to its Qwen3 DFlash drafter,
sizes ``fc`` from ``dflash_config.target_layer_ids`` (which it shifts by one to its own capture points;
an ``eagle_aux_hidden_state_layer_ids`` key would override them, so the export has none) and takes the
mask id from ``dflash_config.mask_token_id``; full-attention ``layer_types`` make its drafter
non-causal. SGLang reads the same fields plus ``num_target_layers`` and ``block_size``. llama.cpp's GGUF
converter needs ``block_size`` at the top level. All three load ``layers.*``, ``fc``, ``hidden_norm`` and
``norm`` under exactly these names and share the target's embedding and LM head when the file has none.

z-lab's published configs also carry ``auto_map`` pointing at their own ``dflash.py``; we ship no
modelling code, so the export has none (SGLang/vLLM dispatch on ``architectures``). The loader reads
z-lab's published drafters too (``block_size``/``num_target_layers`` at the top level or inside
``dflash_config``; ``rope_theta`` at the top level or in ``rope_parameters``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from dflash_offline.drafter.config import DEFAULT_NUM_ANCHORS, DrafterConfig
from dflash_offline.drafter.model import DFlashDrafter
from dflash_offline.errors import ConfigError, DivergedError, DrafterFormatError

EXPORT_FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
README_FILE = "README.md"
ARCHITECTURE = "DFlashDraftModel"

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_DFLASH_FIELDS = ("block_size", "num_target_layers", "mask_token_id", "target_layer_ids")
"""The fields read from ``dflash_config`` or, failing that, the top level."""


def zlab_config(config: DrafterConfig, *, dtype: torch.dtype) -> dict[str, Any]:
    """The ``config.json`` dict of an export."""
    L = config.num_layers
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "num_hidden_layers": L,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_theta": config.rope_theta, "rope_type": "default"},
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": L,
        "layer_types": ["full_attention"] * L,
        "initializer_range": config.initializer_range,
        "torch_dtype": _DTYPE_NAMES[dtype],
        "dtype": _DTYPE_NAMES[dtype],
        "block_size": config.block_size,
        "num_target_layers": config.num_target_layers,
        "dflash_config": {
            "mask_token_id": config.mask_token_id,
            "target_layer_ids": list(config.target_layer_ids),
        },
        "dflash_offline": {
            "format_version": EXPORT_FORMAT_VERSION,
            "loss_gamma": config.gamma,
            "num_anchors": config.num_anchors,
        },
    }


def _field(
    data: dict[str, Any], name: str, kinds: tuple[type, ...], what: str, *, default: Any = None
) -> Any:
    """``data[name]`` when it is one of ``kinds`` (never a bool), ``default`` when absent or null;
    ``DrafterFormatError`` naming the field otherwise."""
    value = data.get(name)
    if value is None:
        if default is None:
            raise DrafterFormatError(f"has no {name}")
        return default
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise DrafterFormatError(f"{name}={value!r} is not {what}")
    return value


def _int(data: dict[str, Any], name: str, *, default: int | None = None) -> int:
    return int(_field(data, name, (int,), "an integer", default=default))


def _float(data: dict[str, Any], name: str, *, default: float | None = None) -> float:
    return float(_field(data, name, (int, float), "a number", default=default))


def _dict(data: dict[str, Any], name: str) -> dict[str, Any]:
    """``data[name]`` as a dict ({} when absent or null)."""
    return dict(_field(data, name, (dict,), "an object", default={}))


def _int_list(data: dict[str, Any], name: str) -> tuple[int, ...]:
    values = _field(data, name, (list,), "a list of integers")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise DrafterFormatError(f"{name}={values!r} is not a list of integers")
    return tuple(values)


def config_from_zlab(data: Any) -> DrafterConfig:
    """Parse an export's (or a z-lab drafter's) ``config.json`` value: ``DrafterFormatError`` naming the
    field for anything missing, of the wrong type or inconsistent (the caller adds the file's name)."""
    if not isinstance(data, dict):
        raise DrafterFormatError(f"holds a JSON {type(data).__name__}, not an object")
    archs = data.get("architectures") or []
    if not isinstance(archs, list) or ARCHITECTURE not in archs:
        raise DrafterFormatError(f"architectures={archs!r}: not a {ARCHITECTURE} export")
    ours = _dict(data, "dflash_offline")
    version = ours.get("format_version", EXPORT_FORMAT_VERSION)
    if version != EXPORT_FORMAT_VERSION:
        raise DrafterFormatError(
            f"export format version {version} is not readable by this dflash-offline "
            f"(reads {EXPORT_FORMAT_VERSION}); use the dflash-offline release that wrote it"
        )
    layer_types = data.get("layer_types") or []
    if (
        not isinstance(layer_types, list)
        or data.get("use_sliding_window")
        or any(t != "full_attention" for t in layer_types)
    ):
        raise DrafterFormatError(f"layer_types={layer_types}: only full-attention drafters are supported")
    dflash = _dict(data, "dflash_config")
    # block_size / num_target_layers sit at the top level in z-lab's published configs.
    picked = {name: dflash.get(name, data.get(name)) for name in _DFLASH_FIELDS}
    for name, value in picked.items():
        if value is None:
            raise DrafterFormatError(f"has no {name} (top level or dflash_config)")
    params = _dict(data, "rope_parameters")
    if params.get("rope_type", "default") != "default" or data.get("rope_scaling"):
        raise DrafterFormatError("only default RoPE (no rope_scaling) is supported")
    hidden, heads = _int(data, "hidden_size"), _int(data, "num_attention_heads")
    gamma = ours.get("loss_gamma")
    if gamma is not None:
        gamma = _float(ours, "loss_gamma")
    try:
        return DrafterConfig(
            hidden_size=hidden,
            num_layers=_int(data, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=_int(data, "num_key_value_heads", default=heads),
            head_dim=_int(data, "head_dim", default=hidden // heads if heads > 0 else 0),
            intermediate_size=_int(data, "intermediate_size"),
            rms_norm_eps=_float(data, "rms_norm_eps", default=1e-6),
            rope_theta=_float(data, "rope_theta", default=_float(params, "rope_theta", default=10000.0)),
            vocab_size=_int(data, "vocab_size"),
            block_size=_int(picked, "block_size"),
            target_layer_ids=_int_list(picked, "target_layer_ids"),
            num_target_layers=_int(picked, "num_target_layers"),
            mask_token_id=_int(picked, "mask_token_id"),
            max_position_embeddings=_int(data, "max_position_embeddings", default=32768),
            loss_gamma=gamma,
            num_anchors=_int(ours, "num_anchors", default=DEFAULT_NUM_ANCHORS),
            initializer_range=_float(data, "initializer_range", default=0.02),
        )
    except ConfigError as exc:
        raise DrafterFormatError(f"is inconsistent: {exc}") from exc


def export_drafter(
    model: DFlashDrafter, out_dir: str | Path, *, dtype: torch.dtype | None = None, readme: str | None = None
) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (and ``readme`` as ``README.md``) into ``out_dir``
    (created; files replaced).

    ``dtype`` converts the weights (e.g. torch.bfloat16 for serving); None keeps the model's dtype.
    Each file is written under a temporary name and renamed, so a crash leaves no half file.
    """
    out = Path(out_dir)
    state = model.state_dict()
    if "feature_scale_F" in state:
        # z-lab's layout has no feature scale: fold it into fc (fc(x·s) = (W·diag(s)) x).
        del state["feature_scale_F"]
        state["fc.weight"] = model.folded_fc_weight()
    bad = [k for k in state if not k.startswith(("layers.", "fc.", "hidden_norm.", "norm."))]
    assert not bad, f"unexpected state dict entries {bad}"
    first = next(iter(state.values()))
    out_dtype = dtype or first.dtype
    if out_dtype not in _DTYPE_NAMES:
        raise ConfigError(f"export dtype {out_dtype} unsupported; use float32, bfloat16 or float16")
    tensors = {k: v.detach().to("cpu", out_dtype).contiguous() for k, v in state.items()}
    bad = nonfinite_tensors(tensors)
    if bad:  # a drafter a server would load and draft garbage with, τ 1.0: never written
        raise DivergedError(f"{out}: not exported: non-finite values (NaN or Inf) in {_names(bad)}")
    out.mkdir(parents=True, exist_ok=True)
    _atomic_write(out / WEIGHTS_FILE, lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))
    text = json.dumps(zlab_config(model.config, dtype=out_dtype), indent=2, sort_keys=True) + "\n"
    _atomic_write(out / CONFIG_FILE, lambda p: p.write_text(text))
    if readme is not None:
        _atomic_write(out / README_FILE, lambda p: p.write_text(readme))
    return out


def read_export_config(directory: Path) -> DrafterConfig:
    """The drafter config of an export directory (which must hold the weights file too); a
    ``DrafterFormatError`` naming ``config.json`` and what is wrong with it otherwise."""
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (directory / name).is_file():
            raise DrafterFormatError(f"{directory / name} is missing: not a drafter export directory")
    path = directory / CONFIG_FILE
    try:
        data = json.loads(path.read_bytes())
    except OSError as exc:
        raise DrafterFormatError(f"{path}: cannot be read ({exc.strerror})") from exc
    except ValueError as exc:  # not JSON, or not UTF-8
        raise DrafterFormatError(f"{path} is not valid JSON: {exc}") from exc
    try:
        return config_from_zlab(data)
    except DrafterFormatError as exc:
        raise DrafterFormatError(f"{path}: {exc}") from exc


def read_export_weights(directory: Path, config: DrafterConfig, *, device: str = "cpu") -> dict[str, Tensor]:
    """The tensors of ``model.safetensors``, checked against what a drafter of ``config`` holds (every
    name, shape, one floating dtype): a ``DrafterFormatError`` naming the file otherwise, a
    ``DivergedError`` for a NaN or an Inf."""
    path = directory / WEIGHTS_FILE
    try:
        tensors = load_file(str(path), device=device)
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DrafterFormatError(f"{path} is not a readable safetensors file ({reason})") from exc
    expected = expected_weight_shapes(config)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise DrafterFormatError(
            f"{path} does not match {CONFIG_FILE}: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for key, t in tensors.items():
        if tuple(t.shape) != expected[key]:
            raise DrafterFormatError(
                f"{path}: {key} has shape {tuple(t.shape)}, {CONFIG_FILE} makes it {expected[key]}"
            )
    dtypes = {t.dtype for t in tensors.values()}
    if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
        raise DrafterFormatError(
            f"{path}: weight dtypes {sorted(map(str, dtypes))}; one floating dtype expected"
        )
    bad = nonfinite_tensors(tensors)
    if bad:
        raise DivergedError(
            f"{path}: non-finite values (NaN or Inf) in {_names(bad)}: the run that wrote it diverged; "
            "export one of its checkpoints from before that"
        )
    return tensors


def nonfinite_tensors(tensors: dict[str, Tensor]) -> list[str]:
    """The names of the floating tensors of ``tensors`` that hold a NaN or an Inf, in order."""
    return [k for k, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]


def _names(keys: list[str]) -> str:
    """Up to three tensor names, and how many more."""
    return ", ".join(keys[:3]) + (f" and {len(keys) - 3} more tensors" if len(keys) > 3 else "")


def expected_weight_shapes(config: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of an export of a drafter of ``config`` (built on the meta device:
    nothing is allocated)."""
    with torch.device("meta"):
        empty = torch.empty(config.vocab_size, config.hidden_size)
        model = DFlashDrafter(config, embed_VH=empty, lm_head_VH=empty)
    return {k: tuple(v.shape) for k, v in model.state_dict().items() if k != "feature_scale_F"}


def load_exported_drafter(
    directory: str | Path,
    *,
    embed_VH: Tensor,
    lm_head_VH: Tensor,
    device: torch.device | str | None = None,
) -> DFlashDrafter:
    """Build a drafter from an export (weights keep the file's dtype) over the given frozen head."""
    d = Path(directory)
    config = read_export_config(d)
    tensors = read_export_weights(d, config, device=str(device) if device is not None else "cpu")
    model = DFlashDrafter(config, embed_VH=embed_VH, lm_head_VH=lm_head_VH)
    # assign=True keeps the file's dtype (no silent upcast into freshly initialised float32 weights).
    model.load_state_dict(tensors, strict=True, assign=True)
    if device is not None:
        model.to(device)
    return model


def _atomic_write(path: Path, write: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        # safetensors creates its file 0600; an export is meant to be read by a serving engine run as
        # another user, so every file gets the mode a plain open() gives (0666 less the umask).
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _umask() -> int:
    """The process's umask, read from /proc where Linux shows it (os.umask can only read it by setting
    it, which another thread creating a file at that moment would see)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
