"""`dflash export` against what each serving engine's DFlash loader reads, as its source states it.

The contracts below are data taken from the public loaders (files and commits named per contract); the
test checks what ``dflash export`` writes for a run (bf16) against each: architecture,
config fields, tensor names and shapes, no embedding or LM head, dtype, and the model card's serve
commands. z-lab's reference modelling file (pure torch + transformers) was also run on an export once
when these contracts were written: ``DFlashDraftModel.from_pretrained`` loaded it with no missing or
unexpected key and its forward equalled ours bit for bit; its key/shape expectations are encoded here
instead of vendoring it. llama.cpp's converter needs the repository's own ``gguf`` package (the PyPI
release has no DFLASH architecture), so its contract is checked as data only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from dflash_offline.cache.fingerprint import CacheFingerprint
from dflash_offline.cache.layout import create_or_open_cache
from dflash_offline.cli import main
from dflash_offline.eval.report import EvalReport, EvalSummary, MeanRow
from dflash_offline.target_model.loader import load_tokenizer, resolve_target, target_info
from dflash_offline.train.checkpoint import checkpoints_dir
from dflash_offline.train.config import TrainConfig
from dflash_offline.train.step import build_drafter_setup

Shapes = dict[str, tuple[int, ...]]


def qwen3_dflash_tensors(cfg: dict[str, Any]) -> Shapes:
    """The parameters of z-lab's ``DFlashDraftModel`` for a config (its module definitions, by hand):
    Qwen3 decoder layers without biases, ``fc`` (bias-free) from the concatenated target features,
    ``hidden_norm`` and ``norm``; the rotary embedding has only non-persistent buffers."""
    H, mlp, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    n = len(cfg["dflash_config"]["target_layer_ids"])
    shapes: Shapes = {"fc.weight": (H, n * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, H),
            p + "self_attn.k_proj.weight": (kv, H),
            p + "self_attn.v_proj.weight": (kv, H),
            p + "self_attn.o_proj.weight": (H, q),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (mlp, H),
            p + "mlp.up_proj.weight": (mlp, H),
            p + "mlp.down_proj.weight": (H, mlp),
            p + "input_layernorm.weight": (H,),
            p + "post_attention_layernorm.weight": (H,),
        }
    return shapes


@dataclass(frozen=True, kw_only=True, slots=True)
class Contract:
    """What one consumer's loader reads of a DFlash drafter directory."""

    consumer: str
    sources: tuple[str, ...]
    """Upstream files (repository, path, commit) the contract was read from."""
    config_checks: dict[str, Callable[[dict[str, Any]], bool]]
    """What must hold of config.json, by what the loader does with it."""
    tensors: Callable[[dict[str, Any]], Shapes]
    """Every tensor the loader fills, with its shape (the checkpoint's names)."""
    optional_tensors: tuple[str, ...] = ()
    """Names the loader also takes (when absent it shares the target's)."""


def _get(cfg: dict[str, Any], key: str) -> Any:
    return (cfg.get("dflash_config") or {}).get(key, cfg.get(key))


def _full_attention(cfg: dict[str, Any]) -> bool:
    return cfg.get("layer_types") == ["full_attention"] * cfg["num_hidden_layers"]


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(v) is int for v in value)


