"""``--engine openai``: the target answers through an OpenAI-compatible server (vLLM, SGLang, llama.cpp's
server, TGI) that already runs it, for targets that need tensor parallelism or a node of their own.

The prompt the server continues is exactly the one ``dflash generate`` will capture: the conversation is
rendered by *our* tokenizer's chat template (the same ``render_prompt`` as the built-in engine) and sent
to the completions endpoint (never the chat endpoint, which would template it again on the server). The
probe (``probe_server``, before anything is written) lists ``/v1/models``, then sends one short templated
prompt as token ids; a server that refuses token ids gets the text. Either way the server's
``usage.prompt_tokens`` must equal our token count, or the run stops there: the server does not see the
tokens we will train on (another tokenizer, or a BOS added to text prompts). Every request checks it
again. The answer: when the server returns its token ids (vLLM's ``return_token_ids``) their count must
equal ``usage.completion_tokens`` (give or take the stop token) and our tokenizer must decode
them to the answer's text; a server that returns text only has it read by our tokenizer (decoding gives
the text back; the count may then differ from usage, because a greedy answer need not be tokenized the
way its text encodes). Before any of that, every value of an answer is checked for its type, range and
length against the request (``served_answer.py``): a bad one is the conversation's failure row, naming
the field.

Requests run on ``--concurrency`` daemon threads (``http_client.JsonClient``, one keep-alive connection
each), so a server's continuous batching stays full; the conversation driver keeps one turn per
conversation in flight. A request that fails on its own (a 4xx, 5xx or timeout after the retries, a
mismatched count) becomes that conversation's failure row and the run goes on; a server that cannot be
reached any more stops the run (resumable) instead, so that a restarted server and a rerun finish it.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from dflash_offline.config_fields import TARGET, field_ref
from dflash_offline.errors import DflashError
from dflash_offline.regenerate.config import RegenerateConfig
from dflash_offline.regenerate.engine_protocol import EngineName, Finished, RequestFailure
from dflash_offline.regenerate.generation import GeneratedTokens, GenerationSettings
from dflash_offline.regenerate.http_client import (
    AbortedError,
    BadResponseError,
    ConnectionLostError,
    HttpError,
    HttpStatusError,
    JsonClient,
    RequestTimeoutError,
    RetryPolicy,
)
from dflash_offline.regenerate.served_answer import AnswerFault, AnswerRequest, parse_served_answer

PromptForm = Literal["token_ids", "text"]

PROBE_CHAT = [{"role": "user", "content": "Hello! Say one word."}]
"""The conversation the probe sends (its templated tokens, one answer token)."""

REQUEST_EXTRAS: dict[str, Any] = {
    # Extensions that vLLM and SGLang read and other servers ignore: keep special tokens in the text as
    # the built-in engine does, and return the answer's token ids (vLLM) so that they are checked exactly.
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "return_token_ids": True,
}
"""Sent with every request, the probe's included (so that a server refusing them fails at the probe)."""

PROBE_TIMEOUT_SECONDS = 30.0
"""The probe waits at most this long for each answer (a wrong URL must fail fast)."""


