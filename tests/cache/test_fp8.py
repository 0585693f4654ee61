"""The fp8 feature codec against an independent numpy reference (``fp8_reference.py``), and through
writer, reader and verify.

Shape legend: T = tokens, L = layers, H = hidden size, K = outliers, W = stored bytes per token.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from dflash_offline.cache.codecs import feature_storage
from dflash_offline.cache.fp8 import Fp8Layout, decode_rows, encode_rows
from dflash_offline.cache.layout import CacheLayout
from dflash_offline.cache.reader import CacheReader
from dflash_offline.cache.rows import Fp8Rows, SampleToWrite
from dflash_offline.cache.shard_file import ShardFile
from dflash_offline.cache.verify import verify_cache
from dflash_offline.cache.writer import ShardWriter
from dflash_offline.cache.zarr_format import parse_array_format
from dflash_offline.errors import FingerprintMismatchError, SampleError
from tests.cache._samples import TINY, make_fingerprint
from tests.cache.fp8_reference import (
    CODEC_K,
    HIDDEN,
    LAYERS,
    K,
    as_f64,
    features,
    ref_decode,
    ref_encode,
)

LAYOUTS = [(HIDDEN, K), (HIDDEN, 0), (4, 0), (8, 2)]


# ---- encode / decode ----------------------------------------------------------------------------
@pytest.mark.parametrize(("group", "k"), LAYOUTS)
def test_encode_matches_reference_bytes(group, k):
    layout = Fp8Layout(num_layers=LAYERS, hidden_size=HIDDEN, group_dims=group, num_outliers=k)
    x = features(64, seed=group + k, outliers=k == K)
    got = encode_rows(x, layout).numpy()
    assert got.shape == (64, layout.row_bytes)
    want = ref_encode(as_f64(x), group, k)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(("group", "k"), LAYOUTS)
def test_decode_is_the_reference_dequantisation_exactly(group, k):
    """Any valid stored bytes, not only what encode makes: random codes, exponents (up to 110: encode
    never makes a code × 2^e beyond bf16's range), outliers."""
    layout = Fp8Layout(num_layers=LAYERS, hidden_size=HIDDEN, group_dims=group, num_outliers=k)
    rng = np.random.default_rng(7)
    T, F = 50, LAYERS * HIDDEN
    codes = rng.integers(0, 256, size=(T, F), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x80  # no NaN codes (encode never writes them); -0 instead
    exps = rng.integers(-100, 111, size=(T, LAYERS * (HIDDEN // group))).astype(np.int8).view(np.uint8)
    parts = [codes, exps]
    if k:
        idx = np.stack([rng.permutation(HIDDEN)[:k] for _ in range(T * LAYERS)]).astype("<u2")
        vals = rng.normal(size=(T * LAYERS, k)).astype(np.float32).view(np.uint32) >> 16
        parts += [idx.reshape(T, -1).view(np.uint8), vals.astype("<u2").reshape(T, -1).view(np.uint8)]
    stored = np.ascontiguousarray(np.concatenate(parts, axis=1))
    out = torch.empty((T, F), dtype=torch.bfloat16)
    decode_rows(torch.from_numpy(stored), layout, out)
    want = ref_decode(stored, group, k)
    got = as_f64(out)
    np.testing.assert_array_equal(got, want)  # exact: code × 2^e is a bf16 value
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))  # ±0 kept


@pytest.mark.parametrize(("group", "k"), LAYOUTS)
def test_error_bound_per_element(group, k):
    layout = Fp8Layout(num_layers=LAYERS, hidden_size=HIDDEN, group_dims=group, num_outliers=k)
    x = features(200, seed=3, outliers=True)
    stored = encode_rows(x, layout)
    out = torch.empty_like(x)
    decode_rows(stored, layout, out)
    x64, d64 = as_f64(x), as_f64(out)
    G = HIDDEN // group
    exps = stored[:, LAYERS * HIDDEN : LAYERS * HIDDEN + LAYERS * G].numpy().view(np.int8).astype(np.float64)
    scale = np.repeat(np.exp2(exps), group, axis=1)  # [T, F]: 2^e of each element's group
    scaled = np.abs(x64) / scale
    err = np.abs(d64 - x64)
    normal = scaled >= 2.0**-6
    assert normal.mean() > 0.5  # the bound below is not vacuous
    assert np.all(err[normal] <= 2.0**-4 * np.abs(x64[normal]))  # half an ulp of 3 mantissa bits
    assert np.all(err[~normal] <= 2.0**-10 * scale[~normal])  # half the subnormal step 2^-9
    assert np.all(scaled[err > 0] <= 448)  # the scale makes every value representable
    if k:  # the massive activations are stored exactly
        largest = [d + layer * HIDDEN for layer in range(LAYERS) for d in (14, 0, 11, 5)[:k]]
        np.testing.assert_array_equal(d64[:, largest], x64[:, largest])
    if k == K:  # every massive activation apart: only the rounding of ordinary values remains
        assert np.linalg.norm(d64 - x64) / np.linalg.norm(x64) < 1e-3


def test_outliers_rescue_the_other_dims():
    """The reason for the outliers: one scale per (token, layer) set by a massive activation pushes
    the ordinary dims into e4m3's subnormals; storing the K largest apart keeps them at 2^-4."""
    rng = np.random.default_rng(5)
    x_TLH = 0.1 * rng.normal(size=(200, LAYERS, HIDDEN))  # ordinary dims small, massive ones 24,000
    x_TLH[:, :, [5, 11, 0, 14]] = 24_000.0 * rng.choice([-1, 1], size=(200, LAYERS, 4))
    x = torch.from_numpy(x_TLH.reshape(200, -1)).to(torch.bfloat16)
    keep = np.ones(LAYERS * HIDDEN, bool)
    keep[[d + layer * HIDDEN for layer in range(LAYERS) for d in (5, 11, 0, 14)]] = False
    errors = {}
    for k in (0, K):
        layout = Fp8Layout(num_layers=LAYERS, hidden_size=HIDDEN, group_dims=HIDDEN, num_outliers=k)
        out = torch.empty_like(x)
        decode_rows(encode_rows(x, layout), layout, out)
        diff = (as_f64(out) - as_f64(x))[:, keep]
        errors[k] = np.linalg.norm(diff) / np.linalg.norm(as_f64(x)[:, keep])
    assert errors[K] < 0.05 < errors[0], errors


@pytest.mark.parametrize(("group", "k"), [(HIDDEN, K), (4, 2), (HIDDEN, 1)])
def test_top_k_ties_go_to_the_lower_dim(group, k):
    """bf16 features tie often; the K kept exactly must be one set whatever ``torch.topk`` does with
    ties (on the CPU it picks neither the lower nor the higher dim), so that every device stores the
    same bytes: the reference keeps the lower dims of equal |x|."""
    layout = Fp8Layout(num_layers=LAYERS, hidden_size=HIDDEN, group_dims=group, num_outliers=k)
    rng = np.random.default_rng(11)
    x = rng.normal(size=(300, LAYERS, HIDDEN))
    for t in range(300):  # 2 to 6 dims of each (token, layer) share the largest |x|, signs mixed
        for layer in range(LAYERS):
            dims = rng.permutation(HIDDEN)[: rng.integers(2, 7)]
            x[t, layer, dims] = rng.choice([-1.0, 1.0], size=len(dims)) * 9.5
    x_TF = torch.from_numpy(x.reshape(300, -1).astype(np.float32)).to(torch.bfloat16)
    np.testing.assert_array_equal(encode_rows(x_TF, layout).numpy(), ref_encode(as_f64(x_TF), group, k))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_features_are_refused(bad):
    layout = Fp8Layout(num_layers=LAYERS, hidden_size=HIDDEN, group_dims=HIDDEN, num_outliers=K)
    x = features(4, seed=0, outliers=True)
    x[2, 7] = bad
    with pytest.raises(SampleError, match="NaN or Inf"):
        encode_rows(x, layout, where="sample 'q'")


def test_all_zero_rows_round_trip():
    layout = Fp8Layout(num_layers=LAYERS, hidden_size=HIDDEN, group_dims=4, num_outliers=K)
    x = torch.zeros((3, LAYERS * HIDDEN), dtype=torch.bfloat16)
    out = torch.full_like(x, 5.0)
    decode_rows(encode_rows(x, layout), layout, out)
    assert torch.equal(out, x)


# ---- through the cache ----------------------------------------------------------------------------
def fp8_fingerprint(codec: str = "fp8"):
    return make_fingerprint(codec=codec, hidden_size=HIDDEN, layer_ids=(1, 2), storage_dtype="float8_e4m3fn")


def fp8_samples(fingerprint, indices, seed: int = 0) -> list[SampleToWrite]:
    out = []
    for i in indices:
        rng = np.random.default_rng([seed, i])
        T = int(rng.integers(1, 30))
        out.append(
            SampleToWrite(
                sample_id=f"f{seed}-{i:04d}",
                source_index=i,
                input_ids_T=rng.integers(0, 50_000, size=T, dtype=np.int32),
                loss_mask_T=rng.integers(0, 2, size=T).astype(np.uint8),
                features_TF=features(T, seed=1000 * seed + i, outliers=True),  # no top-K ties
                bucket_id=bisect.bisect_left(fingerprint.bucket_edges, T),
            )
        )
    return out


@pytest.mark.parametrize("codec", ["fp8", "fp8-zstd-1"])
def test_round_trip_through_writer_and_reader_in_several_sessions(tmp_path, codec):
    fingerprint = fp8_fingerprint(codec)
    storage = feature_storage(codec, num_layers=LAYERS, hidden_size=HIDDEN)
    assert storage.lossy is not None
    written = {}
    for session, indices in enumerate((range(0, 25), range(25, 40), range(40, 60))):
        samples = fp8_samples(fingerprint, indices)
        with ShardWriter(tmp_path, fingerprint, worker=session % 2, flush_seconds=1e9, **TINY) as writer:
            for sample in samples:
                writer.add(sample)
        written.update({s.sample_id: s for s in samples})
    ids = sorted(written)
    with CacheReader.open(tmp_path, check_checksums=True) as reader:
        got = reader.read(ids)
        rows = reader.positions(ids)
        needed = int(reader.samples.num_tokens[rows].sum())
        stored_out = np.empty((needed, storage.width), np.uint8)
        raw = reader.read_rows(rows, stored_out=stored_out)
        packed = np.full((needed + 3, LAYERS * HIDDEN), 0xABCD, dtype=np.uint16)
        into = reader.read_rows(rows, features_out=packed)
    offset = 0
    for sid, sample, stored, packed_sample in zip(ids, got, raw, into, strict=True):
        src = written[sid]
        want_stored = ref_encode(as_f64(src.features_TF), HIDDEN, CODEC_K)
        assert stored.stored_TW is not None
        np.testing.assert_array_equal(stored.stored_TW.numpy(), want_stored)
        assert stored.features_TF.shape == (src.num_tokens, 0)
        want = ref_decode(want_stored, HIDDEN, CODEC_K)
        assert sample.features_TF.dtype == torch.bfloat16
        np.testing.assert_array_equal(as_f64(sample.features_TF), want)
        np.testing.assert_array_equal(as_f64(packed_sample.features_TF), want)
        assert packed_sample.features_TF.data_ptr() == torch.from_numpy(packed[offset]).data_ptr()
        offset += src.num_tokens
        np.testing.assert_array_equal(sample.input_ids_T.numpy(), src.input_ids_T)
        np.testing.assert_array_equal(sample.loss_mask_T.numpy(), src.loss_mask_T)
    assert (packed[offset:] == 0xABCD).all()
    fmt = parse_array_format(
        CacheLayout.at(tmp_path).shard_group(reader.samples.shard[0]) / "features", "features"
    )
    assert fmt.dtype == np.uint8
    assert fmt.width == storage.width


def test_writer_refuses_non_finite_and_goes_on(tmp_path):
    fingerprint = fp8_fingerprint()
    good, bad, after = fp8_samples(fingerprint, range(3))
    broken = bad.features_TF.clone()
    broken[0, 0] = math.nan
    with ShardWriter(tmp_path, fingerprint, worker=0, **TINY) as writer:
        writer.add(good)
        with pytest.raises(SampleError, match=r"'f0-0001'.*NaN or Inf"):
            writer.add(
                SampleToWrite(
                    **{**{f: getattr(bad, f) for f in bad.__dataclass_fields__}, "features_TF": broken}
                )
            )
        writer.add(after)
    with CacheReader.open(tmp_path, check_checksums=True) as reader:
        assert sorted(reader.samples.sample_id.tolist()) == [good.sample_id, after.sample_id]
        reader.read([good.sample_id, after.sample_id])


def pre_encoded(sample: SampleToWrite, layout: Fp8Layout) -> SampleToWrite:
    """The same sample with its features handed over as rows encoded with ``layout``."""
    assert sample.features_TF is not None
    rows = Fp8Rows(layout=layout, rows_TW=encode_rows(sample.features_TF, layout))
    return replace(sample, features_TF=None, fp8_rows=rows)


def stored_rows_and_checksums(root) -> dict[str, tuple[np.ndarray, int]]:
    """sample_id -> (its stored uint8 [T, W] rows, its manifest checksum)."""
    with CacheReader.open(root, check_checksums=True) as reader:
        t = reader.samples
        ids = sorted(t.sample_id.tolist())
        rows = reader.positions(ids)
        width = feature_storage(reader.fingerprint.codec, num_layers=LAYERS, hidden_size=HIDDEN).width
        out = np.empty((int(t.num_tokens[rows].sum()), width), np.uint8)
        read = reader.read_rows(rows, stored_out=out)
        checksums = dict(zip(t.sample_id.tolist(), t.checksum.tolist(), strict=True))
    return {s.sample_id: (s.stored_TW.numpy().copy(), int(checksums[s.sample_id])) for s in read}


@pytest.mark.parametrize("codec", ["fp8", "fp8-zstd-1"])
def test_pre_encoded_rows_are_stored_as_the_writer_encodes_features(tmp_path, codec):
    """What generate hands over (rows encoded where the features were) lands as the same bytes, with
    the same checksums, as the features encoded by the writer; and as the independent reference."""
    fingerprint = fp8_fingerprint(codec)
    layout = feature_storage(codec, num_layers=LAYERS, hidden_size=HIDDEN).lossy
    assert layout is not None
    samples = fp8_samples(fingerprint, range(40))
    for name, batch in (("bf16", samples), ("rows", [pre_encoded(s, layout) for s in samples])):
        with ShardWriter(tmp_path / name, fingerprint, worker=0, flush_seconds=1e9, **TINY) as writer:
            for sample in batch:
                writer.add(sample)
    from_bf16 = stored_rows_and_checksums(tmp_path / "bf16")
    from_rows = stored_rows_and_checksums(tmp_path / "rows")
    assert sorted(from_rows) == sorted(s.sample_id for s in samples)
    for sample in samples:
        rows, checksum = from_rows[sample.sample_id]
        np.testing.assert_array_equal(rows, from_bf16[sample.sample_id][0])
        np.testing.assert_array_equal(rows, ref_encode(as_f64(sample.features_TF), HIDDEN, CODEC_K))
        assert checksum == from_bf16[sample.sample_id][1]


def test_a_sample_holds_either_features_or_rows(tmp_path):
    fingerprint = fp8_fingerprint()
    layout = feature_storage("fp8", num_layers=LAYERS, hidden_size=HIDDEN).lossy
    assert layout is not None
    sample = fp8_samples(fingerprint, [0])[0]
    rows = pre_encoded(sample, layout).fp8_rows
    with pytest.raises(SampleError, match="either features_TF or fp8_rows"):
        replace(sample, fp8_rows=rows)
    with pytest.raises(SampleError, match="either features_TF or fp8_rows"):
        replace(sample, features_TF=None)
    assert rows is not None
    for bad, match in (
        (rows.rows_TW[:, :-1], r"fp8 rows have shape .*expected \[\d+, 50\]"),
        (rows.rows_TW[:-1], r"fp8 rows have shape"),
        (rows.rows_TW.view(torch.int8), "fp8 rows must be uint8"),
    ):
        with pytest.raises(SampleError, match=match):
            replace(sample, features_TF=None, fp8_rows=Fp8Rows(layout=layout, rows_TW=bad))


def test_writer_refuses_rows_of_another_layout_or_into_a_bf16_cache(tmp_path):
    fingerprint = fp8_fingerprint()
    layout = feature_storage("fp8", num_layers=LAYERS, hidden_size=HIDDEN).lossy
    assert layout is not None
    assert layout.row_bytes == 50
    good, narrow, same_width, after = fp8_samples(fingerprint, range(4))
    # 34 bytes a row (no outliers); and 50 bytes a row like the cache's, laid out otherwise (one layer
    # of 32 dims, two scales, four outliers): stored as they are, both would decode to wrong features.
    no_outliers = Fp8Layout(num_layers=LAYERS, hidden_size=HIDDEN, group_dims=HIDDEN, num_outliers=0)
    other = Fp8Layout(num_layers=1, hidden_size=2 * HIDDEN, group_dims=HIDDEN, num_outliers=4)
    assert no_outliers.row_bytes == 34
    assert other.row_bytes == layout.row_bytes
    with ShardWriter(tmp_path / "fp8", fingerprint, worker=0, **TINY) as writer:
        writer.add(pre_encoded(good, layout))
        for sample, bad_layout in ((narrow, no_outliers), (same_width, other)):
            with pytest.raises(SampleError, match=r"rows encoded with Fp8Layout\(.*this cache \('fp8'\)"):
                writer.add(pre_encoded(sample, bad_layout))
        writer.add(after)
    assert sorted(stored_rows_and_checksums(tmp_path / "fp8")) == [good.sample_id, after.sample_id]
    bf16 = make_fingerprint(codec="blosc-zstd-1-shuffle", hidden_size=HIDDEN, layer_ids=(1, 2))
    with ShardWriter(tmp_path / "bf16", bf16, worker=0, **TINY) as writer:
        with pytest.raises(SampleError, match="pre-encoded rows, but this cache's codec"):
            writer.add(pre_encoded(good, layout))
        writer.add(after)
    with CacheReader.open(tmp_path / "bf16", check_checksums=True) as reader:
        assert reader.samples.sample_id.tolist() == [after.sample_id]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("group", "k"), [(576, CODEC_K), (576, 0), (64, 4)])
def test_gpu_encode_equals_cpu_encode_bit_for_bit(group, k):
    """Generate encodes on its device (capture_step.py): the rows must not depend on which one. Random
    bf16 features of SmolLM2's shape tie often among the K largest |x|; massive activations and planted
    exact ties besides, and the unchecked path generate takes."""
    layout = Fp8Layout(num_layers=5, hidden_size=576, group_dims=group, num_outliers=k)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4000, 2880, generator=gen) * torch.logspace(-3, 2, 2880)
    x[:, [17, 600, 1400]] = 24_000.0
    x[::3, [40, 41, 900, 2000]] = -24_000.0
    x[:7] = 0.0
    x_TF = x.to(torch.bfloat16)
    on_cpu = encode_rows(x_TF, layout)
    on_gpu = encode_rows(x_TF.cuda(), layout).cpu()
    unchecked = encode_rows(x_TF.cuda(), layout, check_finite=False).cpu()
    assert torch.equal(on_cpu, on_gpu)
    assert torch.equal(on_cpu, unchecked)


def test_verify_detects_a_flipped_byte(tmp_path):
    fingerprint = fp8_fingerprint()
    with ShardWriter(tmp_path, fingerprint, worker=0, flush_seconds=1e9, **TINY) as writer:
        for sample in fp8_samples(fingerprint, range(30)):
            writer.add(sample)
    assert verify_cache(tmp_path, progress=False).ok
    group = CacheLayout.at(tmp_path).shard_group(writer.shard)
    fmt = parse_array_format(group / "features", "features")
    shard_file = ShardFile(fmt, 0)
    row = 3
    offset = int(shard_file.offsets[0]) + row * fmt.row_bytes + fmt.row_bytes - 1  # an outlier value byte
    data = bytearray(shard_file.path.read_bytes())
    data[offset] ^= 0x01
    shard_file.path.write_bytes(bytes(data))
    with CacheReader.open(tmp_path) as reader:
        t = reader.samples
        hit = (t.shard == writer.shard) & (t.row_start <= row) & (t.row_start + t.num_tokens > row)
        hurt = sorted(t.sample_id[hit].tolist())
    assert len(hurt) == 1
    report = verify_cache(tmp_path, progress=False)
    assert not report.ok
    assert [d.sample_id for d in report.damaged] == hurt
    assert "checksum mismatch" in report.damaged[0].problem


def test_resuming_an_fp8_cache_with_bf16_is_refused_naming_the_field(tmp_path):
    with ShardWriter(tmp_path, fp8_fingerprint(), worker=0, **TINY) as writer:
        writer.add(fp8_samples(fp8_fingerprint(), [0])[0])
    bf16 = make_fingerprint(codec="blosc-zstd-1-shuffle", hidden_size=HIDDEN, layer_ids=(1, 2))
    with pytest.raises(FingerprintMismatchError, match="storage_dtype"):
        ShardWriter(tmp_path, bf16, worker=1, **TINY)
    same_dtype_other_codec = fp8_fingerprint("fp8-zstd-1")
    with pytest.raises(FingerprintMismatchError, match="codec"):
        ShardWriter(tmp_path, same_dtype_other_codec, worker=1, **TINY)


def test_storage_dtype_must_go_with_the_codec(tmp_path):
    from dflash_offline.cache.layout import create_or_open_cache
    from dflash_offline.errors import CacheFormatError

    wrong = make_fingerprint(codec="fp8", hidden_size=HIDDEN, layer_ids=(1, 2))  # says bfloat16
    with pytest.raises(CacheFormatError, match="float8_e4m3fn"):
        create_or_open_cache(tmp_path, wrong)
