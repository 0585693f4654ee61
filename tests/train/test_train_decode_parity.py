"""Training sees what decoding sees: for a cached sample whose answer is the target's own greedy output,
the drafter's training forward at anchor n (the cached features, the packed row's mask and positions,
the mask token) predicts what ``dflash eval``'s speculative loop has the exported drafter propose at
position n for the same prompt.

The sample goes through the real data path (the chat template and loss mask of ``dflash generate``,
its feature capture, bf16 storage, the prefetcher's packing next to another document, its loss rows);
the eval side runs the reference loop (``speculative_decode``, recording what it hands the drafter) and
the decode engine ``dflash eval`` runs (recording its on-device drafter's proposals), with the export
read back as ``dflash eval`` reads it. The drafter has random weights (large enough that its logits
are far from uniform) and a feature scale, so the export's folding is part of what is compared.
Float32 on the CPU: the speculative output equals greedy decoding token for token.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import Tensor

from dflash_offline.cache.reader import CacheReader
from dflash_offline.drafter import DFlashDrafter, DrafterConfig, export_drafter, resolve_mask_token_id
from dflash_offline.drafter.anchors import eligible_anchor_mask
from dflash_offline.eval.run import load_drafter_for
from dflash_offline.eval.speculative import (
    DFlashBlockDrafter,
    TargetCaller,
    speculative_decode,
    target_only_decode,
)
from dflash_offline.generate.run import run_generate
from dflash_offline.target_model.capture import FeatureCapture
from dflash_offline.target_model.loader import LoadedTarget, load_target
from dflash_offline.train.loader import Prefetcher
from dflash_offline.train.planner import AnchorRequest, MicrobatchPlan, ScheduledMicrobatch
from tests.eval.helpers import one_thread
from tests.generate.helpers import tiny_config

LAYERS = (0, 2)
BLOCK = 4
NEW_TOKENS = 40
PROMPT = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Write a poem about the sea."},
]
OTHER = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi, how can I help?"}]


@pytest.fixture(autouse=True)
def _single_thread() -> Iterator[None]:
    with one_thread():
        yield


@pytest.fixture(scope="module")
def cpu_target() -> LoadedTarget:
    return load_target("random:tiny", device="cpu", dtype=torch.float32)


def _drafter(target: LoadedTarget) -> DFlashDrafter:
    info = target.info
    config = DrafterConfig.from_target_config(
        info.hf_config,
        target_layer_ids=LAYERS,
        mask_token_id=resolve_mask_token_id(target.tokenizer, info.vocab_size),
        num_layers=2,
        block_size=BLOCK,
    )
    model = DFlashDrafter(
        config,
        embed_VH=target.model.get_input_embeddings().weight,
        lm_head_VH=target.model.get_output_embeddings().weight,
    )
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            else:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
    model.set_feature_scale(torch.rand(config.feature_width, generator=g) + 0.5)
    return model


@dataclass(frozen=True, kw_only=True, slots=True)
class Proposal:
    """One call of the speculative loop to the drafter."""

    anchor_position: int
    anchor_token: int
    context_CF: Tensor
    """Every feature row handed over since the prompt started (positions 0..anchor_position−1)."""
    proposal_K: Tensor
    logits_KV: Tensor
    """The drafter's logits for that call, recomputed from the whole context (no K/V cache)."""


class RecordingDrafter:
    """``DFlashBlockDrafter`` (what ``dflash eval`` runs), recording what the loop hands it."""

    def __init__(self, model: DFlashDrafter) -> None:
        self.inner = DFlashBlockDrafter(model)
        self.calls: list[Proposal] = []
        self._features: list[Tensor] = []

    @property
    def block_size(self) -> int:
        return self.inner.block_size

    def reset(self) -> None:
        self.inner.reset()
        self._features = []

    def propose(self, *, new_features_CF: Tensor, anchor_token: int, anchor_position: int) -> Tensor:
        self._features.append(new_features_CF.clone())
        context = torch.cat(self._features)
        proposal = self.inner.propose(
            new_features_CF=new_features_CF, anchor_token=anchor_token, anchor_position=anchor_position
        )
        logits = self.inner.model.draft_logits(
            context_features_CF=context, anchor_token=anchor_token, anchor_position=anchor_position
        )
        self.calls.append(
            Proposal(
                anchor_position=anchor_position,
                anchor_token=anchor_token,
                context_CF=context,
                proposal_K=proposal.clone(),
                logits_KV=logits,
            )
        )
        return proposal


