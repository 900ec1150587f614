"""tests.node.live_server.running: the thread and the socket are gone after the block, even when
the body raises, and the server answered while it ran."""

from __future__ import annotations

import contextlib
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from tests.node.live_server import running


class _Ok(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")


def _server_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("test-server-")]


@pytest.mark.parametrize("body_raises", [False, True])
def test_running_serves_then_stops_thread_and_socket(body_raises: bool) -> None:
    server = HTTPServer(("127.0.0.1", 0), _Ok)
    with pytest.raises(RuntimeError) if body_raises else contextlib.nullcontext():
        with running(server) as s:
            url = f"http://127.0.0.1:{s.server_address[1]}/"
            assert urllib.request.urlopen(url, timeout=10).read() == b"ok"
            assert _server_threads()
            if body_raises:
                raise RuntimeError("the test failed")
    assert not _server_threads()
    assert server.socket.fileno() == -1  # closed

