"""``dflash eval``: load the target and an exported drafter, pick the question sets' prompts, decode each
turn target-only and speculatively, and report τ, its histogram, both loops' decode tok/s, the speedup
and the tie-aware exactness check per set.

Sets: ``--bench mt-bench|humaneval|sharegpt|all`` (benches.py), or without ``--bench`` the held-out
prompts of ``--data`` as before. An MT-Bench question is decoded turn by turn; turn 2's prompt holds the
target-only (greedy) answer to turn 1, so that every turn's prompt is the same for both loops."""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_offline.data.schemas import DataFormat
from dflash_offline.errors import ConfigError
from dflash_offline.eval.benches import BENCHES, BenchName
from dflash_offline.eval.exactness import DEFAULT_TIE_ULPS
from dflash_offline.eval.runtime import DTYPES, compute_dtype, resolve_device, stop_token_ids

WARMUP_TOKENS = 8


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalConfig:
    """Everything one ``dflash eval`` run needs."""

    drafter_dir: Path
    """An export directory (config.json + model.safetensors), e.g. RUN/drafter."""
    target: str = "default"
    """The target spec (must be the one the drafter was trained on)."""
    data: str | None = None
    """Chat data for the ``sharegpt`` set (and for a run without ``bench``); None = the embedded ShareGPT
    file."""
    bench: tuple[BenchName, ...] | None = None
    """Question sets in table order; None = the held-out prompts of ``data`` alone (one set)."""
    data_format: DataFormat = "auto"
    """Record schema (``data/schemas.py``); ``auto`` picks one per record."""
    exclude_cache: Path | None = None
    """Training cache whose committed samples are excluded; None = inferred from the drafter's run."""
    limit: int = 20
    """Questions per set (an MT-Bench question decodes two turns)."""
    skip: int = 0
    """Records of the data to pass over first."""
    max_new_tokens: int = 128
    max_prompt_tokens: int = 2048
    """Longer prompts are passed over."""
    device: str | None = None
    """``cpu``, ``cuda`` or ``cuda:N``; None = cuda when available."""
    dtype: str | None = None
    """``float32`` or ``bfloat16`` for the target and the drafter; None = float32 on CPU, bfloat16 on CUDA."""
    tie_ulps: float = DEFAULT_TIE_ULPS
    """Near-tie tolerance in ulps of the top logit (exactness.py)."""
    warmup: bool = True
    """Decode a few tokens of the first prompt with both loops before timing (kernel selection, caches)."""
    progress: bool = True

    def __post_init__(self) -> None:
        if self.limit < 1 or self.max_new_tokens < 1 or self.skip < 0 or self.max_prompt_tokens < 1:
            raise ConfigError(
                f"--limit {self.limit}, --max-new-tokens {self.max_new_tokens}, --max-prompt-tokens "
                f"{self.max_prompt_tokens} must be >= 1 and --skip {self.skip} >= 0"
            )
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ConfigError(f"--dtype {self.dtype!r}: expected one of {sorted(DTYPES)}")
        if self.bench is not None:
            unknown = [b for b in self.bench if b not in BENCHES]
            if unknown or not self.bench:
                raise ConfigError(f"--bench {list(self.bench)}: expected sets among {list(BENCHES)}")
            if self.data is not None and "sharegpt" not in self.bench:
                raise ConfigError(
                    f"--data {self.data} is only read by the sharegpt set; add it (--bench sharegpt or "
                    "all) or leave --data out"
                )
        if not self.tie_ulps >= 0:
            raise ConfigError(f"--tie-ulps must be >= 0, got {self.tie_ulps}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("drafter_dir", "exclude_cache"):
            d[key] = None if d[key] is None else str(d[key])
        d["bench"] = None if self.bench is None else list(self.bench)
        return d


def load_drafter_for(target: Any, drafter_dir: Path, *, dtype: torch.dtype) -> Any:
    """The exported drafter over the loaded target's own embedding and LM head, in ``dtype``."""
    from dflash_offline.drafter.export import load_exported_drafter

    model = target.model
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    drafter = load_exported_drafter(drafter_dir, embed_VH=embed, lm_head_VH=head, device=target.device)
    cfg = drafter.config
    info = target.info
    if cfg.num_target_layers != info.num_layers or max(cfg.target_layer_ids) >= info.num_layers:
        raise ConfigError(
            f"the drafter in {drafter_dir} reads layers {list(cfg.target_layer_ids)} of a "
            f"{cfg.num_target_layers}-layer target; {info.target_id} has {info.num_layers} layers: "
            "evaluate it with the target it was trained on"
        )
    return drafter.cast_parameters(dtype).eval()


def _consistency_warnings(held_out_cache: Path | None, target_info: Any, drafter: Any) -> list[str]:
    if held_out_cache is None:
        return []
    from dflash_offline.cache.layout import read_fingerprint

    fp = read_fingerprint(held_out_cache)
    warnings = []
    if fp.weights_hash != target_info.weights_hash:
        warnings.append(
            f"the training cache was generated by {fp.target_id} ({fp.weights_hash}); the eval target "
            f"is {target_info.target_id} ({target_info.weights_hash})"
        )
    if tuple(fp.layer_ids) != tuple(drafter.config.target_layer_ids):
        warnings.append(
            f"the training cache holds layers {list(fp.layer_ids)}; the drafter reads "
            f"{list(drafter.config.target_layer_ids)}"
        )
    return warnings


def _questions(config: EvalConfig, tokenizer: Any, held_out: Any, warnings: list[str]) -> list[Any]:
    """Every question of every set, in table order (set by set)."""
    from dflash_offline.eval.benches import load_humaneval, load_mt_bench
    from dflash_offline.eval.prompts import select_prompts
    from dflash_offline.eval.turns import from_bench, from_chat_prompt

    sets: tuple[str, ...] = config.bench or ("sharegpt" if config.data is None else "data",)
    questions: list[Any] = []
    for name in sets:
        if name == "mt-bench":
            questions += [from_bench(q) for q in load_mt_bench(config.limit)]
        elif name == "humaneval":
            questions += [from_bench(q) for q in load_humaneval(config.limit)]
        else:
            selection = select_prompts(
                config.data,
                tokenizer,
                held_out=held_out,
                limit=config.limit,
                skip=config.skip,
                max_prompt_tokens=config.max_prompt_tokens,
                data_format=config.data_format,
            )
            if not selection.prompts:
                raise ConfigError(
                    f"no usable held-out prompt among {selection.records_read} records "
                    f"({selection.excluded} in the training cache, {selection.unusable} unusable): "
                    "use other --data or a larger --skip"
                )
            if len(selection.prompts) < config.limit:
                warnings.append(
                    f"{name}: only {len(selection.prompts)} usable held-out prompts (asked for "
                    f"{config.limit})"
                )
            questions += [from_chat_prompt(p, bench=name) for p in selection.prompts]
    return questions


def run_eval(config: EvalConfig) -> Any:
    """Evaluate and return the ``EvalReport`` (the CLI prints and writes it)."""
    from tqdm import tqdm

    from dflash_offline.eval.exactness import EXACTNESS_RULE
    from dflash_offline.eval.prompts import resolve_held_out
    from dflash_offline.eval.report import EVAL_REPORT_VERSION, EvalReport, prompt_result, summarize_sets
    from dflash_offline.eval.speculative import DFlashBlockDrafter, TargetCaller
    from dflash_offline.eval.turns import Decoders, decode_question, first_turn_ids
    from dflash_offline.target.loader import load_target

    if not config.drafter_dir.is_dir():
        raise ConfigError(f"--drafter {config.drafter_dir}: not a directory (an export: RUN/drafter)")
    device = resolve_device(config.device)
    dtype = compute_dtype(config.dtype, device)
    held_out = resolve_held_out(
        exclude_cache=config.exclude_cache, drafter_dir=config.drafter_dir, data=config.data
    )
    target = load_target(config.target, device=device, dtype=dtype)
    drafter_model = load_drafter_for(target, config.drafter_dir, dtype=dtype)
    warnings = _consistency_warnings(held_out.cache_dir, target.info, drafter_model)
    questions = _questions(config, target.tokenizer, held_out, warnings)
    dec = Decoders(
        caller=TargetCaller(target.model),
        drafter=DFlashBlockDrafter(drafter_model),
        tokenizer=target.tokenizer,
        layer_ids=tuple(drafter_model.config.target_layer_ids),
        stop_ids=stop_token_ids(target.tokenizer, target.model),
        max_new_tokens=config.max_new_tokens,
        max_prompt_tokens=config.max_prompt_tokens,
        tie_ulps=config.tie_ulps,
    )
    block_size = dec.drafter.block_size
    if config.warmup:
        # Kernel selection and allocator growth happen here, not in the first timed prompt.
        ids = first_turn_ids(questions[0], target.tokenizer)
        dec.target_only(ids, WARMUP_TOKENS)
        dec.speculative(ids, WARMUP_TOKENS)
    results = []
    total = sum(q.num_turns for q in questions)
    bar = tqdm(total=total, desc="eval", unit="turn", file=sys.stderr, disable=not config.progress)
    for question in questions:
        for done in decode_question(question, dec, on_skip=warnings.append):
            result = prompt_result(
                sample_id=question.sample_id,
                record_id=question.record_id,
                prompt_tokens=len(done.prompt_ids),
                spec=done.speculative,
                target_only=done.target_only,
                block_size=block_size,
                text=target.tokenizer.decode(list(done.speculative.tokens), skip_special_tokens=False),
                bench=question.bench,
                turn=done.turn,
                question_id=question.question_id,
                divergence=done.divergence,
            )
            results.append(result)
            bar.update(1)
            bar.set_postfix(set=question.bench, tau=f"{result.tau or 0:.2f}", refresh=False)
    bar.close()
    cfg = drafter_model.config
    sets, mean, summary = summarize_sets(results, block_size=block_size)
    return EvalReport(
        version=EVAL_REPORT_VERSION,
        config=config.to_dict(),
        target={
            "target_id": target.info.target_id,
            "weights_hash": target.info.weights_hash,
            "device": str(device),
            "dtype": str(dtype).removeprefix("torch."),
        },
        drafter={
            "directory": str(config.drafter_dir),
            "block_size": cfg.block_size,
            "target_layer_ids": list(cfg.target_layer_ids),
            "mask_token_id": cfg.mask_token_id,
            "num_layers": cfg.num_layers,
        },
        held_out=held_out.note,
        warnings=warnings,
        prompts=results,
        summary=summary,
        sets=sets,
        mean=mean,
        exactness={
            "dtype": str(dtype).removeprefix("torch."),
            "tie_ulps": config.tie_ulps,
            "rule": EXACTNESS_RULE,
        },
    )