def _prompt_ids(target: LoadedTarget) -> list[int]:
    tok = target.tokenizer
    text = tok.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    return [int(i) for i in tok(text, add_special_tokens=False)["input_ids"]]


def _engine_proposals(
    target: LoadedTarget,
    model: DFlashDrafter,
    prompt: list[int],
    new_tokens: int,
    monkeypatch: pytest.MonkeyPatch,
) -> dict[int, Tensor]:
    """Anchor position → the proposal of the decode engine's speculative loop (``dflash eval``'s)."""
    from dflash_offline.decode.drafting import StaticDrafter
    from dflash_offline.decode.single import SingleSequence

    proposals: dict[int, Tensor] = {}
    draft = StaticDrafter.draft

    def recording(
        self: StaticDrafter, anchor_1: Tensor, anchor_position_1: Tensor, attend_len: int
    ) -> Tensor:
        out = draft(self, anchor_1, anchor_position_1, attend_len)
        proposals[int(anchor_position_1.reshape(-1)[0])] = out.clone()
        return out

    monkeypatch.setattr(StaticDrafter, "draft", recording)
    engine = SingleSequence(target.model, max_len=len(prompt) + new_tokens + 2 * BLOCK, cuda_graphs=False)
    result = engine.speculative(
        prompt, model, layer_ids=LAYERS, max_new_tokens=new_tokens, stop_ids=frozenset()
    )
    monkeypatch.undo()
    starts = [len(prompt)]
    for a in result.accepted_per_cycle[:-1]:
        starts.append(starts[-1] + a + 1)
    return {n: proposals[n] for n in starts}


