"""The nf4 feature codec against an independent numpy reference and the format's own error bound, and
through writer, reader, verify and the fingerprint.

Shape legend: T = tokens, L = layers, H = hidden size, K = outliers, W = stored bytes per token.
The reference re-derives the row from nf4.py's docstring (smallest e with max |x| ≤ 2^e, the code
of the nearest bf16-rounded NF4 level, the lower one on a tie, nibble order, outliers by (|x|, lower
dim)); it shares no code with the production functions.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from dflash_offline.cache.codecs import NF4_SCHEME, feature_storage, storage_dtype
from dflash_offline.cache.nf4 import Nf4Layout, decode_rows, encode_rows
from dflash_offline.cache.reader import CacheReader
from dflash_offline.cache.rows import Fp8Rows, SampleToWrite
from dflash_offline.cache.verify import verify_cache
from dflash_offline.cache.writer import ShardWriter
from dflash_offline.errors import FingerprintMismatchError
from tests.cache._samples import TINY, make_fingerprint
from tests.cache.fp8_reference import HIDDEN, LAYERS, K, as_f64, features

# QLoRA's NF4 levels, rounded to bf16 here (numpy: keep the top 16 bits of the float32 bits, to nearest even).
_NF4 = np.array(
    [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
     -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
     0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
     0.7229568362236023, 1.0],
    dtype=np.float32,
)  # fmt: skip
_bits = _NF4.view(np.uint32).astype(np.uint64)
LEVELS = ((((_bits + 0x7FFF + ((_bits >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)).astype(
    np.float64
)
MAX_HALF_GAP = float(np.diff(LEVELS).max() / 2)
_mid = (LEVELS[1:] + LEVELS[:-1]) / 2
TIES = _mid[torch.from_numpy(_mid).to(torch.bfloat16).double().numpy() == _mid]
"""The midpoints of adjacent levels that are bf16 values: features that tie between two codes."""

LAYOUTS = [(HIDDEN, K), (HIDDEN, 0), (4, 0), (8, 2), (2, 1)]


def ref_encode(
    x_TF: np.ndarray, group: int, k: int, *, layers: int = LAYERS, hidden: int = HIDDEN
) -> np.ndarray:
    """uint8 [T, W] rows of float64 (bf16-valued) features, as nf4.py documents them."""
    T = x_TF.shape[0]
    x = x_TF.reshape(T, layers, hidden)
    G = hidden // group
    codes = np.zeros((T, layers, hidden), np.int64)
    exps = np.zeros((T, layers, G), np.int8)
    idx = np.zeros((T, layers, k), np.uint16)
    vals = np.zeros((T, layers, k), np.float64)
    for t in range(T):
        for layer in range(layers):
            row = x[t, layer].copy()
            top = sorted(sorted(range(hidden), key=lambda d: (-abs(row[d]), d))[:k])
            idx[t, layer], vals[t, layer] = top, row[top]
            row[top] = 0.0
            for g in range(G):
                part = row[g * group : (g + 1) * group]
                amax = float(np.abs(part).max())
                e = 0
                if amax > 0:
                    e = -130
                    while amax > 2.0**e:
                        e += 1
                exps[t, layer, g] = e
                v = part / 2.0**e
                codes[t, layer, g * group : (g + 1) * group] = np.abs(v[:, None] - LEVELS).argmin(axis=1)
    nibbles = (codes.reshape(T, -1) & 0xF).astype(np.uint8)
    packed = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
    vals_bits = (vals.astype(np.float32).view(np.uint32) >> 16).astype("<u2")  # exact: bf16 values
    return np.concatenate(
        [
            packed,
            exps.reshape(T, -1).view(np.uint8),
            idx.astype("<u2").reshape(T, -1).view(np.uint8),
            vals_bits.reshape(T, -1).view(np.uint8),
        ],
        axis=1,
    )


def decoded(x_TF: torch.Tensor, layout: Nf4Layout) -> torch.Tensor:
    out = torch.full_like(x_TF, 7.0)
    return decode_rows(encode_rows(x_TF, layout), layout, out)


# ---- encode / decode ----------------------------------------------------------------------------
@pytest.mark.parametrize(("group", "k"), LAYOUTS)
def test_encode_matches_reference_bytes(group, k):
    layout = Nf4Layout(num_layers=LAYERS, hidden_size=HIDDEN, group_dims=group, num_outliers=k)
    x = features(40, seed=group * 10 + k, outliers=True)
    np.testing.assert_array_equal(encode_rows(x, layout).numpy(), ref_encode(as_f64(x), group, k))


@pytest.mark.parametrize(("group", "k"), LAYOUTS)
def test_error_bound_per_element(group, k):
    """Outliers exact; every other element decodes to the nearest level × 2^e, e the smallest exponent
    with max |x| ≤ 2^e over its group's non-outlier dims (computed here from the definition): within
    half the widest gap between levels (0.152) × 2^e of x."""
    layout = Nf4Layout(num_layers=LAYERS, hidden_size=HIDDEN, group_dims=group, num_outliers=k)
    x_TF = features(60, seed=7 + k, outliers=True)
    x = as_f64(x_TF).reshape(60, LAYERS, HIDDEN)
    got = as_f64(decoded(x_TF, layout)).reshape(60, LAYERS, HIDDEN)
    for t in range(60):
        for layer in range(LAYERS):
            row = x[t, layer]
            top = sorted(range(HIDDEN), key=lambda d: (-abs(row[d]), d))[:k]
            assert (got[t, layer, top] == row[top]).all()
            rest = np.ones(HIDDEN, bool)
            rest[top] = False
            for g in range(HIDDEN // group):
                dims = np.arange(g * group, (g + 1) * group)
                dims = dims[rest[dims]]
                if not dims.size:
                    continue
                amax = float(np.abs(row[dims]).max())
                scale = 2.0 ** math.ceil(math.log2(amax)) if amax else 1.0
                assert scale < 2 * amax or amax == 0
                v, level = row[dims] / scale, got[t, layer, dims] / scale
                assert np.isin(level, LEVELS).all()
                nearest = np.abs(v[:, None] - LEVELS).min(axis=1)
                np.testing.assert_array_equal(np.abs(v - level), nearest)
                assert np.abs(got[t, layer, dims] - row[dims]).max() <= MAX_HALF_GAP * scale


def test_all_zero_rows_round_trip():
    layout = Nf4Layout(num_layers=LAYERS, hidden_size=HIDDEN, group_dims=4, num_outliers=K)
    x = torch.zeros((3, LAYERS * HIDDEN), dtype=torch.bfloat16)
    assert torch.equal(decoded(x, layout), x)


def test_encoding_is_the_same_under_permutations_of_tokens_and_layers():
    """Ties everywhere: ±a in every dim of some rows (every dim ties for the top K), values on the midpoint
    of two levels (the lower one wins), so the encoder must break ties by rule, and a row's bytes cannot
    depend on its neighbours."""
    layout = Nf4Layout(num_layers=LAYERS, hidden_size=HIDDEN, group_dims=8, num_outliers=K)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(50, LAYERS, HIDDEN, generator=gen)
    signs = torch.randint(0, 2, (20, LAYERS, HIDDEN), generator=gen) * 2 - 1
    x[:20] = signs * 3.0
    x[20:30, :, ::2] = 1.0  # sets the scale of every 8 dims: 2^0
    x[20:30, :, 1::2] = torch.tensor(TIES[: (HIDDEN // 2)].tolist() * 2)[: HIDDEN // 2]  # on midpoints
    x_TF = x.reshape(50, -1).to(torch.bfloat16)
    rows = encode_rows(x_TF, layout)
    perm = torch.randperm(50, generator=gen)
    assert torch.equal(encode_rows(x_TF[perm], layout), rows[perm])
    flipped = x_TF.view(50, LAYERS, HIDDEN).flip(1).reshape(50, -1)
    want = decoded(x_TF, layout).view(50, LAYERS, HIDDEN).flip(1).reshape(50, -1)
    assert torch.equal(decoded(flipped, layout), want)
    np.testing.assert_array_equal(rows.numpy(), ref_encode(as_f64(x_TF), 8, K))
    # The rows where every dim ties keep the K lowest dims as outliers.
    idx = rows[:20, layout.index_offset : layout.index_offset + 2 * LAYERS * K].contiguous().view(torch.int16)
    assert idx.reshape(20, LAYERS, K).tolist() == [[list(range(K))] * LAYERS] * 20


def test_row_bytes_within_the_budget_at_smollm2_and_qwen3_8b_widths():
    """4-bit codes (H / 2 bytes), one int8 exponent per 32 dims, 2 outliers × 4 bytes, per layer."""
    for hidden, want in ((576, 5 * (288 + 18 + 8)), (4096, 5 * (2048 + 128 + 8))):
        storage = feature_storage("nf4", num_layers=5, hidden_size=hidden)
        assert storage.width == want
        assert storage.width <= 0.28 * 5 * hidden * 2
    assert (want, NF4_SCHEME.group_dims) == (10_920, 32)


# ---- through the cache ----------------------------------------------------------------------------
WIDE = 64
"""Hidden size of the cached test features: two of the codec's 32-dim scale groups."""


