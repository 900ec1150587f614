"""The deployment demo's serving agent: ``python -m node.serving.openai_api`` (the OpenAI-compatible
server on the scheduler) beside one SuperNode.

It shares node 0's cache directory (node-config ``cache-dir``) and key (``--cache-dir``), so
each write-back by that node's ClientApp processes invalidates it (``node.serving.param_channel``) and it
loads the published parameters between scheduler steps (``node.serving.openai_follow``). A client
thread streams one chat completion every ``interval_s`` with plain HTTP (no ``openai``
import in product code) and records the model version of every chunk (its
``system_fingerprint``, ``fedkv-v<version>``) and of ``/v1/models``, so the demo's summary
shows the server picking up each new version while the federation trains; a reply whose
chunks span two versions was restarted under the new one mid-reply. The server writes its
bearer token on first start (``serve-token`` beside the cache directory, 0600); the client
reads it from there and authenticates every request.
"""

from __future__ import annotations

import json
import sys
import threading
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any, Protocol

from node.serving.serve_auth import default_token_file, parse_tokens

MODEL = "fedkv-byte"
"""``node.serving.openai_api``'s id of the node's byte-level model (``--task lm``)."""
MESSAGES = [{"role": "system", "content": "You are a fedkv cache node."},
            {"role": "user", "content": "status?"}]


class ProcessStarter(Protocol):
    def start(self, name: str, cmd: list[str], log: Path, env: dict[str, str], cwd: Path | None = None,
              pipe: bool = False) -> Any: ...


def _version(fingerprint: str) -> int:
    """``fedkv-v<version>`` -> version (a ValueError for anything else)."""
    if not fingerprint.startswith("fedkv-v"):
        raise ValueError(f"unexpected system_fingerprint {fingerprint!r}")
    return int(fingerprint.removeprefix("fedkv-v"))


class ServeProbe:
    def __init__(self, work: Path, cache_dir: Path, interval_s: float = 0.5) -> None:
        self.work, self.cache_dir, self.interval_s = work, cache_dir, interval_s
        self.ready = work / "serve-ready.json"
        self.token_file = default_token_file(cache_dir)
        self._token: str | None = None
        self.versions: list[int] = []
        """Each reply's version (its last chunk's)."""
        self.spanning = 0
        """Replies whose chunks span two versions (restarted under a write-back)."""
        self.model_versions: list[int] = []
        self.errors: list[str] = []
        self.final: dict[str, Any] = {}
        self._port: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._ask_loop, daemon=True)

    def start(self, procs: ProcessStarter, env: dict[str, str], log: Path, cwd: Path) -> None:
        """Start the server (it waits for the node's key and first parameters) and the client."""
        cmd = [sys.executable, "-m", "node.serving.openai_api", "--backend", "scheduler",
               "--cache-dir", str(self.cache_dir), "--port", "0", "--ready-file", str(self.ready)]
        procs.start("serve-node-0", cmd, log, env, cwd=cwd)
        self._thread.start()

    def _request(self, path: str, body: dict | None = None) -> urllib.request.Request:
        return urllib.request.Request(
            f"http://127.0.0.1:{self._port}{path}",
            data=json.dumps(body).encode() if body is not None else None,
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {self._token}"})

    def _get(self, path: str) -> dict:
        with urllib.request.urlopen(self._request(path), timeout=30) as r:
            return json.loads(r.read())

    def _chat(self) -> list[int]:
        """One streamed chat completion: the version of each chunk, in order."""
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "stream": True}
        versions = []
        with urllib.request.urlopen(self._request("/v1/chat/completions", body), timeout=30) as r:
            for line in r:
                data = line.decode().strip().removeprefix("data: ")
                if not line.startswith(b"data: ") or data == "[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    raise ValueError(f"stream error: {chunk['error'].get('message')}")
                versions.append(_version(chunk["system_fingerprint"]))
        if not versions:
            raise ValueError("an empty stream")
        return versions

    def _ask_loop(self) -> None:
        while not self._stop.is_set() and self._port is None:
            if self.ready.exists():  # the server wrote its token file before it was ready
                self._token = parse_tokens(self.token_file.read_text())[0][1]
                self._port = int(json.loads(self.ready.read_text())["port"])
            self._stop.wait(0.2)
        while not self._stop.wait(self.interval_s):
            try:
                chunks = self._chat()
                self.versions.append(chunks[-1])
                self.spanning += len(set(chunks)) > 1
                self.model_versions.append(int(self._get("/v1/models")["data"][0]["version"]))
            except (OSError, urllib.error.URLError, ValueError, KeyError, IndexError) as e:
                self.errors.append(f"{type(e).__name__}: {e}"[:200])

    def stop(self) -> None:
        """Stop asking; read the server's own counters (the process is stopped by its tracker)."""
        self._stop.set()
        self._thread.join(30)
        if self._port is not None:
            try:
                self.final = self._get("/v1/stats")
            except (OSError, urllib.error.URLError, ValueError) as e:
                self.errors.append(f"stats: {type(e).__name__}: {e}"[:200])

    def report(self) -> dict[str, Any]:
        return {
            "started": self._port is not None,
            "server": "node.serving.openai_api --backend scheduler",
            "replies": len(self.versions),
            "replies_per_version": {str(v): n for v, n in sorted(Counter(self.versions).items())},
            "replies_spanning_versions": self.spanning,
            "models_versions_seen": sorted(set(self.model_versions)),
            "versions_loaded": self.final.get("versions_seen", []),
            "invalidations": self.final.get("invalidations", 0),
            "errors": self.errors[-5:],
        }