def _round_trip_prefix(target: LoadedTarget, tokens: list[int]) -> list[int]:
    """The longest prefix of ``tokens`` that its decoded text re-tokenizes to: the cache stores text
    answers, and a random target's greedy tokens are not always the tokenizer's own split of their text
    (a real model's mostly are)."""
    tok = target.tokenizer
    for m in range(len(tokens), 0, -1):
        if tok(tok.decode(tokens[:m]), add_special_tokens=False)["input_ids"] == tokens[:m]:
            assert m >= 20, f"only {m} greedy tokens survive a decode/encode round trip"
            return tokens[:m]
    raise AssertionError("no greedy token survives a decode/encode round trip")


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
        ),
    ],
)
def test_training_forward_predicts_what_speculative_decoding_proposes(
    cpu_target: LoadedTarget, tmp_path: Path, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA the training forward runs flex_attention with its BlockMask; decoding runs float32 there
    too (lossless), so the same comparison holds with a float32-on-GPU tolerance."""
    target = cpu_target if device == "cpu" else load_target("random:tiny", device=device, dtype=torch.float32)
    tolerance = 1e-4 if device == "cpu" else 1e-3
    model = _drafter(target).to(device)
    prompt = _prompt_ids(target)
    P = len(prompt)
    caller = TargetCaller(target.model)
    greedy = _round_trip_prefix(
        target,
        list(target_only_decode(caller, prompt, max_new_tokens=NEW_TOKENS, stop_ids=frozenset()).tokens),
    )

    # Decoding: the export, loaded as dflash eval loads it, behind the loop's drafter interface.
    export = export_drafter(model, tmp_path / "drafter")
    recording = RecordingDrafter(load_drafter_for(target, export, dtype=torch.float32))
    decoded = speculative_decode(
        caller, recording, prompt, layer_ids=LAYERS, max_new_tokens=len(greedy), stop_ids=frozenset()
    )
    assert list(decoded.tokens) == greedy  # float32: the loop is lossless
    assert len(recording.calls) >= 5
    # What dflash eval runs: the decode engine drafting on the device (its static drafter context).
    engine_proposals = _engine_proposals(target, recording.inner.model, prompt, len(greedy), monkeypatch)
    assert set(engine_proposals) == {c.anchor_position for c in recording.calls}

    # Training: the conversation with the target's own answer, through dflash generate into a cache.
    answer = target.tokenizer.decode(greedy, skip_special_tokens=False)
    data = tmp_path / "answers.jsonl"
    with open(data, "w") as f:
        f.write(json.dumps({"id": "other", "messages": OTHER}) + "\n")
        f.write(
            json.dumps({"id": "sample", "messages": [*PROMPT, {"role": "assistant", "content": answer}]})
            + "\n"
        )
    run_generate(tiny_config(tmp_path / "cache", data))
    with CacheReader.open(tmp_path / "cache") as reader:
        rows = {int(reader.samples.source_index[r]): r for r in range(len(reader.samples.source_index))}
        (other, sample) = reader.read_rows([rows[0], rows[1]])
        ids = sample.input_ids_T.long().tolist()
        # What the cache trains on is the eval prompt followed by the greedy answer, whose tokens carry
        # loss from the first one on (the first decoding cycle's anchor is answer token 0).
        assert ids[:P] == prompt, "the chat template renders the prompt differently in training"
        assert ids[P : P + len(greedy)] == greedy, "the answer does not re-tokenize to the greedy tokens"
        mask = sample.loss_mask_T.bool()
        assert not mask[:P].any()
        assert mask[P : P + len(greedy)].all()
        # The cached features are the ones the loop captured (bf16 storage of the same float32 rows).
        cached_TF = sample.features_TF
        live_TF = FeatureCapture(cpu_target, LAYERS)(
            torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long)
        )[0]
        assert torch.equal(cached_TF, live_TF.to(torch.bfloat16))
        fed = recording.calls[-1].context_CF.cpu()
        torch.testing.assert_close(fed, live_TF[: fed.shape[0]], rtol=tolerance / 10, atol=tolerance / 10)

        # The training forward over a packed row [other ; sample] with an anchor at every eligible position.
        offset = other.num_tokens
        plan = MicrobatchPlan(
            index_in_step=0,
            rank=0,
            rows=(0, 1),
            sample_ids=(other.sample_id, sample.sample_id),
            bucket_ids=(other.bucket_id, sample.bucket_id),
            num_tokens=other.num_tokens + sample.num_tokens,
        )

        def every_eligible(request: AnchorRequest) -> Tensor:
            return torch.nonzero(eligible_anchor_mask(request.loss_mask_T, request.doc_ids_T)).flatten()

        job = ScheduledMicrobatch(plan=plan, reader_rows=(rows[0], rows[1]), anchor_seed=0)
        with Prefetcher(
            reader, [job], device=device, anchor_fn=every_eligible, loss_block_size=BLOCK
        ) as prefetcher:
            (batch,) = list(prefetcher)
    inputs = batch.inputs
    with torch.no_grad():
        hidden_QH = model.forward_hidden(inputs, attention="auto")  # SDPA on the CPU, flex on CUDA
        logits_AKV = (hidden_QH.view(inputs.num_anchors, BLOCK, -1)[:, 1:] @ model.lm_head_VH.T).float()
    anchor_row = {int(a): j for j, a in enumerate(inputs.anchors_A.tolist())}

    compared = 0
    for call in recording.calls:
        n = call.anchor_position
        if offset + n not in anchor_row:  # a cycle anchored on the answer's last token: no label
            continue
        assert call.anchor_token == ids[n]
        trained_KV = logits_AKV[anchor_row[offset + n]]
        # The same computation from the same (cached) features: equal up to float32 summation order.
        expected_KV = recording.inner.model.draft_logits(
            context_features_CF=cached_TF[:n].float().to(device), anchor_token=ids[n], anchor_position=n
        )
        torch.testing.assert_close(trained_KV, expected_KV, rtol=tolerance, atol=tolerance, msg=f"anchor {n}")
        # And what the loops actually proposed (from their own float32 features): the same argmax
        # wherever the two best logits are not within a bf16 rounding of each other.
        top2 = call.logits_KV.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 1e-2
        assert torch.equal(trained_KV.argmax(-1)[clear], call.proposal_K[clear]), f"anchor {n}"
        assert torch.equal(trained_KV.argmax(-1)[clear], engine_proposals[n][clear]), f"engine, anchor {n}"
        compared += 1
    assert compared >= 5
