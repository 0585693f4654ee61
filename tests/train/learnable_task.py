"""A synthetic task a drafter can learn only by reading the features: a cache whose features carry the
next tokens' embeddings, and a small well-conditioned frozen embedding/LM head installed in place of a
target's (64 rows of N(0, 1), tied): with random:tiny's 49,152 near-zero head rows in 64 dimensions even a
perfect reader of the features needs hundreds of steps to separate its logits. Used by the learnability
and validation tests."""

from __future__ import annotations

import bisect
from pathlib import Path

import numpy as np
import torch

from dflash_offline.cache.fingerprint import CacheFingerprint
from dflash_offline.cache.rows import SampleToWrite
from dflash_offline.cache.writer import ShardWriter
from dflash_offline.drafter.config import DrafterConfig
from dflash_offline.drafter.model import DFlashDrafter
from dflash_offline.train.config import TrainConfig
from dflash_offline.train.step import DrafterSetup

EDGES = (16, 32)
MIN_LEN, MAX_LEN = 8, 25  # short documents: few context positions for the attention to search
LAYERS = (0, 2)
TOKENS = 48  # token ids 0..47 (i.i.d. in the data); the vocabulary has 64 rows, the mask is 63
VOCAB = 64
HIDDEN = 64


def embedding() -> torch.Tensor:
    """The frozen (tied) embedding/LM head [VOCAB, HIDDEN]: N(0, 1) rows, well separated."""
    return torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(123))


def features(local_T: np.ndarray) -> torch.Tensor:
    """float32 [T, 2·HIDDEN]: at position p, "layer" j carries the embedding of token p+1+j (zero past
    the end), as a target's hidden state carries what comes next."""
    emb = embedding()
    n = len(local_T)
    ids = torch.from_numpy(local_T)
    feats = torch.zeros(n, len(LAYERS), HIDDEN)
    for j in range(len(LAYERS)):
        feats[: n - 1 - j, j] = emb[ids[1 + j :]]
    return feats.reshape(n, -1)


def write_cache(
    root: Path,
    *,
    zero_features: bool,
    num_samples: int = 400,
    seed: int = 0,
    two_turns: bool = False,
    common_token_share: float = 0.0,
) -> Path:
    """A cache of ``num_samples`` i.i.d. token sequences: one "prompt" token, then the "answer" (with
    ``two_turns``, two answers: two "user" tokens in the middle carry no loss). ``common_token_share``:
    the share of positions that hold token 0 instead of a uniform draw (a drafter learns to propose it
    within a few steps, so that its blocks accept runs of every length)."""
    fp = CacheFingerprint(
        target_id="synthetic",
        weights_hash="0" * 16,
        num_target_layers=4,
        layer_ids=LAYERS,
        hidden_size=HIDDEN,
        storage_dtype="bfloat16",
        codec="blosc-zstd-1-shuffle",
        tokenizer_hash="synthetic",
        chat_template_hash="synthetic",
        max_length=EDGES[-1],
        too_long="skip",
        bucket_edges=EDGES,
        data_source="synthetic-learnability",
        compute_dtype="float32",
    )
    rng = np.random.default_rng(seed)
    with ShardWriter(root, fp, worker=0) as writer:
        for i in range(num_samples):
            n = int(rng.integers(MIN_LEN, MAX_LEN + 1))
            local = rng.integers(0, TOKENS, n)  # i.i.d.: without the features nothing is predictable
            if common_token_share:  # drawn only when asked: the default keeps other tests' calibrated stream
                local[rng.random(n) < common_token_share] = 0
            feats = features(local) * (0.0 if zero_features else 1.0)
            mask = np.zeros(n, dtype=np.uint8)
            mask[1:] = 1  # a short "prompt", then the "answer"
            if two_turns:
                mask[n // 2 : n // 2 + 2] = 0
            writer.add(
                SampleToWrite(
                    sample_id=f"learn:{i:04d}",
                    source_index=i,
                    input_ids_T=local.astype(np.int32),
                    loss_mask_T=mask,
                    features_TF=feats.to(torch.bfloat16),
                    bucket_id=bisect.bisect_left(EDGES, n),
                )
            )
    return root


def synthetic_setup(
    config: TrainConfig, fingerprint: CacheFingerprint, *, device: torch.device
) -> DrafterSetup:
    embed = embedding()
    drafter_config = DrafterConfig(
        hidden_size=HIDDEN,
        num_layers=config.drafter.num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        vocab_size=VOCAB,
        block_size=config.drafter.block_size,
        target_layer_ids=fingerprint.layer_ids,
        num_target_layers=fingerprint.num_target_layers,
        mask_token_id=VOCAB - 1,
        max_position_embeddings=256,
        num_anchors=config.data.num_anchors,
    )
    torch.manual_seed(config.data.seed)
    model = DFlashDrafter(drafter_config, embed_VH=embed, lm_head_VH=embed).to(device)
    return DrafterSetup(model=model, target_spec="synthetic")
