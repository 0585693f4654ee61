"""A GGUF's weights, dequantized once and kept as safetensors beside its tokenizer and config.

transformers dequantizes a GGUF on the CPU at every load: ≈ 8 s for SmolLM2-135M's Q4_1 file on two cores,
most of it in the ``gguf`` reader and its tensor-name maps, paid by every stage that loads the target
(regenerate, generate, train, each eval) and by every test that does. The float32 tensors it produces are
written once into the GGUF's asset directory (source.py: ``gguf_assets_dir``, keyed by the GGUF's weights
hash and the transformers and gguf versions) as ``model.safetensors``; later loads read that file,
memory-mapped (≈ 0.05 s), with the config beside it, like any model directory: the same tensors bit for bit,
in every dtype (tests/target_model/test_gguf_weights.py). The target's identity stays the GGUF's weights hash.

A float32 copy is 32/4.5 ≈ 7× a 4.5-bit GGUF (≈ 0.5 GB for SmolLM2-135M): above ``MAX_CACHED_BYTES`` nothing
is kept and every load reads the GGUF, as does a load whose cache directory cannot be written. Delete the
directory (``$DFLASH_CACHE_DIR/gguf``, by default ``~/.cache/dflash-offline/gguf``) to reclaim the space.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from dflash_offline.target_model.quiet import quiet_transformers

WEIGHTS_FILE = "model.safetensors"
MAX_CACHED_BYTES = 4 << 30
"""The largest float32 copy kept (a 1B-parameter model): a larger GGUF would put tens of GB on the disk."""


def float32_bytes(config: Any) -> int:
    """Bytes of the model's weights in float32, counted on the meta device (nothing allocated). Tied
    weights count once, as ``parameters()`` yields them."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return 4 * sum(p.numel() for p in model.parameters())


def cached_weights_dir(gguf_path: Path, assets_dir: Path, config: Any) -> Path | None:
    """``assets_dir`` once it holds the GGUF's dequantized weights (written now on a first load), or None
    where they are not kept (larger than ``MAX_CACHED_BYTES``, or the directory cannot be written: the
    caller reads the GGUF)."""
    if (assets_dir / WEIGHTS_FILE).is_file():
        return assets_dir
    if float32_bytes(config) > MAX_CACHED_BYTES:
        return None
    try:
        write_weights(gguf_path, assets_dir)
    except OSError as e:  # a read-only or full disk costs the speed, not the load
        print(f"dflash: the GGUF's weights are not cached ({e}); each load dequantizes it", file=sys.stderr)
        return None
    return assets_dir


def write_weights(gguf_path: Path, assets_dir: Path) -> None:
    """Dequantize ``gguf_path`` through transformers' own GGUF load (float32, CPU) and write its tensors
    into ``assets_dir/model.safetensors``: to a temporary file renamed into place, so that processes loading
    at once (workers, parallel tests) never read half of it; the last rename wins with equal contents."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    with quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        )
    tensors: dict[str, torch.Tensor] = {}
    stored: set[int] = set()
    for name, tensor in model.state_dict().items():
        # A tied weight (SmolLM2's lm_head is its embedding) is stored once, under its first name; the load
        # ties it again from the config, as for any checkpoint saved by transformers.
        if tensor.data_ptr() in stored:
            continue
        stored.add(tensor.data_ptr())
        tensors[name] = tensor.detach().contiguous()
    fd, tmp = tempfile.mkstemp(prefix=f".{WEIGHTS_FILE}.", dir=assets_dir)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"format": "pt", "source": gguf_path.name})
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide it from other users of a shared cache directory
        os.replace(tmp, assets_dir / WEIGHTS_FILE)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
