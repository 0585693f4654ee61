"""JSON over HTTP to an OpenAI-compatible server: one keep-alive connection per thread, a per-request
timeout, and retries with exponential backoff on 429/5xx, timeouts and dropped connections.

Standard library only (``http.client``): the engine calls it from a pool of threads, each blocked on its
own request, so no event loop and no extra dependency is needed. Errors are three exception classes that
the engine turns into failure rows or a fatal error (``openai_engine.py``); none of them is shown to a
user as it is.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
"""Statuses worth another attempt: rate limiting and a server that is busy or restarting."""

MAX_BACKOFF_SECONDS = 60.0
"""The wait between attempts doubles from the policy's first wait up to this."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RetryPolicy:
    """How hard one request tries."""

    timeout_seconds: float
    """Seconds to wait for the server's answer to one attempt."""
    max_retries: int
    """Attempts after the first one (on 429/5xx, a timeout or a dropped connection)."""
    backoff_seconds: float
    """Wait before the first retry; doubled for each later one (capped at MAX_BACKOFF_SECONDS). A 429's
    Retry-After header, when longer, is honoured instead."""

    def wait_before(self, retry: int, retry_after: float | None) -> float:
        """Seconds to sleep before retry number ``retry`` (1-based)."""
        wait = min(self.backoff_seconds * 2 ** (retry - 1), MAX_BACKOFF_SECONDS)
        return max(wait, min(retry_after or 0.0, MAX_BACKOFF_SECONDS))


class HttpError(Exception):
    """A request that failed after ``attempts`` attempts."""

    def __init__(self, message: str, *, attempts: int = 1) -> None:
        super().__init__(message)
        self.attempts = attempts


class HttpStatusError(HttpError):
    """The server answered with an error status."""

    def __init__(
        self, status: int, body: str, *, retry_after: float | None = None, attempts: int = 1
    ) -> None:
        super().__init__(f"HTTP {status}: {body[:300]}", attempts=attempts)
        self.status = status
        self.body = body
        self.retry_after = retry_after


class ConnectionLostError(HttpError):
    """The server could not be reached, or closed the connection without an answer."""


class RequestTimeoutError(HttpError):
    """No answer within the policy's timeout."""


class BadResponseError(HttpError):
    """The server answered 2xx with something that is not JSON."""


class AbortedError(HttpError):
    """The client was aborted (the run is stopping) while the request was in flight."""


class JsonClient:
    """GET and POST JSON to ``root_url`` (``http://host:port``, optionally with a path prefix)."""

    def __init__(
        self,
        root_url: str,
        *,
        api_key: str | None,
        policy: RetryPolicy,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        parts = urlsplit(root_url)
        assert parts.scheme in ("http", "https"), root_url
        assert parts.hostname, root_url
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port
        self._prefix = parts.path.rstrip("/")
        self._headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self.policy = policy
        self._sleep = sleep
        self._local = threading.local()
        self._lock = threading.Lock()
        self._open: set[http.client.HTTPConnection] = set()
        self._aborted = threading.Event()

    def get(self, path: str, *, retries: bool = False) -> Any:
        return self._request("GET", path, None, retries=retries)

    def post(self, path: str, payload: dict[str, Any], *, retries: bool = True) -> Any:
        return self._request("POST", path, json.dumps(payload).encode(), retries=retries)

    def abort(self) -> None:
        """Stop every request in flight (their threads get ``AbortedError``) and refuse new ones."""
        self._aborted.set()
        with self._lock:
            connections = list(self._open)
        for conn in connections:
            sock = conn.sock
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv

    def _request(self, method: str, path: str, body: bytes | None, *, retries: bool) -> Any:
        attempts = 0
        while True:
            attempts += 1
            if self._aborted.is_set():
                raise AbortedError("the run is stopping", attempts=attempts)
            try:
                return self._once(method, path, body)
            except HttpError as e:
                e.attempts = attempts
                if self._aborted.is_set():
                    raise AbortedError("the run is stopping", attempts=attempts) from None
                retryable = isinstance(e, ConnectionLostError | RequestTimeoutError) or (
                    isinstance(e, HttpStatusError) and e.status in RETRY_STATUSES
                )
                if not retries or not retryable or attempts > self.policy.max_retries:
                    raise
                retry_after = e.retry_after if isinstance(e, HttpStatusError) else None
                self._sleep(self.policy.wait_before(attempts, retry_after))

    def _connection(self) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            conn = cls(self._host, self._port, timeout=self.policy.timeout_seconds)
            self._local.conn = conn
            with self._lock:
                self._open.add(conn)
        return conn

    def close_connection(self) -> None:
        """Close the calling thread's keep-alive connection, if it has one (a later request opens a new
        one): each thread calls it once it is done with the client."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None
            with self._lock:
                self._open.discard(conn)

    def _once(self, method: str, path: str, body: bytes | None) -> Any:
        conn = self._connection()
        try:
            conn.request(method, self._prefix + path, body=body, headers=self._headers)
            response = conn.getresponse()
            data = response.read()
        except TimeoutError:
            self.close_connection()
            raise RequestTimeoutError(f"no answer within {self.policy.timeout_seconds:g} s") from None
        except (OSError, http.client.HTTPException, UnicodeError) as e:
            # Refused, reset, closed without a response (RemoteDisconnected), DNS failure, a host name
            # the resolver cannot encode (UnicodeError), ...
            self.close_connection()
            raise ConnectionLostError(f"{type(e).__name__}: {e}") from None
        if response.will_close:
            self.close_connection()
        text = data.decode("utf-8", errors="replace")
        if response.status >= 400:
            raise HttpStatusError(
                response.status, text, retry_after=_retry_after(response.getheader("Retry-After"))
            )
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise BadResponseError(
                f"HTTP {response.status} with a body that is not JSON: {text[:200]!r}"
            ) from None


def _retry_after(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None  # an HTTP date: the backoff applies
