"""A small OpenAI-compatible server around the tiny random target, for the ``--engine openai`` tests.

It speaks the real protocol over a socket (``http.server``, one thread per connection): ``GET /v1/models``
and ``POST /v1/completions`` with a prompt of token ids or text, greedy (or sampled) decoding by HF
``generate`` at batch 1, ``max_tokens``, ``stop_token_ids``, ``usage`` counted as vLLM counts it (the stop
token is a completion token) and vLLM's ``return_token_ids``. Faults are injected on request:
``POST /admin/faults`` with ``{"status_at": {"3": 429}, "timeout_at": [5], "sleep": 2.0,
"reject_marker": "fox", "text_only": false, "add_bos": false, "die_after": null}`` (request numbers
count completion requests from 1, in arrival order; ``reject_marker``: every prompt whose text holds it
gets a 500; ``text_only``: token-id prompts are refused with 400 and no token ids are returned;
``add_bos``: text prompts get one more token, as a server with another tokenizer setting would;
``die_after``: the process SIGKILLs itself when that completion request arrives; ``choice_override`` and
``usage_override``: fields replaced in ``choices[0]`` and ``usage`` of every answer, as a broken server
would return them).

Run: ``python -m tests.regenerate.openai_server --port 0``; it prints ``LISTENING <port>`` when ready.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

MODEL_NAME = "tiny"


class Faults:
    """The injected faults and the completion-request counter (shared by the handler threads)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0
        self.plan: dict[str, Any] = {}

    def next_request(self) -> tuple[int, dict[str, Any]]:
        with self.lock:
            self.count += 1
            return self.count, dict(self.plan)


class TinyServer:
    def __init__(self, target_spec: str) -> None:
        from dflash_offline.target_model.loader import load_target

        torch.set_num_threads(1)
        self.target = load_target(target_spec, device="cpu")
        self.tokenizer = self.target.tokenizer
        self.model = self.target.model
        self.lock = threading.Lock()  # one generate at a time (batch 1, as simple as a server gets)
        self.faults = Faults()

    def complete(self, body: dict[str, Any], plan: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if body.get("model") != MODEL_NAME:
            return 404, {"error": {"message": f"model {body.get('model')!r} does not exist"}}
        prompt = body.get("prompt")
        if isinstance(prompt, list):
            if plan.get("text_only"):
                return 400, {"error": {"message": "prompt must be a string"}}
            ids = [int(t) for t in prompt]
        elif isinstance(prompt, str):
            ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            if plan.get("add_bos"):
                ids = [self.tokenizer.bos_token_id or 0, *ids]
        else:
            return 400, {"error": {"message": "prompt must be a string or a list of token ids"}}
        marker = plan.get("reject_marker")
        if marker and marker in self.tokenizer.decode(ids):
            return 500, {"error": {"message": "injected failure for this prompt"}}
        max_tokens = int(body.get("max_tokens") or 16)
        temperature = float(body.get("temperature") or 0.0)
        stop_ids = set(body.get("stop_token_ids") or [])
        eos = self.model.generation_config.eos_token_id
        stop_ids |= {eos} if isinstance(eos, int) else set(eos or [])
        with self.lock, torch.inference_mode():
            if temperature > 0:
                torch.manual_seed(int(body.get("seed") or 0))
            input_ids = torch.tensor([ids])
            sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
            out = self.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_tokens,
                eos_token_id=sorted(stop_ids),
                pad_token_id=min(stop_ids),
                **(sampling if temperature > 0 else {"do_sample": False}),
            )
        generated = out[0, len(ids) :].tolist()
        stop_at = next((i for i, t in enumerate(generated) if t in stop_ids), None)
        if stop_at is not None:
            generated, finish = generated[: stop_at + 1], "stop"  # the stop token counts, as in vLLM
        else:
            finish = "length"
        shown = generated[:-1] if finish == "stop" else generated
        skip = bool(body.get("skip_special_tokens", True))
        choice: dict[str, Any] = {
            "index": 0,
            "text": self.tokenizer.decode(shown, skip_special_tokens=skip),
            "finish_reason": finish,
            "logprobs": None,
        }
        if body.get("return_token_ids") and not plan.get("text_only"):
            choice["token_ids"] = generated
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(generated)}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        choice.update(plan.get("choice_override") or {})  # a server that returns bad values
        usage.update(plan.get("usage_override") or {})
        return 200, {
            "id": "cmpl-test",
            "object": "text_completion",
            "created": int(time.time()),
            "model": MODEL_NAME,
            "choices": [choice],
            "usage": usage,
        }


def make_handler(server: TinyServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as real servers

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _send(self, status: int, payload: dict[str, Any], headers: dict[str, str] | None = None) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> dict[str, Any]:
            length = int(self.headers.get("Content-Length") or 0)
            return json.loads(self.rfile.read(length) or b"{}")  # type: ignore[no-any-return]

        def do_GET(self) -> None:
            if self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": MODEL_NAME, "object": "model"}]})
            else:
                self._send(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self) -> None:
            body = self._body()
            if self.path == "/admin/faults":
                with server.faults.lock:
                    server.faults.plan = body
                    server.faults.count = 0
                self._send(200, {"ok": True})
                return
            if self.path != "/v1/completions":
                self._send(404, {"error": {"message": f"no route {self.path}"}})
                return
            number, plan = server.faults.next_request()
            if plan.get("die_after") == number:
                os.kill(os.getpid(), signal.SIGKILL)
            status = (plan.get("status_at") or {}).get(str(number))
            if status is not None:
                self._send(int(status), {"error": {"message": "injected"}}, {"Retry-After": "0"})
                return
            if number in (plan.get("timeout_at") or []):
                time.sleep(float(plan.get("sleep", 2.0)))  # past the client's timeout: it retries
            status, payload = server.complete(body, plan)
            self._send(status, payload)

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--target", default="random:tiny")
    args = parser.parse_args()
    server = TinyServer(args.target)
    httpd = ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(server))
    httpd.daemon_threads = True
    print(f"LISTENING {httpd.server_address[1]}", flush=True)
    try:
        httpd.serve_forever()
    finally:
        httpd.server_close()
        sys.stdout.flush()


if __name__ == "__main__":
    main()