CONTRACTS = (
    Contract(
        consumer="vLLM (speculative method dflash)",
        sources=(
            "vllm-project/vllm vllm/model_executor/models/qwen3_dflash.py "
            "036a00d1f5d00d449d02dce9babdd15a5b4d06c9",
            "vllm-project/vllm vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py "
            "0cfdd2e15d6991f354c6e22fd7f7e7577afe0424",
            "vllm-project/vllm vllm/config/speculative.py 002e77c1f0ef9b19cff8b9e21cfbd6feb3d6b443",
        ),
        config_checks={
            # The registry maps DFlashDraftModel to qwen3_dflash.DFlashQwen3ForCausalLM; the hf_config is a
            # transformers config, so model_type must be one AutoConfig knows (Qwen3's fields are read).
            "architecture DFlashDraftModel": lambda c: "DFlashDraftModel" in c["architectures"],
            "model_type qwen3": lambda c: c["model_type"] == "qwen3",
            # fc input = hidden size x len(aux layers), aux layers = dflash_config.target_layer_ids + 1,
            # unless eagle_aux_hidden_state_layer_ids is set (it wins, without the +1).
            "dflash_config.target_layer_ids": lambda c: _int_list(c["dflash_config"].get("target_layer_ids")),
            "no eagle_aux_hidden_state_layer_ids": lambda c: "eagle_aux_hidden_state_layer_ids" not in c,
            "no target_hidden_size or = hidden_size": lambda c: (
                c.get("target_hidden_size", c["hidden_size"]) == c["hidden_size"]
            ),
            "use_aux_hidden_state unset or true": lambda c: c["dflash_config"].get(
                "use_aux_hidden_state", True
            ),
            # get_parallel_drafting_token_id: dflash_config.mask_token_id first.
            "dflash_config.mask_token_id": lambda c: type(c["dflash_config"].get("mask_token_id")) is int,
            # Non-causal drafter: no is_causal / dflash_config.causal, no sliding layer, no use_swa.
            "non-causal full attention": lambda c: (
                "is_causal" not in c
                and not c["dflash_config"].get("causal")
                and not c["dflash_config"].get("use_swa")
                and _full_attention(c)
            ),
            "neox RoPE, default type": lambda c: (
                c.get("is_neox_style", True) and c["rope_parameters"]["rope_type"] == "default"
            ),
            "silu MLP, no attention bias": lambda c: c["hidden_act"] == "silu" and not c["attention_bias"],
        },
        tensors=qwen3_dflash_tensors,  # q/k/v and gate/up are stacked by the loader from these names
        optional_tensors=("embed_tokens.weight", "lm_head.weight"),
    ),
    Contract(
        consumer="SGLang (--speculative-algorithm DFLASH)",
        sources=(
            "sgl-project/sglang python/sglang/srt/models/dflash.py 003b23d7388eabdfbfecd2610c7e228f9f6a2734",
            "sgl-project/sglang python/sglang/srt/speculative/dflash_utils.py "
            "00731f0bc9fa81c39802754fb4b62e9cce967582",
            "sgl-project/sglang python/sglang/srt/speculative/dflash_worker.py "
            "7f151c5ebdb3af4467c2a5d3ccc5f54e71d2ba35",
        ),
        config_checks={
            "architecture DFlashDraftModel": lambda c: "DFlashDraftModel" in c["architectures"],
            "num_hidden_layers": lambda c: (
                type(c["num_hidden_layers"]) is int and c["num_hidden_layers"] >= 1
            ),
            "block_size": lambda c: type(_get(c, "block_size")) is int and _get(c, "block_size") >= 1,
            "target_layer_ids within num_target_layers": lambda c: (
                _int_list(_get(c, "target_layer_ids"))
                and all(0 <= i < _get(c, "num_target_layers") for i in _get(c, "target_layer_ids"))
            ),
            "mask_token_id a non-negative int": lambda c: (
                type(_get(c, "mask_token_id")) is int and _get(c, "mask_token_id") >= 0
            ),
            # layer_types "full_attention" -> AttentionType.ENCODER_ONLY (non-causal); only silu MLPs.
            "full attention": _full_attention,
            "silu": lambda c: c["hidden_act"] == "silu",
        },
        tensors=qwen3_dflash_tensors,  # fc.weight's shape is checked at load; unknown names are ignored
    ),
    Contract(
        consumer="llama.cpp (convert_hf_to_gguf.py, DFlashModel)",
        sources=("ggml-org/llama.cpp conversion/qwen.py 03173d5e78f8ccd7ccbb385f1f7b4a21266377dc",),
        config_checks={
            "architectures[0] DFlashDraftModel": lambda c: c["architectures"][0] == "DFlashDraftModel",
            "top-level block_size": lambda c: type(c.get("block_size")) is int,
            "dflash_config.target_layer_ids": lambda c: _int_list(c["dflash_config"].get("target_layer_ids")),
            "dflash_config.mask_token_id": lambda c: type(c["dflash_config"].get("mask_token_id")) is int,
            "Qwen3 hyperparameters": lambda c: all(
                k in c
                for k in (
                    "hidden_size",
                    "intermediate_size",
                    "num_hidden_layers",
                    "num_attention_heads",
                    "num_key_value_heads",
                    "head_dim",
                    "rms_norm_eps",
                    "max_position_embeddings",
                )
            ),
        },
        # layers.* and norm.weight get a "model." prefix for the Qwen3 tensor map; fc and hidden_norm have
        # their own GGUF tensors; a name outside these would fail the conversion.
        tensors=qwen3_dflash_tensors,
    ),
    Contract(
        consumer="z-lab reference (DFlashDraftModel, transformers)",
        sources=("z-lab/dflash dflash/model.py 44947fbf71114e241c96de194f4b382b5dd330d0",),
        config_checks={
            "dflash_config dict with target_layer_ids, mask_token_id": lambda c: (
                _int_list(c["dflash_config"].get("target_layer_ids"))
                and type(c["dflash_config"].get("mask_token_id")) is int
            ),
            "top-level block_size": lambda c: type(c.get("block_size")) is int,
            "layer_types per layer": lambda c: len(c["layer_types"]) == c["num_hidden_layers"],
            "Qwen3Config fields": lambda c: c["model_type"] == "qwen3" and "head_dim" in c,
        },
        tensors=qwen3_dflash_tensors,  # from_pretrained: no missing and no unexpected key
    ),
)


