"""A live ``socketserver`` server on a thread for a test, always stopped however the test ends."""

from __future__ import annotations

import contextlib
import socketserver
import threading
from collections.abc import Iterator
from typing import TypeVar

S = TypeVar("S", bound=socketserver.BaseServer)


@contextlib.contextmanager
def running(server: S, poll_interval: float = 0.02) -> Iterator[S]:
    """Serve ``server`` on a thread; yield it; then shut it down, join the thread and close the
    socket, so no test leaves a thread or a port behind (the body may raise: still stopped)."""
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": poll_interval},
                              name=f"test-server-{server.server_address}")
    try:
        thread.start()
        yield server
    finally:
        if thread.ident is not None:  # started: shutdown() waits for serve_forever to return
            server.shutdown()
            thread.join()
        server.server_close()
