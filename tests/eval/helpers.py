"""Shared by the eval, regenerate and plot tests: chat data, untrained drafter exports, tiny caches,
fake drafters whose proposals a test controls, and a one-thread switch for tiny CPU matmuls."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from dflash_offline.cache.fingerprint import CacheFingerprint
from dflash_offline.cache.rows import SampleToWrite
from dflash_offline.cache.writer import ShardWriter
from dflash_offline.data.conversations import Conversation
from dflash_offline.data.sources import iter_records
from dflash_offline.drafter import DFlashDrafter, DrafterConfig, export_drafter, resolve_mask_token_id
from dflash_offline.target_model.head import load_embedding_and_head
from dflash_offline.target_model.loader import LoadedTarget, load_tokenizer

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex bad jokes".split()  # noqa: SIM905


@contextmanager
def one_thread() -> Iterator[None]:
    """On the shared 2-core machine two-thread GEMMs of 2..8 rows measured 9..16 ms (OpenMP waiting on a
    descheduled thread) against 5 µs with one thread: tiny-model tests run single-threaded."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def write_chat_jsonl(path: Path, num_records: int, *, seed: int = 0, turns: int = 1) -> Path:
    """Chat JSONL: ``turns`` user/assistant pairs per record (a system turn on every third)."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for i in range(num_records):
            messages = [{"role": "system", "content": "Answer briefly."}] if i % 3 == 0 else []
            for _ in range(turns):
                user = " ".join(rng.choice(WORDS, int(rng.integers(3, 12))))
                bot = " ".join(rng.choice(WORDS, int(rng.integers(3, 20))))
                messages += [{"role": "user", "content": user}, {"role": "assistant", "content": bot}]
            f.write(json.dumps({"id": f"rec-{i}", "messages": messages}) + "\n")
    return path


def untrained_drafter(
    target: LoadedTarget, *, block_size: int, layer_ids: tuple[int, ...] = (0, 2), seed: int = 0
) -> DFlashDrafter:
    """A freshly initialised 1-layer drafter over the target's own embedding and LM head."""
    info = target.info
    config = DrafterConfig.from_target_config(
        info.hf_config,
        target_layer_ids=layer_ids,
        mask_token_id=resolve_mask_token_id(target.tokenizer, info.vocab_size),
        num_layers=1,
        block_size=block_size,
    )
    torch.manual_seed(seed)
    model = target.model
    return DFlashDrafter(
        config,
        embed_VH=model.get_input_embeddings().weight,
        lm_head_VH=model.get_output_embeddings().weight,
    )


def export_untrained(target: LoadedTarget, out_dir: Path, *, block_size: int = 4) -> Path:
    return export_drafter(untrained_drafter(target, block_size=block_size), out_dir)


def export_untrained_for(spec: str, out_dir: Path, *, block_size: int, layer_ids: tuple[int, ...]) -> Path:
    """An untrained drafter export for ``spec`` built from its embedding and head alone (no target load)."""
    head = load_embedding_and_head(spec)
    config = DrafterConfig.from_target_config(
        head.info.hf_config,
        target_layer_ids=layer_ids,
        mask_token_id=resolve_mask_token_id(load_tokenizer(spec), head.info.vocab_size),
        num_layers=1,
        block_size=block_size,
    )
    torch.manual_seed(0)
    return export_drafter(DFlashDrafter(config, embed_VH=head.embed_VH, lm_head_VH=head.lm_head_VH), out_dir)


def conversations(path: Path) -> list[Conversation]:
    return [c for c in iter_records(path) if isinstance(c, Conversation)]


def tiny_fingerprint(
    *, data_source: str, target_id: str = "random:tiny", weights_hash: str = "x"
) -> CacheFingerprint:
    return CacheFingerprint(
        target_id=target_id,
        weights_hash=weights_hash,
        num_target_layers=4,
        layer_ids=(0, 2),
        hidden_size=8,
        storage_dtype="bfloat16",
        codec="blosc-zstd-1-shuffle",
        tokenizer_hash="tok",
        chat_template_hash="tpl",
        max_length=64,
        too_long="skip",
        bucket_edges=(8, 16, 32, 64),
        data_source=data_source,
        compute_dtype="float32",
    )