def wide_features(T: int, seed: int) -> torch.Tensor:
    """bf16 [T, LAYERS * WIDE]: Gaussian dims of mixed scale, two massive activations of distinct size."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(T, LAYERS, WIDE)) * np.exp2(rng.integers(-12, 6, size=(1, LAYERS, WIDE)))
    x[:, :, 50] = rng.choice([-1, 1], size=(T, LAYERS)) * 24_000.0
    x[:, :, 7] = rng.choice([-1, 1], size=(T, LAYERS)) * 3_000.0
    return torch.from_numpy(x.reshape(T, -1).astype(np.float32)).to(torch.bfloat16)


def nf4_fingerprint(codec: str = "nf4"):
    return make_fingerprint(codec=codec, hidden_size=WIDE, layer_ids=(1, 2), storage_dtype="nf4")


def nf4_samples(fingerprint, indices, seed: int = 0) -> list[SampleToWrite]:
    out = []
    for i in indices:
        rng = np.random.default_rng([seed, i])
        T = int(rng.integers(1, 30))
        out.append(
            SampleToWrite(
                sample_id=f"q{seed}-{i:04d}",
                source_index=i,
                input_ids_T=rng.integers(0, 50_000, size=T, dtype=np.int32),
                loss_mask_T=rng.integers(0, 2, size=T).astype(np.uint8),
                features_TF=wide_features(T, seed=1000 * seed + i),
                bucket_id=bisect.bisect_left(fingerprint.bucket_edges, T),
            )
        )
    return out


@pytest.mark.parametrize("codec", ["nf4", "nf4-zstd-1"])
def test_round_trip_through_writer_reader_and_verify(tmp_path, codec):
    fingerprint = nf4_fingerprint(codec)
    storage = feature_storage(codec, num_layers=LAYERS, hidden_size=WIDE)
    layout = storage.lossy
    assert isinstance(layout, Nf4Layout)
    samples = nf4_samples(fingerprint, range(40))
    with ShardWriter(tmp_path, fingerprint, worker=0, flush_seconds=1e9, **TINY) as writer:
        for sample in samples[:30]:
            writer.add(sample)
        for sample in samples[30:]:  # as generate hands them over: encoded where the features were
            assert sample.features_TF is not None
            rows = Fp8Rows(layout=layout, rows_TW=encode_rows(sample.features_TF, layout))
            writer.add(replace(sample, features_TF=None, fp8_rows=rows))
    assert verify_cache(tmp_path, progress=False).ok
    ids = [s.sample_id for s in samples]
    with CacheReader.open(tmp_path, check_checksums=True) as reader:
        got = reader.read(ids)
        rows_at = reader.positions(ids)
        stored_out = np.empty((int(reader.samples.num_tokens[rows_at].sum()), storage.width), np.uint8)
        raw = reader.read_rows(rows_at, stored_out=stored_out)
    for src, sample, stored in zip(samples, got, raw, strict=True):
        assert src.features_TF is not None
        assert stored.stored_TW is not None
        want_rows = ref_encode(as_f64(src.features_TF), 32, 2, hidden=WIDE)
        np.testing.assert_array_equal(stored.stored_TW.numpy(), want_rows)
        want = decode_rows(torch.from_numpy(want_rows), layout, torch.empty_like(src.features_TF))
        assert torch.equal(sample.features_TF, want)
        np.testing.assert_array_equal(sample.input_ids_T.numpy(), src.input_ids_T)


def test_the_fingerprint_refuses_mixing_nf4_with_other_codecs(tmp_path):
    with ShardWriter(tmp_path, nf4_fingerprint(), worker=0, **TINY) as writer:
        writer.add(nf4_samples(nf4_fingerprint(), [0])[0])
    fp8 = make_fingerprint(codec="fp8", hidden_size=WIDE, layer_ids=(1, 2), storage_dtype="float8_e4m3fn")
    bf16 = make_fingerprint(codec="blosc-zstd-1-shuffle", hidden_size=WIDE, layer_ids=(1, 2))
    for other in (fp8, bf16):
        with pytest.raises(FingerprintMismatchError, match="storage_dtype"):
            ShardWriter(tmp_path, other, worker=1, **TINY)
    with pytest.raises(FingerprintMismatchError, match="codec"):
        ShardWriter(tmp_path, nf4_fingerprint("nf4-zstd-1"), worker=1, **TINY)
    assert storage_dtype("nf4") == storage_dtype("nf4-zstd-1") == "nf4"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("group", "k"), [(32, NF4_SCHEME.num_outliers), (576, 0), (64, 4)])
def test_gpu_encode_and_decode_equal_the_cpu_bit_for_bit(group, k):
    """Generate encodes on its device and training decodes on its own: the bytes and the decoded bits
    must not depend on which. Massive activations, planted ties and half-way codes besides."""
    layout = Nf4Layout(num_layers=5, hidden_size=576, group_dims=group, num_outliers=k)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4000, 2880, generator=gen) * torch.logspace(-3, 2, 2880)
    x[:, [17, 600, 1400]] = 24_000.0
    x[::3, [40, 41, 900, 2000]] = -24_000.0
    x[1::5, :64] = 1.0
    x[1::5, 64:128] = torch.tensor(TIES.tolist() * 10)[:64]  # between two codes, and ties in the top K
    x[:7] = 0.0
    x_TF = x.to(torch.bfloat16)
    on_cpu = encode_rows(x_TF, layout)
    on_gpu = encode_rows(x_TF.cuda(), layout).cpu()
    unchecked = encode_rows(x_TF.cuda(), layout, check_finite=False).cpu()
    assert torch.equal(on_cpu, on_gpu)
    assert torch.equal(on_cpu, unchecked)
    out_cpu = decode_rows(on_cpu, layout, torch.empty_like(x_TF))
    out_gpu = decode_rows(on_cpu.cuda(), layout, torch.empty_like(x_TF).cuda()).cpu()
    assert torch.equal(out_cpu.view(torch.int16), out_gpu.view(torch.int16))
