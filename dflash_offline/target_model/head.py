"""Load a target's input embedding and LM head alone, without building the target (the drafter's need).

Sources: safetensors (only the two tensors are read, through the shard index when sharded), GGUF
(``gguf.GGUFReader`` + ``gguf.quants.dequantize``, the same dequantization transformers applies; the
cached dequantized weights of target_model/gguf_weights.py once a load has written them), or
a random preset (regenerated from the preset's value function, bit-identical to ``load_target``'s
float32 weights on any device). A tied target returns one tensor object for both.

Shape legend: V = embedding rows (config vocab size), H = hidden size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dflash_offline.errors import TargetError
from dflash_offline.target_model.gguf_weights import WEIGHTS_FILE
from dflash_offline.target_model.loader import TargetInfo, target_info
from dflash_offline.target_model.presets import param_values
from dflash_offline.target_model.source import (
    gguf_assets_dir,
    resolve_target,
    safetensors_files,
    weights_hash,
)

_EMBED_SUFFIX = "embed_tokens.weight"
_HEAD_NAME = "lm_head.weight"


@dataclass(frozen=True, kw_only=True, slots=True)
class TargetHead:
    """The frozen target tensors a DFlash drafter borrows."""

    info: TargetInfo
    embed_VH: torch.Tensor
    """float32 [V, H]: the input embedding (``embed_tokens``)."""
    lm_head_VH: torch.Tensor
    """float32 [V, H]: the output projection; the very same tensor as ``embed_VH`` when tied."""

    @property
    def tied(self) -> bool:
        return self.lm_head_VH is self.embed_VH


def load_embedding_and_head(spec: str, *, device: torch.device | str = "cpu") -> TargetHead:
    """Read only the embedding and LM head of ``spec`` as float32 tensors on ``device``."""
    source = resolve_target(spec)
    info = target_info(source)
    device = torch.device(device)
    head: torch.Tensor | None
    if source.preset is not None:
        shape = torch.Size((info.vocab_size, info.hidden_size))
        embed = param_values(source.preset, "model.embed_tokens.weight", shape, device=device)
        head = (
            None
            if info.tie_word_embeddings
            else param_values(source.preset, _HEAD_NAME, shape, device=device)
        )
    elif source.kind == "gguf":
        assert source.path is not None
        # The GGUF's dequantized weights where a load has cached them (gguf_weights.py), else the GGUF.
        assets = gguf_assets_dir(source.path, weights_hash(source))
        if (assets / WEIGHTS_FILE).is_file():
            embed, head = _from_safetensors(assets, tied=info.tie_word_embeddings)
        else:
            embed, head = _from_gguf(source.path)
    else:
        assert source.path is not None
        embed, head = _from_safetensors(source.path, tied=info.tie_word_embeddings)
    embed = embed.to(device=device, dtype=torch.float32)
    head = embed if head is None else head.to(device=device, dtype=torch.float32)
    expected = (info.vocab_size, info.hidden_size)
    for name, tensor in (("embedding", embed), ("lm_head", head)):
        if tuple(tensor.shape) != expected:
            raise TargetError(
                f"{spec!r}: {name} has shape {tuple(tensor.shape)}, "
                f"the config says {expected} (vocab, hidden)"
            )
    return TargetHead(info=info, embed_VH=embed, lm_head_VH=head)


def _from_safetensors(model_dir: Path, *, tied: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    else:
        weight_map = {}
        for file in safetensors_files(model_dir):
            with safe_open(str(file), framework="pt") as f:
                weight_map.update(dict.fromkeys(f.keys(), file.name))
    embed_names = [name for name in weight_map if name.endswith(_EMBED_SUFFIX)]
    if len(embed_names) != 1:
        raise TargetError(f"{str(model_dir)!r}: expected one '*{_EMBED_SUFFIX}' tensor, found {embed_names}")

    def read(name: str) -> torch.Tensor:
        with safe_open(str(model_dir / weight_map[name]), framework="pt") as f:
            return f.get_tensor(name)

    embed = read(embed_names[0])
    if tied:
        return embed, None
    if _HEAD_NAME not in weight_map:
        raise TargetError(
            f"{str(model_dir)!r}: config.json says tie_word_embeddings=false but there is no {_HEAD_NAME!r}"
        )
    return embed, read(_HEAD_NAME)


def _from_gguf(path: Path) -> tuple[torch.Tensor, torch.Tensor | None]:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    if "token_embd.weight" not in tensors:
        raise TargetError(f"{str(path)!r} has no token_embd.weight tensor")

    def read(name: str) -> torch.Tensor:
        t = tensors[name]
        values = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        # GGUF lists dims fastest-first: [H, V] in the header is a row-major [V, H] array.
        return torch.from_numpy(values.reshape(tuple(int(d) for d in reversed(t.shape))).copy())

    embed = read("token_embd.weight")
    # A GGUF without ``output.weight`` ties the head to the embedding (llama.cpp's convention).
    head = read("output.weight") if "output.weight" in tensors else None
    return embed, head