def write_tiny_cache(
    root: Path, sample_ids: Sequence[str], *, data_source: str, lengths: Sequence[int] | None = None
) -> Path:
    """A real cache whose committed samples have the given ids (random features, 4 buckets)."""
    fp = tiny_fingerprint(data_source=data_source)
    rng = np.random.default_rng(0)
    with ShardWriter(root, fp, worker=0, shard_bytes=4096, chunk_bytes=512) as writer:
        for i, sample_id in enumerate(sample_ids):
            n = int(lengths[i]) if lengths is not None else int(rng.integers(1, 65))
            bits = rng.integers(0, 1 << 15, size=(n, fp.feature_width), dtype=np.uint16)
            writer.add(
                SampleToWrite(
                    sample_id=sample_id,
                    source_index=i,
                    input_ids_T=rng.integers(0, 1000, n).astype(np.int32),
                    loss_mask_T=np.ones(n, dtype=np.uint8),
                    features_TF=torch.from_numpy(bits).view(torch.bfloat16),
                    bucket_id=int(np.searchsorted(fp.bucket_edges, n)),
                )
            )
    return root


class ScriptedDrafter:
    """Proposes the reference continuation, corrupted so that cycle c accepts exactly ``script[c]``
    tokens (the reference's token at that slot is replaced by another id); after the script, perfect.

    ``reference`` is the target-only greedy output for the prompt, so a correct draft is known without
    a model. It also records every context handed to it, to check what the loop passes.

    It speaks both drafter interfaces: ``propose`` (the reference loop's, ``tests/oracles``) and
    ``ingest``/``draft`` (the decode engine's ``Drafter``, on the host: not capturable). The engine hands
    over whole verify blocks at their positions, stale rows included; ``draft`` passes ``propose`` the
    rows of the positions below the anchor not yet handed over, the reference loop's contract."""

    capturable = False

    def __init__(
        self, *, block_size: int, prompt_len: int, reference: Sequence[int], script: Sequence[int] = ()
    ):
        self._block_size = block_size
        self.prompt_len = prompt_len
        self.reference = list(reference)
        self.script = list(script)
        self.cycle = 0
        self.contexts: list[tuple[int, Tensor]] = []
        """(anchor position, new features) per call."""
        self.anchors: list[tuple[int, int]] = []
        """(anchor token, anchor position) per call."""
        self._ingested: list[tuple[int, Tensor]] = []
        """(start position, features) handed over by ``ingest`` since the last ``draft``."""
        self._seen = 0
        """Positions below this were passed to ``propose``."""

    @property
    def block_size(self) -> int:
        return self._block_size

    def reset(self) -> None:
        self.cycle = 0
        self.contexts.clear()
        self.anchors.clear()
        self._ingested.clear()
        self._seen = 0

    def ingest(self, features_CF: Tensor, start_1: Tensor) -> None:
        start = int(start_1)
        if start == 0:  # a new prompt
            self.reset()
        self._ingested.append((start, features_CF.clone()))

    def draft(self, anchor_1: Tensor, anchor_position_1: Tensor, attend_len: int) -> Tensor:
        n, seen = int(anchor_position_1), self._seen
        # The latest features handed over for the first position not yet seen cover every one up to n.
        start, features = next((s, f) for s, f in reversed(self._ingested) if s <= seen < s + len(f))
        assert n <= start + len(features), (n, start, len(features))
        self._ingested.clear()
        self._seen = n
        new_CF = features[seen - start : n - start]
        draft_K = self.propose(new_features_CF=new_CF, anchor_token=int(anchor_1), anchor_position=n)
        return draft_K.to(anchor_1.device)

    def propose(self, *, new_features_CF: Tensor, anchor_token: int, anchor_position: int) -> Tensor:
        self.contexts.append((anchor_position, new_features_CF.clone()))
        self.anchors.append((anchor_token, anchor_position))
        K = self._block_size - 1
        # reference[j] is the token at position prompt_len + j.
        start = anchor_position - self.prompt_len + 1
        draft = [self.reference[j] if j < len(self.reference) else 0 for j in range(start, start + K)]
        if self.cycle < len(self.script) and self.script[self.cycle] < K:
            bad = self.script[self.cycle]
            draft[bad] = (draft[bad] + 1) % 1000  # any other id: this slot is rejected
        self.cycle += 1
        return torch.tensor(draft, dtype=torch.int64)
