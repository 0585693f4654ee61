"""The drafter's layers against transformers' Qwen3 implementation (an independent reference for the
RoPE convention, q_norm/k_norm, GQA, SwiGLU, final norm and the parameter names).

Two identities make HF's Qwen3Model a reference:
- a block with no context is a plain bidirectional Qwen3 stack over the block rows;
- with one layer, unit input_layernorm and hidden_norm weights, DFlash's [ctx ; block] keys equal
  those of a Qwen3 layer run over the sequence [ctx ; block] (RMSNorm of an RMS-normed row is
  itself), so the block rows' outputs coincide.
"""

from __future__ import annotations

import torch
from transformers import Qwen3Config, Qwen3Model

from .helpers import tiny_config, tiny_drafter


def hf_twin(model) -> Qwen3Model:
    cfg = model.config
    hc = Qwen3Config(
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings,
        attention_bias=False,
    )
    hc._attn_implementation = "eager"
    hf = Qwen3Model(hc).eval()
    state = {k: v for k, v in model.state_dict().items() if k.startswith(("layers.", "norm."))}
    result = hf.load_state_dict(state, strict=False)
    # every drafter layer weight has the same name in Qwen3; only the embedding is HF's own
    assert result.unexpected_keys == []
    assert result.missing_keys == ["embed_tokens.weight"]
    return hf


def block_ids(model, anchor_token: int) -> torch.Tensor:
    ids = torch.full((model.config.block_size,), model.config.mask_token_id)
    ids[0] = anchor_token
    return ids


def test_block_without_context_equals_bidirectional_qwen3_stack() -> None:
    model = tiny_drafter(tiny_config(num_layers=3, block_size=5), seed=11)
    hf = hf_twin(model)
    anchor_pos, B = 37, 5
    with torch.no_grad():
        ours = model.draft_hidden(
            context_features_CF=torch.zeros(0, model.config.feature_width),
            anchor_token=7,
            anchor_position=anchor_pos,
        )
        x = model.embed_VH[block_ids(model, 7)]
        ref = hf(
            inputs_embeds=x[None],
            position_ids=torch.arange(anchor_pos, anchor_pos + B)[None],
            attention_mask=torch.zeros(1, 1, B, B),  # additive, all visible: bidirectional
        ).last_hidden_state[0]
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_one_layer_with_context_equals_qwen3_over_context_and_block() -> None:
    model = tiny_drafter(tiny_config(num_layers=1), seed=12)
    with torch.no_grad():
        model.hidden_norm.weight.fill_(1.0)
        model.layers[0].input_layernorm.weight.fill_(1.0)
    hf = hf_twin(model)
    C, B = 6, model.config.block_size
    feats = torch.randn(C, model.config.feature_width, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model.draft_hidden(context_features_CF=feats, anchor_token=3, anchor_position=C)
        x = torch.cat([model.context(feats), model.embed_VH[block_ids(model, 3)]])
        ref = hf(
            inputs_embeds=x[None],
            position_ids=torch.arange(C + B)[None],
            attention_mask=torch.zeros(1, 1, C + B, C + B),
        ).last_hidden_state[0, C:]
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
