"""Independent references for captured features: HF's own ``output_hidden_states`` on one unpadded
sample, and (for the last layer, whose hidden_states entry is post-norm) the input of the final norm.

Shape legend: S = tokens of one sample, B = batch rows, F = len(layer_ids) · hidden."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

# Float32 CPU tolerance for batched, right-padded capture vs one-sample HF forwards. Batching changes
# matmul shapes (rows = B·S instead of S) and the attention path (an explicit padding mask instead of
# is_causal), so oneDNN may block and sum in another order: each op differs by a few float32 ulps
# and the layers compound it. The check is elementwise and per layer block:
#     |got − ref| ≤ REL_TOL · (|ref| + rms(ref))
# (the rms term keeps near-zero entries from demanding more than float32 offers; a plain max-based
# scale would be useless for SmolLM2, whose outlier dimensions are ~100× the rest). Measured worst:
# 8e-7 (random:tiny), 8.5e-6 (SmolLM2 GGUF, 30 layers). The same measure between adjacent layers is
# ≥ 0.9 (tiny) and ≥ 2.5e-3 (SmolLM2), so an off-by-one layer cannot pass; tests check that too.
# A single unpadded row is compared bit-exactly instead: then the ops are the same.
REL_TOL = 1e-4


@dataclass(frozen=True, kw_only=True, slots=True)
class PaddedBatch:
    """Right-padded rows with random pad ids (their values must not matter)."""

    seqs: tuple[torch.Tensor, ...]
    """int64 [S_b] each: the unpadded samples."""
    ids_BS: torch.Tensor
    mask_BS: torch.Tensor


def padded_batch(seqs: Sequence[torch.Tensor], vocab: int, seed: int = 0) -> PaddedBatch:
    gen = torch.Generator().manual_seed(seed)
    width = max(len(s) for s in seqs)
    ids = torch.randint(0, vocab, (len(seqs), width), generator=gen)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for row, seq in enumerate(seqs):
        ids[row, : len(seq)] = seq
        mask[row, : len(seq)] = 1
    return PaddedBatch(seqs=tuple(seqs), ids_BS=ids, mask_BS=mask)


def random_seqs(lengths: Sequence[int], vocab: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]


@torch.no_grad()
def hf_reference(model: nn.Module, seq_S: torch.Tensor, layer_ids: Sequence[int]) -> torch.Tensor:
    """[S, F]: layer i is ``hidden_states[i + 1]`` of a full HF forward on the sample alone; the last
    layer (post-norm in hidden_states) is taken from the final norm's input instead."""
    num_layers = model.config.num_hidden_layers
    pre_norm: dict[str, torch.Tensor] = {}
    handle = model.model.norm.register_forward_pre_hook(lambda m, args: pre_norm.update(x=args[0]))
    try:
        hidden = model(seq_S[None], output_hidden_states=True).hidden_states
    finally:
        handle.remove()
    assert len(hidden) == num_layers + 1
    parts = [pre_norm["x"][0] if i == num_layers - 1 else hidden[i + 1][0] for i in layer_ids]
    return torch.cat(parts, dim=-1)


def relative_error(got_SF: torch.Tensor, ref_SF: torch.Tensor, hidden: int) -> float:
    """Worst over layer blocks of max |got − ref| / (|ref| + rms(ref)) (see REL_TOL)."""
    assert got_SF.shape == ref_SF.shape, (got_SF.shape, ref_SF.shape)
    worst = 0.0
    for start in range(0, ref_SF.shape[-1], hidden):
        got, ref = got_SF[:, start : start + hidden].float(), ref_SF[:, start : start + hidden].float()
        rms = ref.pow(2).mean().sqrt()
        worst = max(worst, ((got - ref).abs() / (ref.abs() + rms)).max().item())
    return worst


def assert_matches_reference(got_SF: torch.Tensor, ref_SF: torch.Tensor, hidden: int) -> None:
    err = relative_error(got_SF, ref_SF, hidden)
    assert err <= REL_TOL, f"relative error {err:.3g} > {REL_TOL}"
