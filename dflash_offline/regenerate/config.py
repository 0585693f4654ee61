"""The typed configuration of ``dflash regenerate``."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dflash_offline.data.schemas import DataFormat, parse_data_format
from dflash_offline.errors import ConfigError

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
    batch_size: int = 16
    """Conversations answered together (one turn each per generate call)."""
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
            "--batch-size": self.batch_size >= 1,
            "--dtype": self.dtype in (None, "float32", "bfloat16"),
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ConfigError(f"invalid value for {', '.join(bad)} (see dflash regenerate --help)")
        parse_data_format(self.data_format)
        if self.out.suffix != ".jsonl":
            raise ConfigError(f"--out {self.out}: name a .jsonl file (the chat JSONL that generate reads)")

    @property
    def failures_path(self) -> Path:
        """``<out>.failures.jsonl``: one line per record that yields no conversation, with the reason."""
        return self.out.with_name(self.out.name.removesuffix(".jsonl") + FAILURES_SUFFIX)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["out"] = str(self.out)
        return d
