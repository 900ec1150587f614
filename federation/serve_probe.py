"""The deployment demo's serving agent: ``python -m node.serve`` beside one SuperNode.

It shares node 0's cache directory (node-config ``cache-dir``) and key, so each write-back by
that node's ClientApp processes invalidates it (``node.coherence``). A client thread sends it
one chat turn every ``interval_s`` and records the model version of every reply, so the demo's
summary shows the agent picking up each new version while the federation trains. The agent
writes its bearer token on first start (``serve-token`` beside the cache directory, 0600); the
client reads it from there and authenticates every request.
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

from node.serve_auth import default_token_file, parse_tokens


class ProcessStarter(Protocol):
    def start(self, name: str, cmd: list[str], log: Path, env: dict[str, str], cwd: Path | None = None,
              pipe: bool = False) -> Any: ...


class ServeProbe:
    def __init__(self, work: Path, cache_dir: Path, interval_s: float = 0.5) -> None:
        self.work, self.cache_dir, self.interval_s = work, cache_dir, interval_s
        self.ready = work / "serve-ready.json"
        self.token_file = default_token_file(cache_dir)
        self._token: str | None = None
        self.versions: list[int] = []
        self.errors: list[str] = []
        self.final: dict[str, Any] = {}
        self._port: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._ask_loop, daemon=True)

    def start(self, procs: ProcessStarter, env: dict[str, str], log: Path, cwd: Path) -> None:
        """Start the agent (it waits for the node's key and first parameters) and the client."""
        cmd = [sys.executable, "-m", "node.serve", "--cache-dir", str(self.cache_dir), "--port", "0",
               "--ready-file", str(self.ready)]
        procs.start("serve-node-0", cmd, log, env, cwd=cwd)
        self._thread.start()

    def _call(self, path: str, body: dict | None = None) -> dict:
        req = urllib.request.Request(f"http://127.0.0.1:{self._port}{path}",
                                     data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {self._token}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())

    def _ask_loop(self) -> None:
        while not self._stop.is_set() and self._port is None:
            if self.ready.exists():  # the agent wrote its token file before it was ready
                self._token = parse_tokens(self.token_file.read_text())[0][1]
                self._port = int(json.loads(self.ready.read_text())["port"])
            self._stop.wait(0.2)
        sid = None
        while not self._stop.wait(self.interval_s):
            try:
                if sid is None or len(self.versions) % 8 == 0:  # short sessions: the context is 128
                    sid = self._call("/v1/sessions", {"system": "You are a fedkv cache node. "})["session"]
                r = self._call(f"/v1/sessions/{sid}", {"text": "status? ", "max_new_tokens": 4})
                self.versions.append(int(r["version"]))
            except (OSError, urllib.error.URLError, ValueError, KeyError) as e:
                self.errors.append(f"{type(e).__name__}: {e}"[:200])
                sid = None

    def stop(self) -> None:
        """Stop asking; read the agent's own counters (the process is stopped by its tracker)."""
        self._stop.set()
        self._thread.join(30)
        if self._port is not None:
            try:
                self.final = self._call("/v1/stats")
            except (OSError, urllib.error.URLError, ValueError) as e:
                self.errors.append(f"stats: {type(e).__name__}: {e}"[:200])

    def report(self) -> dict[str, Any]:
        return {
            "started": self._port is not None,
            "replies": len(self.versions),
            "replies_per_version": {str(v): n for v, n in sorted(Counter(self.versions).items())},
            "versions_loaded": self.final.get("versions_seen", []),
            "invalidations": self.final.get("invalidations", 0),
            "rolled_back_turns": self.final.get("rolled_back_turns", 0),
            "errors": self.errors[-5:],
        }
