"""The drafter's training forward: per-block equivalence with the inference path (each block computed
alone from its own context), gradient isolation, the loss against the reference, no NaN, cache."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dflash_offline.drafter import DrafterInputs
from dflash_offline.drafter.loss import block_labels, decayed_cross_entropy
from dflash_offline.errors import ConfigError, DataError

from .helpers import random_row, tiny_config, tiny_drafter

ROW = ([7, 12, 5], 6)  # document lengths, padding


def make_row(seed: int = 0, block_size: int = 4) -> DrafterInputs:
    lengths, pad = ROW
    return random_row(lengths, seed=seed, pad=pad, num_anchors=3, extra_anchors="starts,ends")


def single_block_hidden(model, row: DrafterInputs, j: int) -> torch.Tensor:
    """Block j through the inference path: only its document's features before the anchor, no mask."""
    a = int(row.anchors_A[j])
    doc = row.doc_ids_T[a]
    start = int(torch.nonzero(row.doc_ids_T == doc)[0])
    return model.draft_hidden(
        context_features_CF=row.features_TF[start:a],
        anchor_token=int(row.input_ids_T[a]),
        anchor_position=int(row.positions_T[a]),
    )


@pytest.mark.parametrize(("seed", "block_size"), [(0, 4), (1, 3), (2, 6)])
def test_training_blocks_equal_blocks_drafted_alone(seed: int, block_size: int) -> None:
    model = tiny_drafter(tiny_config(block_size=block_size), seed=seed)
    row = make_row(seed)
    B = block_size
    with torch.no_grad():
        hidden = {b: model.forward_hidden(row, attention=b) for b in ("sdpa", "flex")}
    for j in range(row.num_anchors):
        alone = single_block_hidden(model, row, j)
        for backend, h in hidden.items():
            torch.testing.assert_close(h[j * B : (j + 1) * B], alone, atol=2e-5, rtol=2e-5, msg=backend)


def test_rope_positions_are_within_the_document() -> None:
    """Moving a document to another place in the row changes nothing of its blocks."""
    model = tiny_drafter()
    row = random_row([9, 6], seed=3, num_anchors=3)
    # the same two documents in the other order
    n0 = 9
    perm = torch.cat([torch.arange(n0, 15), torch.arange(0, n0)])
    inv = torch.argsort(perm)
    swapped = DrafterInputs(
        input_ids_T=row.input_ids_T[perm],
        features_TF=row.features_TF[perm],
        loss_mask_T=row.loss_mask_T[perm],
        doc_ids_T=1 - row.doc_ids_T[perm],
        positions_T=row.positions_T[perm],
        anchors_A=torch.sort(inv[row.anchors_A]).values,
    )
    with torch.no_grad():
        h1 = model.forward_hidden(row, attention="sdpa").view(row.num_anchors, 4, -1)
        h2 = model.forward_hidden(swapped, attention="sdpa").view(row.num_anchors, 4, -1)
    order = torch.argsort(inv[row.anchors_A])  # block j of `row` is block order-rank in `swapped`
    rank = torch.argsort(order)
    torch.testing.assert_close(h1, h2[rank], atol=1e-5, rtol=1e-5)


def test_gradient_isolation_per_block() -> None:
    """d loss_j / d features[p] == 0 exactly for p ≥ a_j, for other documents and for padding (nonzero
    before the anchor); d loss_j / d (block k inputs) == 0 exactly for k ≠ j (nonzero for k = j)."""
    model = tiny_drafter(seed=5)
    row = make_row(5)
    B = model.config.block_size
    labels = block_labels(row.input_ids_T, row.loss_mask_T, row.doc_ids_T, row.anchors_A, B)
    docs, positions = row.doc_ids_T.tolist(), row.positions_T.tolist()
    checked_context = 0
    for j in range(row.num_anchors):
        features = row.features_TF.clone().requires_grad_(True)
        blocks = model.embed_blocks(row).detach().requires_grad_(True)
        leaf_row = DrafterInputs(
            input_ids_T=row.input_ids_T,
            features_TF=features,
            loss_mask_T=row.loss_mask_T,
            doc_ids_T=row.doc_ids_T,
            positions_T=row.positions_T,
            anchors_A=row.anchors_A,
        )
        hidden = model.forward_hidden(leaf_row, attention="sdpa", block_embeds_QH=blocks)
        logits = (hidden @ model.lm_head_VH.T).view(row.num_anchors, B, -1)
        # the CE of every position of block j (all of them, so the gradient is never trivially zero)
        loss_j = torch.nn.functional.cross_entropy(logits[j], labels.label_ids_AB[j])
        loss_j.backward()
        a = int(row.anchors_A[j])
        grad_f = features.grad.abs().sum(-1)
        for p in range(row.num_tokens):
            visible = docs[p] == docs[a] and positions[p] < positions[a]
            if visible:
                assert grad_f[p] > 0, (j, p)
                checked_context += 1
            else:
                assert grad_f[p] == 0, (j, p, a)  # exactly zero
        grad_b = blocks.grad.view(row.num_anchors, B, -1).abs().sum(-1)
        for k in range(row.num_anchors):
            if k == j:
                assert (grad_b[k] > 0).all()
            else:
                assert (grad_b[k] == 0).all(), (j, k)
    assert checked_context > 10


