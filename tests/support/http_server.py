"""A real `http.server` for tests, served from a daemon thread for the length of a `with` block."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import HTTPServer
from typing import TypeVar

S = TypeVar("S", bound=HTTPServer)


@contextmanager
def serving(server: S) -> Iterator[S]:
    """Serve `server` until the block ends, then shut it down and close its socket."""
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
