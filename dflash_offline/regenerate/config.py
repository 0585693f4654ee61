"""The typed configuration of ``dflash regenerate``."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from dflash_offline.data.schemas import DataFormat, parse_data_format
from dflash_offline.errors import ConfigError
from dflash_offline.placement import Placement

FAILURES_SUFFIX = ".failures.jsonl"


@dataclass(frozen=True, kw_only=True, slots=True)
class RegenerateConfig:
    """Everything one ``dflash regenerate`` run needs."""

    out: Path
    """Chat JSONL to write (appended to; rerunning the same command resumes)."""
    target: str = "default"
    data: str | None = None
    """Chat data whose user turns the target answers; None = the embedded ShareGPT file."""
    data_format: DataFormat = "auto"
    """Record schema (``data/schemas.py``); ``auto`` picks one per record."""
    skip: int = 0
    limit: int | None = None
    """Records to read after ``skip`` (None: all)."""
    max_new_tokens: int = 1024
    """Per answer."""
    max_prompt_tokens: int = 4096
    """A prompt longer than this ends its conversation there (fails it when it is the first)."""
    temperature: float = 0.0
    """0: greedy; > 0: sampling at this temperature."""
    seed: int = 0
    batch_size: int | None = None
    """CB: requests per forward step; static: rows per generate call. None: 256 on CUDA, 16 on CPU."""
    engine: Literal["auto", "cb", "static"] = "auto"
    """``cb``: transformers' continuous batching; ``static``: generate batches; ``auto``: cb on CUDA."""
    kv_tokens: int = 262144
    """KV-cache budget in tokens (CB: the paged cache; static: rows × (longest prompt + new tokens))."""
    max_batch_tokens: int = 2048
    """CB: query tokens per forward step (decode tokens plus prefill chunks)."""
    cuda_graphs: Literal["auto", "on", "off"] = "auto"
    window: int | None = None
    """Conversations in flight per worker; None: 2 × batch size (CB), 4 × (static, to sort by length)."""
    placement: Placement = Placement()  # noqa: RUF009 (frozen: a shared default is safe)
    """Where workers run (--gpus / --workers / --threads); one worker in this process by default."""
    device: str | None = None
    """``cpu``, ``cuda`` or ``cuda:N``; None = cuda when available."""
    dtype: str | None = None
    """``float32`` or ``bfloat16``; None = float32 on CPU, bfloat16 on CUDA."""
    progress: bool = True

    def __post_init__(self) -> None:
        checks = {
            "--skip": self.skip >= 0,
            "--limit": self.limit is None or self.limit >= 0,
            "--max-new-tokens": self.max_new_tokens >= 1,
            "--max-prompt-tokens": self.max_prompt_tokens >= 1,
            "--temperature": self.temperature >= 0,
            "--batch-size": self.batch_size is None or self.batch_size >= 1,
            "--kv-tokens": self.kv_tokens >= 1,
            "--max-batch-tokens": self.max_batch_tokens >= 1,
            "--engine": self.engine in ("auto", "cb", "static"),
            "--cuda-graphs": self.cuda_graphs in ("auto", "on", "off"),
            "--window": self.window is None or self.window >= 1,
            "--dtype": self.dtype in (None, "float32", "bfloat16"),
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ConfigError(f"invalid value for {', '.join(bad)} (see dflash regenerate --help)")
        parse_data_format(self.data_format)
        if self.max_prompt_tokens + self.max_new_tokens > self.kv_tokens:
            raise ConfigError(
                f"--max-prompt-tokens {self.max_prompt_tokens} + --max-new-tokens {self.max_new_tokens} "
                f"does not fit in --kv-tokens {self.kv_tokens} (one conversation's KV cache): "
                "raise --kv-tokens or lower them"
            )
        if self.out.suffix != ".jsonl":
            raise ConfigError(f"--out {self.out}: name a .jsonl file (the chat JSONL that generate reads)")

    @property
    def failures_path(self) -> Path:
        """``<out>.failures.jsonl``: one line per record that yields no conversation, with the reason."""
        return self.out.with_name(self.out.name.removesuffix(".jsonl") + FAILURES_SUFFIX)

    @property
    def parts_dir(self) -> Path:
        """``<out>.parts/``: one JSONL part (and failures part) per worker of a multi-worker run, merged
        into ``out`` at its end (or by the next run, whatever its worker count)."""
        return self.out.with_name(self.out.name + ".parts")

    def batch_size_for(self, device_type: str) -> int:
        if self.batch_size is not None:
            return self.batch_size
        return 256 if device_type == "cuda" else 16

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["out"] = str(self.out)
        return d