def test_forward_train_matches_reference_loss_and_gradients() -> None:
    model = tiny_drafter(seed=1)
    row = make_row(1)
    B = model.config.block_size
    out = model.forward_train(row, attention="sdpa", loss_chunk_rows=5)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    labels = block_labels(row.input_ids_T, row.loss_mask_T, row.doc_ids_T, row.anchors_A, B)
    hidden = model.forward_hidden(row, attention="sdpa")
    logits = (hidden @ model.lm_head_VH.T).view(row.num_anchors, B, -1)
    ref = decayed_cross_entropy(logits, labels.label_ids_AB, labels.valid_AB, gamma=model.config.gamma)
    ref.backward()
    torch.testing.assert_close(out.loss, ref.detach())
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, msg=n)

    # accuracy counts and the accepted-prefix metric from the full logits
    correct = (logits.argmax(-1) == labels.label_ids_AB) & labels.valid_AB
    assert out.correct_K.tolist() == correct[:, 1:].sum(0).tolist()
    assert out.total_K.tolist() == labels.valid_AB[:, 1:].sum(0).tolist()
    assert int(out.num_loss_tokens) == int(labels.valid_AB.sum())
    prefix = 0
    for blk in correct[:, 1:].tolist():
        for ok in blk:
            if not ok:
                break
            prefix += 1
    assert int(out.accepted_prefix_sum) == prefix
    assert out.num_blocks == row.num_anchors
    torch.testing.assert_close(out.loss, out.weighted_ce_sum / out.weight_sum)


def test_checkpointed_layers_give_the_same_loss_and_gradients() -> None:
    model = tiny_drafter(seed=2)
    row = make_row(2)
    out = model.forward_train(row, attention="sdpa")
    out.loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    out2 = model.forward_train(row, attention="sdpa", checkpoint_layers=True)
    out2.loss.backward()
    torch.testing.assert_close(out.loss, out2.loss)
    for g1, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g1, p.grad)


def test_no_nan_with_padding_document_starts_and_blocks_past_the_end() -> None:
    """Anchors at document starts (no context), blocks running past the document and row end,
    padding tokens: loss and every gradient finite; also under bf16 autocast with bf16 inputs."""
    model = tiny_drafter(seed=3)
    row = random_row([1, 2, 9], seed=3, pad=5, num_anchors=2, extra_anchors="starts,ends", loss_prob=1.0)
    # an anchor on the very last real token, its block running into the padding
    out = model.forward_train(row, attention="sdpa")
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    model.zero_grad()
    bf16_model = tiny_drafter(seed=3)
    bf16_model.load_frozen_head(bf16_model.embed_VH.bfloat16(), bf16_model.lm_head_VH.bfloat16())
    bf16_row = DrafterInputs(
        input_ids_T=row.input_ids_T,
        features_TF=row.features_TF.bfloat16(),
        loss_mask_T=row.loss_mask_T,
        doc_ids_T=row.doc_ids_T,
        positions_T=row.positions_T,
        anchors_A=row.anchors_A,
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out16 = bf16_model.forward_train(bf16_row, attention="sdpa")
    out16.loss.backward()
    assert torch.isfinite(out16.loss)
    assert abs(out16.loss.item() - out.loss.item()) < 0.1 * out.loss.item()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in bf16_model.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):  # float32 head, cast once for the LM-head matmul
        out_mixed = model.forward_train(bf16_row, attention="sdpa")
    assert abs(out_mixed.loss.item() - out.loss.item()) < 0.1 * out.loss.item()
    # flex on CPU (forward only) with padded queries and keys: finite and equal to SDPA
    with torch.no_grad():
        torch.testing.assert_close(
            model.forward_hidden(row, attention="flex"),
            model.forward_hidden(row, attention="sdpa"),
            atol=2e-5,
            rtol=2e-5,
        )