class ServerError(DflashError):
    """The server cannot be used (wrong URL, model or key; another tokenizer) or stopped answering."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerOptions:
    """How to reach the server (the ``--engine openai`` options of ``RegenerateConfig``)."""

    base_url: str
    model: str | None
    """Served model name; None = the only one the server lists."""
    api_key_env: str | None
    """Environment variable holding the API key; None = no key."""
    concurrency: int
    policy: RetryPolicy


@dataclass(frozen=True, kw_only=True, slots=True)
class ServedModel:
    """What the probe found out."""

    root_url: str
    """``base_url`` without a trailing ``/v1``: the endpoints are ``/v1/models`` and ``/v1/completions``."""
    model: str
    prompt_form: PromptForm
    """How prompts are sent: token ids when the server takes them, else the templated text."""


def server_options(config: Any) -> ServerOptions:
    """The server options of a ``RegenerateConfig``."""
    return ServerOptions(
        base_url=config.base_url,
        model=config.model,
        api_key_env=config.api_key_env,
        concurrency=config.concurrency,
        policy=RetryPolicy(
            timeout_seconds=config.request_timeout,
            max_retries=config.max_retries,
            backoff_seconds=config.retry_backoff,
        ),
    )


def root_url(base_url: str) -> str:
    url = base_url.rstrip("/")
    return url.removesuffix("/v1")


def _api_key(options: ServerOptions) -> str | None:
    if options.api_key_env is None:
        return None
    key = os.environ.get(options.api_key_env)
    if not key:
        raise ServerError(
            f"{field_ref(RegenerateConfig, 'api_key_env')} {options.api_key_env}: ${options.api_key_env} "
            "is not set (or empty)"
        )
    return key


def _server(options: ServerOptions) -> str:
    """The option that named the server, for the start of a message: ``--base-url URL``."""
    return f"{field_ref(RegenerateConfig, 'base_url')} {options.base_url}"


def make_client(options: ServerOptions, root: str, *, policy: RetryPolicy | None = None) -> JsonClient:
    return JsonClient(root, api_key=_api_key(options), policy=policy or options.policy)


def probe_server(options: ServerOptions, tokenizer: Any) -> ServedModel:
    """Check the server before anything is written: it answers, serves the model, and sees our tokens."""
    root = root_url(options.base_url)
    # Listing the models is tried once (a wrong URL fails at once); the probe completion is retried on
    # 429/5xx like any request.
    probe_policy = RetryPolicy(
        timeout_seconds=min(options.policy.timeout_seconds, PROBE_TIMEOUT_SECONDS),
        max_retries=options.policy.max_retries,
        backoff_seconds=options.policy.backoff_seconds,
    )
    client = make_client(options, root, policy=probe_policy)
    try:
        return _probe(client, options, root, tokenizer)
    finally:
        client.close_connection()  # the run's requests go through its threads' own connections


def _probe(client: JsonClient, options: ServerOptions, root: str, tokenizer: Any) -> ServedModel:
    from dflash_offline.regenerate.driver import render_prompt

    model = _served_model(client, options, root)
    ids = render_prompt(tokenizer, PROBE_CHAT)
    text = tokenizer.decode(ids, skip_special_tokens=False)
    body = {"model": model, "max_tokens": 1, "temperature": 0.0, **REQUEST_EXTRAS}
    form: PromptForm = "token_ids"
    try:
        answer = client.post("/v1/completions", {**body, "prompt": ids})
    except HttpStatusError as e:
        if e.status not in (400, 422):
            raise ServerError(f"{_server(options)}: /v1/completions answered {e}") from None
        form = "text"  # a server that takes only strings (the text is re-tokenized there: checked below)
        answer = _probe_post(client, options, {**body, "prompt": text})
    except HttpError as e:
        raise ServerError(f"{_server(options)}: /v1/completions failed ({e})") from None
    seen = _usage(answer).get("prompt_tokens")
    if not isinstance(seen, int):
        raise ServerError(
            f"{_server(options)}: the completion has no usage.prompt_tokens; dflash regenerate "
            "needs it to check that the server sees the prompt's tokens"
        )
    if seen != len(ids):
        target = field_ref(TARGET)
        raise ServerError(
            f"the server read the probe prompt ({form}) as {seen} tokens, {target}'s tokenizer makes "
            f"{len(ids)}: serve the model whose tokenizer {target} has (and no extra BOS on text prompts)"
        )
    return ServedModel(root_url=root, model=model, prompt_form=form)


def _probe_post(client: JsonClient, options: ServerOptions, payload: dict[str, Any]) -> Any:
    try:
        return client.post("/v1/completions", payload)
    except HttpError as e:
        raise ServerError(f"{_server(options)}: /v1/completions failed ({e})") from None


def _served_model(client: JsonClient, options: ServerOptions, root: str) -> str:
    try:
        listing = client.get("/v1/models")
    except HttpStatusError as e:
        hint = f"; check {field_ref(RegenerateConfig, 'api_key_env')}" if e.status in (401, 403) else ""
        raise ServerError(f"{_server(options)}: {root}/v1/models answered {e}{hint}") from None
    except (ConnectionLostError, RequestTimeoutError, BadResponseError) as e:
        raise ServerError(
            f"{_server(options)}: no OpenAI-compatible server answers at {root}/v1/models ({e})"
        ) from None
    data = listing.get("data") if isinstance(listing, dict) else None
    names = [str(m["id"]) for m in data or [] if isinstance(m, dict) and isinstance(m.get("id"), str)]
    if not names:
        raise ServerError(f"{_server(options)}: {root}/v1/models lists no model")
    if options.model is None:
        if len(names) > 1:
            raise ServerError(
                f"the server serves {len(names)} models ({', '.join(names)}): choose one with "
                f"{field_ref(RegenerateConfig, 'model')}"
            )
        return str(names[0])
    if options.model not in names:
        raise ServerError(
            f"{field_ref(RegenerateConfig, 'model')} {options.model!r} is not served at {root} (it serves: "
            f"{', '.join(names)})"
        )
    return options.model


def _usage(answer: Any) -> dict[str, Any]:
    usage = answer.get("usage") if isinstance(answer, dict) else None
    return usage if isinstance(usage, dict) else {}


@dataclass(frozen=True, kw_only=True, slots=True)
class _Job:
    """One request for a worker thread."""

    key: str
    prompt: tuple[int, ...]


class _ServerGoneError(Exception):
    """Raised in a thread when the server cannot be reached after the retries (fatal for the run)."""


class OpenAIEngine:
    """The ``Engine`` protocol over an OpenAI-compatible completions endpoint."""

    name: EngineName = "openai"

    def __init__(
        self,
        *,
        options: ServerOptions,
        served: ServedModel,
        settings: GenerationSettings,
        tokenizer: Any,
        vocab_size: int,
        seed: int = 0,
    ) -> None:
        """``vocab_size``: rows of the target's embedding (every token id the server returns is below it)."""
        self._options = options
        self._vocab_size = vocab_size
        self._seed = seed
        self._served = served
        self._settings = settings
        self._tokenizer = tokenizer
        self._client = make_client(options, served.root_url)
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._results: queue.Queue[Finished | BaseException] = queue.Queue()
        self._pending: set[str] = set()
        self._threads: list[threading.Thread] = []
        self._error: BaseException | None = None
        self._tokenizer_lock = threading.Lock()  # fast tokenizers are not safe to share across threads

    def submit(
        self, key: str, prompt: Sequence[int], *, keep_slot: bool = False, continues: str | None = None
    ) -> None:
        """``keep_slot`` and ``continues`` are left to the server (its own prefix cache, if any)."""
        assert key not in self._pending
        self._pending.add(key)
        self._jobs.put(_Job(key=key, prompt=tuple(int(t) for t in prompt)))
        if len(self._threads) < min(self._options.concurrency, len(self._pending)):
            thread = threading.Thread(target=self._work, name=f"openai-{len(self._threads)}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def pending(self) -> int:
        return len(self._pending)

    def release(self, key: str) -> None:
        pass  # nothing is kept here

    def poll(self, timeout: float) -> list[Finished]:
        if self._error is not None:
            raise self._error
        done: list[Finished] = []
        wait: float | None = timeout
        while True:
            try:
                item = self._results.get(timeout=wait) if wait else self._results.get_nowait()
            except queue.Empty:
                break
            wait = None  # drain what is ready without waiting again
            if isinstance(item, BaseException):
                # Hand over the answers that arrived before it; the next poll raises.
                self._error = item
                break
            self._pending.discard(item.key)
            done.append(item)
        if self._error is not None and not done:
            raise self._error
        return done

    def close(self, *, abort: bool = False) -> None:
        if abort or self._pending:
            self._client.abort()
        for _ in self._threads:
            self._jobs.put(None)
        self._pending.clear()

    def stats(self) -> None:
        """A server does not say what its batches did."""
        return None

    def _work(self) -> None:
        try:
            self._work_until_stopped()
        finally:
            self._client.close_connection()

    def _work_until_stopped(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._results.put(self._answer(job))
            except AbortedError:
                return
            except _ServerGoneError as e:
                self._results.put(
                    ServerError(
                        f"the server at {self._served.root_url} stopped answering ({e}); the output is "
                        "resumable: restart the server and rerun the same command"
                    )
                )
            except BaseException as e:  # a bug here must stop the run, not hang it
                self._results.put(e)

    def _payload(self, prompt: tuple[int, ...]) -> dict[str, Any]:
        s = self._settings
        payload: dict[str, Any] = {
            "model": self._served.model,
            "max_tokens": s.max_new_tokens,
            "temperature": s.temperature,
            "top_p": 1.0,
            "n": 1,
            "stream": False,
            # vLLM and SGLang stop at these ids as the built-in engine does (others stop at their EOS).
            "stop_token_ids": sorted(s.stop_ids),
            **REQUEST_EXTRAS,
        }
        if s.temperature > 0:
            payload["seed"] = self._seed
        if self._served.prompt_form == "token_ids":
            payload["prompt"] = list(prompt)
        else:
            with self._tokenizer_lock:
                payload["prompt"] = self._tokenizer.decode(list(prompt), skip_special_tokens=False)
        return payload

    def _answer(self, job: _Job) -> Finished:
        try:
            answer = self._client.post("/v1/completions", self._payload(job.prompt))
        except ConnectionLostError as e:
            raise _ServerGoneError(f"{e}; {e.attempts} attempts") from None
        except HttpStatusError as e:
            reason = {429: "rate_limited"}.get(
                e.status, "server_error" if e.status >= 500 else "request_rejected"
            )
            return _failed(job.key, reason, f"{e} ({e.attempts} attempts)")
        except RequestTimeoutError as e:
            return _failed(job.key, "timeout", f"{e} ({e.attempts} attempts)")
        except BadResponseError as e:
            return _failed(job.key, "bad_response", str(e))
        return self._parse(job, answer)

    def _parse(self, job: _Job, answer: Any) -> Finished:
        checked = parse_served_answer(
            answer,
            AnswerRequest(
                prompt_tokens=len(job.prompt),
                max_tokens=self._settings.max_new_tokens,
                vocab_size=self._vocab_size,
                stop_ids=self._settings.stop_ids,
            ),
        )
        if isinstance(checked, AnswerFault):
            return _failed(job.key, checked.reason, checked.detail)
        text, ids = checked.text, checked.token_ids
        if ids is not None:
            # The server's own ids (vLLM's return_token_ids): exact, and checked against usage. The stop
            # token may or may not be among the ids and in the count; either way is consistent.
            counted = checked.completion_tokens
            allowed = {len(ids), len(ids) + 1} if checked.finish_reason == "stop" else {len(ids)}
            if counted not in allowed:
                return _failed(
                    job.key,
                    "token_count_mismatch",
                    f"usage.completion_tokens is {counted}, the answer has {len(ids)} token ids",
                )
            with self._tokenizer_lock:
                decoded = self._tokenizer.decode(list(ids), skip_special_tokens=False)
            # A server's incremental detokenizer may hold back a partial character at the end of a cut
            # answer: only a difference before that means another tokenizer.
            if not (decoded.startswith(text) or text.startswith(decoded)):
                return _failed(
                    job.key,
                    "token_text_mismatch",
                    "our tokenizer decodes the answer's token ids to other text",
                )
            tokens = GeneratedTokens(token_ids=ids, finish_reason=checked.finish_reason, from_target=True)
            return Finished(key=job.key, tokens=tokens)
        # Text only: our tokenizer's reading of it (decoding gives the same text back). A greedy answer is
        # not always tokenized the way the tokenizer would encode its text, so the count may differ from
        # usage here without anything being wrong; no check is possible.
        with self._tokenizer_lock:
            read = tuple(int(t) for t in self._tokenizer(text, add_special_tokens=False)["input_ids"])
        tokens = GeneratedTokens(token_ids=read, finish_reason=checked.finish_reason, from_target=False)
        return Finished(key=job.key, tokens=tokens)


def _failed(key: str, reason: str, detail: str) -> Finished:
    return Finished(
        key=key,
        tokens=GeneratedTokens(token_ids=(), finish_reason="length"),
        failure=RequestFailure(reason=reason, detail=detail),
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerTarget:
    """What regenerate needs of ``--target`` when a server runs it: no weights are loaded."""

    tokenizer: Any
    info: Any
    """The target's ``TargetInfo`` (read from its config; its weights hash for the provenance)."""
    stop_ids: frozenset[int]
    """End-of-turn ids: the tokenizer's EOS and the generation config's, as ``stop_token_ids`` gives
    for a loaded model."""


def server_target(spec: str) -> ServerTarget:
    from transformers import GenerationConfig

    from dflash_offline.target_model.loader import load_config, load_tokenizer, resolve_target, target_info

    source = resolve_target(spec)
    config = load_config(source)
    tokenizer = load_tokenizer(spec)
    # A loaded model's generation config: generation_config.json when the directory has one, else the
    # one transformers derives from the model config.
    generation = GenerationConfig.from_model_config(config)
    if source.kind == "hf" and source.path is not None and (source.path / "generation_config.json").is_file():
        generation = GenerationConfig.from_pretrained(str(source.path))
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    eos = generation.eos_token_id
    ids |= {int(eos)} if isinstance(eos, int) else {int(i) for i in eos or ()}
    return ServerTarget(tokenizer=tokenizer, info=target_info(source, config), stop_ids=frozenset(ids))


def probe_for_config(config: Any) -> ServedModel:
    """The check ``run_regenerate`` makes before it writes anything (one line on failure)."""
    from dflash_offline.target_model.loader import load_tokenizer

    return probe_server(server_options(config), load_tokenizer(config.target))