def _eval_report(drafter_dir: Path) -> dict[str, Any]:
    def summary(name: str, tau: float, speedup: float, timed: bool) -> EvalSummary:
        return EvalSummary(
            num_prompts=6, block_size=8, tau=tau, accepted_histogram=[0] * 8, cycles=10, new_tokens=40,
            spec_seconds=1.0, target_seconds=speedup, speedup=speedup, spec_tokens_per_s=40.0,
            target_tokens_per_s=40.0 / speedup, identical_prompts=6, name=name, timed=timed,
        )  # fmt: skip

    # One set timed long enough to measure its speedup (eval/report.py:TIMING_RULE), one not.
    sets = [summary("mt-bench", 1.25, 0.8, False), summary("sharegpt", 1.5, 0.9, True)]
    report = EvalReport(
        version=2, config={}, target={}, drafter={"directory": str(drafter_dir)}, held_out="", warnings=[],
        prompts=[], summary=replace(sets[0], name="all"), sets=sets,
        mean=MeanRow(num_sets=2, tau=1.375, target_tokens_per_s=None, spec_tokens_per_s=None, speedup=0.85),
    )  # fmt: skip
    return report.to_dict()


def _run_dir(root: Path) -> Path:
    """A run directory as training leaves it at step 2 (config, the cache's fingerprint, a checkpoint
    with perturbed weights), made without the training loop: the export is what is tested here."""
    target = target_info(resolve_target("random:tiny"))
    fingerprint = CacheFingerprint(
        target_id="random:tiny", weights_hash=target.weights_hash, num_target_layers=target.num_layers,
        layer_ids=(0, 2), hidden_size=target.hidden_size, storage_dtype="bfloat16",
        codec="blosc-zstd-1-shuffle", tokenizer_hash="tok", chat_template_hash="tpl", max_length=256,
        too_long="skip", bucket_edges=(256,), data_source="chat-sample", compute_dtype="float32",
    )  # fmt: skip
    create_or_open_cache(root / "cache", fingerprint)
    run = root / "run"
    config = TrainConfig.from_options(
        cache_dir=root / "cache", out_dir=run, num_layers=2, block_size=8, max_steps=2
    )
    run.mkdir()
    (run / "config.json").write_text(json.dumps(config.to_dict()))
    model = build_drafter_setup(config, fingerprint, device=torch.device("cpu")).model
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    step = checkpoints_dir(run) / "step-00000002"
    step.mkdir(parents=True)
    torch.save({"model": model.state_dict()}, step / "state.pt")
    (step / "meta.json").write_text("{}")
    return run


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``dflash export`` of a run at step 2, with an eval report in the run directory."""
    root = tmp_path_factory.mktemp("export")
    run = _run_dir(root)
    (run / "eval.json").write_text(json.dumps(_eval_report(run / "drafter")))
    out = root / "served-drafter"
    result = CliRunner().invoke(main, ["export", str(run), "--out", str(out), "--dtype", "bfloat16"])
    assert result.exit_code == 0, result.output
    return out


@pytest.mark.parametrize("contract", CONTRACTS, ids=lambda c: c.consumer.split()[0])
def test_export_meets_the_consumer_contract(export: Path, contract: Contract) -> None:
    cfg = json.loads((export / "config.json").read_text())
    failed = [name for name, check in contract.config_checks.items() if not check(cfg)]
    assert not failed, f"{contract.consumer}: config.json fails {failed} ({contract.sources})"
    with safe_open(str(export / "model.safetensors"), framework="pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
        dtypes = {f.get_tensor(name).dtype for name in f.keys()}  # noqa: SIM118
    expected = contract.tensors(cfg)
    extra = set(shapes) - set(expected) - set(contract.optional_tensors)
    assert not extra, f"{contract.consumer} does not load {sorted(extra)}"
    missing = set(expected) - set(shapes)
    assert not missing, f"{contract.consumer} needs {sorted(missing)}"
    assert {k: shapes[k] for k in expected} == expected
    assert not {"embed_tokens.weight", "lm_head.weight"} & set(shapes)  # the target's are shared
    assert dtypes == {torch.bfloat16}
    assert cfg["torch_dtype"] == cfg["dtype"] == "bfloat16"


def test_sglang_resolves_the_mask_token_to_our_id(export: Path) -> None:
    """SGLang checks dflash_config.mask_token (default ``<|MASK|>``) against the target tokenizer's
    vocabulary: when the tokenizer has that token, its id must be mask_token_id (dflash_worker.py)."""
    cfg = json.loads((export / "config.json").read_text())
    vocab = load_tokenizer("random:tiny").get_vocab()
    token = cfg["dflash_config"].get("mask_token", "<|MASK|>")
    assert vocab.get(token, cfg["dflash_config"]["mask_token_id"]) == cfg["dflash_config"]["mask_token_id"]


def test_model_card_names_the_run_and_holds_the_serve_commands(export: Path) -> None:
    card = (export / "README.md").read_text()
    cfg = json.loads((export / "config.json").read_text())
    B = cfg["block_size"]
    assert "# DFlash drafter for `random:tiny`" in card
    assert "`chat-sample`" in card  # the data source of the cache
    assert "checkpoint of step 2" in card
    # The held-out τ table, from RUN/eval.json (found without being named).
    assert "| mt-bench | 6 | 1.250 | 0.80× (too short to time: noise) |" in card
    assert "| sharegpt | 6 | 1.500 | 0.90× |" in card
    assert "| mean | 12 | 1.375 | 0.85× (too short to time: noise) |" in card
    spec = json.loads(re.search(r"--speculative-config '(\{.*?\})'", card).group(1))  # type: ignore[union-attr]
    assert spec == {"method": "dflash", "model": str(export.resolve()), "num_speculative_tokens": B - 1}
    assert "vllm serve random:tiny" in card
    assert f"--speculative-draft-model-path {export.resolve()}" in card
    assert f"--speculative-num-draft-tokens {B}" in card
    assert "--speculative-algorithm DFLASH" in card
