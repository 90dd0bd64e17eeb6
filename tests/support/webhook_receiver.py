"""A tiny webhook receiver for tests: a real HTTP server in a thread that records every request and
answers with the statuses it is told to (then 200).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.support.http_server import serving


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    answered: int


@dataclass
class Receiver:
    url: str
    statuses: list[int] = field(default_factory=list)  # answers to give first, in order
    requests: list[Received] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def next_status(self) -> int:
        with self.lock:
            return self.statuses.pop(0) if self.statuses else 200


@contextmanager
def webhook_receiver(statuses: list[int] | None = None) -> Iterator[Receiver]:
    receiver: Receiver

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            status = receiver.next_status()
            with receiver.lock:
                receiver.requests.append(Received(self.path, dict(self.headers.items()), body, status))
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *_args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    url = f"http://127.0.0.1:{server.server_address[1]}/hook"
    receiver = Receiver(url=url, statuses=list(statuses or []))
    with serving(server):
        yield receiver
