"""Start the fake OpenAI-compatible server (``openai_server.py``) as a process and inject its faults."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, kw_only=True, slots=True)
class Server:
    url: str
    process: subprocess.Popen[str]

    def faults(self, **plan: Any) -> None:
        """Replace the server's fault plan (no argument: none) and restart its request count."""
        request = urllib.request.Request(
            self.url + "/admin/faults", data=json.dumps(plan).encode(), method="POST"
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200


def start_server() -> subprocess.Popen[str]:
    """The server process, loading its model (``ready`` waits for it)."""
    return subprocess.Popen(
        [sys.executable, "-m", "tests.regenerate.openai_server", "--port", "0"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )


def ready(process: subprocess.Popen[str]) -> Server:
    assert process.stdout is not None
    line = process.stdout.readline()  # blocks until the model is loaded and the socket listens
    assert line.startswith("LISTENING "), line
    return Server(url=f"http://127.0.0.1:{int(line.split()[1])}", process=process)
