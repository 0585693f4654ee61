"""Feature capture against HF's own hidden states (see _reference.py for the reference and tolerance)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
from torch import nn

from dflash_offline.errors import TargetError
from dflash_offline.target_model.capture import FeatureCapture, capture_layer_outputs
from dflash_offline.target_model.loader import LoadedTarget, load_target
from tests.target_model._reference import (
    REL_TOL,
    assert_matches_reference,
    hf_reference,
    padded_batch,
    random_seqs,
    relative_error,
)

VOCAB = 49152


@pytest.fixture(scope="module", params=["random:tiny", "random:tiny-llama"])
def target(request: pytest.FixtureRequest) -> LoadedTarget:
    return load_target(request.param, device="cpu")


def test_single_unpadded_row_is_bit_exact(target: LoadedTarget) -> None:
    (seq,) = random_seqs([23], VOCAB)
    for layer_ids in ([0, 2], [1, 3]):  # 3 = L−1: compared with the final norm's input
        got = FeatureCapture(target, layer_ids)(seq[None], torch.ones(1, len(seq), dtype=torch.long))
        assert got.dtype == torch.float32
        assert got.shape == (1, 23, 2 * target.info.hidden_size)
        assert torch.equal(got[0], hf_reference(target.model, seq, layer_ids))


def test_batched_right_padded_rows_match_each_sample_alone(target: LoadedTarget) -> None:
    hidden = target.info.hidden_size
    layer_ids = [0, 1, 2, 3]
    batch = padded_batch(random_seqs([37, 5, 20, 1, 37], VOCAB, seed=1), VOCAB, seed=2)
    features = FeatureCapture(target, layer_ids)(batch.ids_BS, batch.mask_BS)
    assert features.shape == (5, 37, 4 * hidden)
    for row, seq in enumerate(batch.seqs):
        ref = hf_reference(target.model, seq, layer_ids)
        assert_matches_reference(features[row, : len(seq)], ref, hidden)
        # The tolerance is far tighter than the gap to a neighbouring layer (no off-by-one can pass).
        shifted = torch.cat([ref[:, hidden:], ref[:, :hidden]], dim=-1)
        assert relative_error(features[row, : len(seq)], shifted, hidden) > 100 * REL_TOL


def test_capture_leaves_the_full_model_intact(target: LoadedTarget) -> None:
    model = target.model
    (seq,) = random_seqs([11], VOCAB, seed=3)
    with torch.no_grad():
        before = model(seq[None]).logits
    hooks_before = _hooks(model)
    capture = FeatureCapture(target, [1])
    assert len(capture.backbone.layers) == 2
    assert isinstance(capture.backbone.norm, nn.Identity)
    capture(seq[None], torch.ones(1, 11, dtype=torch.long))
    assert len(model.model.layers) == 4
    assert not isinstance(model.model.norm, nn.Identity)
    assert model.config.num_hidden_layers == 4
    assert _hooks(model) == hooks_before
    with torch.no_grad():
        assert torch.equal(model(seq[None]).logits, before)


def test_truncated_load_gives_the_same_features(target: LoadedTarget) -> None:
    layer_ids = [0, 2]
    truncated = load_target(target.info.spec, device="cpu", max_layer=2)
    assert truncated.num_layers_built == 3
    assert truncated.info.num_layers == 4
    assert not hasattr(truncated.model, "lm_head")
    assert isinstance(truncated.model.norm, nn.Identity)
    capture = FeatureCapture(truncated, layer_ids)
    assert capture.backbone is truncated.model  # already truncated: used as is
    batch = padded_batch(random_seqs([9, 4], VOCAB, seed=4), VOCAB)
    expected = FeatureCapture(target, layer_ids)(batch.ids_BS, batch.mask_BS)
    assert torch.equal(capture(batch.ids_BS, batch.mask_BS), expected)


def test_bad_inputs_are_refused(target: LoadedTarget) -> None:
    capture = FeatureCapture(target, [0])
    ids = torch.ones(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="right-padded"):
        capture(ids, torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]]))
    with pytest.raises(ValueError, match="attention mask"):
        capture(ids, torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(TargetError, match="ascending"):
        FeatureCapture(target, [2, 1])
    with pytest.raises(TargetError, match="outside"):
        FeatureCapture(target, [4])


def _hooks(model: nn.Module) -> list[list[Any]]:
    """The forward hooks on each decoder layer (HF may install its own for output_hidden_states)."""
    return [list(layer._forward_hooks.values()) for layer in model.model.layers]


def _cache_kwarg(model: nn.Module) -> str:
    # transformers 5.24 renamed past_key_values to cache (the old name warns until 5.40).
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def test_hooks_on_a_full_forward_with_kv_cache(target: LoadedTarget) -> None:
    model, layer_ids, hidden = target.model, [1, 3], target.info.hidden_size
    (seq,) = random_seqs([12], VOCAB, seed=5)
    ref = hf_reference(model, seq, layer_ids)
    with torch.no_grad():
        full_logits = model(seq[None]).logits
    steps: list[torch.Tensor] = []
    logits: list[torch.Tensor] = []
    hooks_before = _hooks(model)
    with torch.no_grad(), capture_layer_outputs(model, layer_ids) as captured:
        out: Any = model(seq[None, :9], use_cache=True)  # prefill
        steps.append(captured.features())
        logits.append(out.logits)
        for position in (9, 10, 11):  # incremental decoding, one token at a time
            cache = out.get(_cache_kwarg(model), out.past_key_values)
            out = model(seq[None, position : position + 1], use_cache=True, **{_cache_kwarg(model): cache})
            assert captured.by_layer[1].shape == (1, 1, hidden)
            steps.append(captured.features())
            logits.append(out.logits)
    assert_matches_reference(torch.cat(steps, dim=1)[0], ref, hidden)
    torch.testing.assert_close(torch.cat(logits, dim=1), full_logits, rtol=1e-4, atol=1e-5)
    assert _hooks(model) == hooks_before  # ours are removed


class _TupleLayer(nn.Module):
    """A transformers-4.x style layer: returns (hidden, attn_weights)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return x + 1, None


class _TinyBackbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(5, 3)
        self.layers = nn.ModuleList([_TupleLayer(), _TupleLayer()])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)[0]
        return x


def test_hooks_accept_tuple_returning_layers() -> None:
    backbone = _TinyBackbone()
    ids = torch.tensor([[1, 2]])
    with torch.no_grad(), capture_layer_outputs(backbone, [0, 1]) as captured:
        backbone(ids)
    first = backbone.embed_tokens(ids) + 1
    second = first + 1  # as the layers add (x + 1 + 1 is not x + 2 in floating point)
    assert torch.equal(captured.features(), torch.cat([first, second], dim=-1))
