"""Capture the residual stream after chosen decoder layers of an HF decoder-only model.

Two ways in:
  ``FeatureCapture``: the generate path. Runs the embedding and layers 0..max(layer_ids) only (no later
      layers, no final norm, no LM head) on a right-padded batch, returns the concatenated features.
  ``capture_layer_outputs``: a context manager of forward hooks for a *full* forward (eval's
      speculative decoding needs features and logits from one target call, with a KV cache).

Both read layer outputs through forward hooks on the decoder layers, which works whether a layer
returns a tensor (transformers 5) or a tuple whose first item is the hidden state (4.x), and lets
HF's own forward build masks, positions and caches in whatever way the installed version does.

Shape legend: B = batch rows, S = padded sequence length, H = hidden size, F = len(layer_ids) · H.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dflash_offline.errors import TargetError
from dflash_offline.target_model.loader import LoadedTarget, truncated_config


def backbone_of(model: nn.Module) -> nn.Module:
    """The decoder backbone (``embed_tokens`` + ``layers``) of a CausalLM or of a bare backbone."""
    if hasattr(model, "layers") and hasattr(model, "embed_tokens"):
        return model
    inner = getattr(model, "model", None)
    if isinstance(inner, nn.Module) and hasattr(inner, "layers"):
        return inner
    raise TypeError(
        f"{type(model).__name__} has no decoder backbone with .layers (expected an HF decoder LM)"
    )


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a CausalLM or backbone, in order."""
    layers = backbone_of(model).layers
    assert isinstance(layers, nn.ModuleList), type(layers)
    return layers


def _check_layer_ids(layer_ids: Sequence[int], num_layers: int) -> tuple[int, ...]:
    ids = tuple(int(i) for i in layer_ids)
    if not ids or list(ids) != sorted(set(ids)):
        raise TargetError(f"layer ids {list(ids)} must be non-empty, unique and ascending")
    if ids[0] < 0 or ids[-1] >= num_layers:
        raise TargetError(f"layer ids {list(ids)} reach outside the model's {num_layers} built layers")
    return ids


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerOutputs:
    """Filled by forward hooks: the output of each captured layer in the latest forward call."""

    layer_ids: tuple[int, ...]
    """Captured layers, ascending."""
    by_layer: dict[int, torch.Tensor]
    """layer id -> [B, S, H] residual stream after that layer (S = tokens of the latest call, so only
    the new tokens during incremental decoding with a KV cache)."""

    def features(self) -> torch.Tensor:
        """[B, S, F]: the captured layers concatenated in ascending layer order."""
        missing = [i for i in self.layer_ids if i not in self.by_layer]
        if missing:
            raise RuntimeError(f"layers {missing} did not run (no forward call inside the context?)")
        return torch.cat([self.by_layer[i] for i in self.layer_ids], dim=-1)


@contextmanager
def capture_layer_outputs(model: nn.Module, layer_ids: Sequence[int]) -> Iterator[LayerOutputs]:
    """Hook the decoder layers ``layer_ids`` of ``model`` (CausalLM or backbone) while the block runs.

    Each forward call inside the block overwrites the entries: read (or copy) them after every call."""
    layers = decoder_layers(model)
    outputs = LayerOutputs(layer_ids=_check_layer_ids(layer_ids, len(layers)), by_layer={})

    def make_hook(layer_id: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            # transformers 5 layers return the hidden state; 4.x return (hidden, [attn], [cache]).
            hidden = output if isinstance(output, torch.Tensor) else output[0]
            outputs.by_layer[layer_id] = hidden

        return hook

    handles = [layers[i].register_forward_hook(make_hook(i)) for i in outputs.layer_ids]
    try:
        yield outputs
    finally:
        for handle in handles:
            handle.remove()


def truncated_view(backbone: nn.Module, num_layers: int) -> nn.Module:
    """A backbone sharing ``backbone``'s parameters but running only its first ``num_layers`` layers and
    no final norm. The original module is left untouched (its full forward still works)."""
    view = copy.copy(backbone)
    # copy.copy shares the containers (_modules, _parameters, hook dicts): give the view its own,
    # holding the same tensors and submodules, so editing the view never edits the original.
    for key, value in list(vars(view).items()):
        if key.startswith("_") and isinstance(value, dict):
            view.__dict__[key] = type(value)(value)
    view.layers = nn.ModuleList(list(decoder_layers(backbone))[:num_layers])
    view.norm = nn.Identity()
    view.config = truncated_config(getattr(backbone, "config"), num_layers)  # noqa: B009
    return view


class FeatureCapture(nn.Module):
    """Embedding + decoder layers 0..max(layer_ids) of a target; returns the captured features."""

    def __init__(self, target: LoadedTarget | nn.Module, layer_ids: Sequence[int]) -> None:
        super().__init__()
        model = target.model if isinstance(target, LoadedTarget) else target
        backbone = backbone_of(model)
        num_built = len(decoder_layers(backbone))
        self.layer_ids = _check_layer_ids(layer_ids, num_built)
        self.hidden_size = int(getattr(backbone, "config").hidden_size)  # noqa: B009
        needed = self.layer_ids[-1] + 1
        already_truncated = num_built == needed and isinstance(getattr(backbone, "norm", None), nn.Identity)
        self.backbone = backbone if already_truncated else truncated_view(backbone, needed)

    @property
    def feature_width(self) -> int:
        """F = len(layer_ids) · hidden size."""
        return len(self.layer_ids) * self.hidden_size

    @torch.inference_mode()
    def forward(self, input_ids_BS: torch.Tensor, attention_mask_BS: torch.Tensor) -> torch.Tensor:
        """[B, S, F] features in the model's dtype on its device; rows are right-padded (mask 1 then 0),
        positions are 0..len−1 in every row. Values at padded positions are meaningless."""
        num_rows, seq_len = input_ids_BS.shape
        if attention_mask_BS.shape != input_ids_BS.shape:
            raise ValueError(
                f"attention mask {tuple(attention_mask_BS.shape)} != input ids {tuple(input_ids_BS.shape)}"
            )
        if seq_len > 1 and bool((attention_mask_BS[:, 1:] > attention_mask_BS[:, :-1]).any()):
            raise ValueError("rows must be right-padded: a 0 in the attention mask is followed by a 1")
        position_ids_BS = torch.arange(seq_len, device=input_ids_BS.device).unsqueeze(0).expand(num_rows, -1)
        with capture_layer_outputs(self.backbone, self.layer_ids) as outputs:
            self.backbone(
                input_ids=input_ids_BS,
                attention_mask=attention_mask_BS,
                position_ids=position_ids_BS,
                use_cache=False,
            )
        return outputs.features()