def test_row_without_anchors_gives_zero_loss_that_reaches_every_parameter() -> None:
    model = tiny_drafter()
    row = replace(make_row(), anchors_A=torch.zeros(0, dtype=torch.int64))
    out = model.forward_train(row, attention="sdpa")
    out.loss.backward()
    assert out.loss.item() == 0.0
    assert int(out.num_loss_tokens) == 0
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_draft_with_a_growing_cache_equals_recomputing() -> None:
    model = tiny_drafter(seed=4)
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(20, model.config.feature_width, generator=g)
    cache = model.new_context_cache()
    seen = 0
    for anchor_pos, token in ((5, 3), (6, 9), (11, 1), (19, 7)):
        cached = model.draft_logits(
            context_features_CF=feats[seen:anchor_pos],
            anchor_token=token,
            anchor_position=anchor_pos,
            cache=cache,
        )
        seen = anchor_pos
        full = model.draft_logits(
            context_features_CF=feats[:anchor_pos], anchor_token=token, anchor_position=anchor_pos
        )
        torch.testing.assert_close(cached, full, atol=1e-5, rtol=1e-5)
        tokens = model.draft(
            context_features_CF=feats[:anchor_pos], anchor_token=token, anchor_position=anchor_pos
        )
        assert tokens.shape == (model.config.block_size - 1,)
        assert torch.equal(tokens, full.argmax(-1))
    assert cache.length == 19
    with pytest.raises(DataError):
        model.draft(context_features_CF=feats[:3], anchor_token=1, anchor_position=25, cache=cache)


def test_frozen_head_is_not_trained_not_saved_and_tied_once() -> None:
    model = tiny_drafter(tied=True)
    assert model.lm_head_VH is model.embed_VH
    assert not any(k.startswith(("embed", "_lm_head")) for k in model.state_dict())
    names = {n for n, _ in model.named_parameters()}
    assert names == {n for n, p in model.named_parameters() if p.requires_grad}
    assert len(model.trainable_parameters()) == len(names)
    assert not model.embed_VH.requires_grad
    out = model.forward_train(make_row(), attention="sdpa")
    out.loss.backward()
    assert model.embed_VH.grad is None
    with pytest.raises(ConfigError):
        model.load_frozen_head(torch.zeros(3, 4), torch.zeros(3, 4))


def test_feature_width_mismatch_is_a_data_error() -> None:
    model = tiny_drafter()
    row = random_row([6], seed=0, feature_width=48)
    with pytest.raises(DataError, match="wide"):
        model.forward_train(row, attention="sdpa")


def test_flex_training_off_cuda_is_refused() -> None:
    model = tiny_drafter()
    with pytest.raises(ConfigError, match="flex"):
        model.forward_train(make_row(), attention="flex")


def test_the_drafter_can_fit_one_row() -> None:
    """A useful gradient: 20 AdamW steps on one row cut the loss and raise the accuracy."""
    torch.manual_seed(0)
    model = tiny_drafter(seed=6)
    row = random_row([12, 9], seed=6, num_anchors=6, loss_prob=1.0)
    opt = torch.optim.AdamW(model.trainable_parameters(), lr=1e-2)
    first = model.forward_train(row, attention="sdpa")
    for _ in range(20):
        opt.zero_grad()
        out = model.forward_train(row, attention="sdpa")
        out.loss.backward()
        opt.step()
    last = model.forward_train(row, attention="sdpa")
    assert last.loss.item() < 0.3 * first.loss.item()
    assert int(last.correct_K.sum()) > int(first.correct_K.sum())


def test_loss_rows_computed_ahead_give_the_same_forward() -> None:
    """``loss_rows_N`` (the prefetcher's host-side nonzero) changes nothing but where it is computed."""
    from dflash_offline.drafter.loss import loss_rows

    model = tiny_drafter(tiny_config(block_size=4))
    row = random_row([20, 9, 31], seed=4, pad=5, num_anchors=6, extra_anchors="ends")
    rows = loss_rows(row.loss_mask_T, row.doc_ids_T, row.anchors_A, 4)
    labels = block_labels(row.input_ids_T, row.loss_mask_T, row.doc_ids_T, row.anchors_A, 4)
    assert torch.equal(rows, torch.nonzero(labels.valid_AB.reshape(-1)).flatten())
    plain = model.forward_train(row, attention="sdpa")
    ahead = model.forward_train(replace(row, loss_rows_N=rows), attention="sdpa")
    for name in ("loss", "weighted_ce_sum", "weight_sum", "correct_K", "total_K", "accepted_prefix_sum"):
        assert torch.equal(getattr(plain, name), getattr(ahead, name)), name
