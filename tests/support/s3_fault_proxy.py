"""A fault-injecting HTTP proxy on 127.0.0.1 in front of moto's S3: what a flaky S3 does.

Point an S3 client's endpoint at `proxy.endpoint_url`; requests go on to the real endpoint, except
that every `every`-th one (counted over all requests, or only those `matching` a predicate) gets the
next fault of `faults` in turn instead:

- `"slowdown"`: 503 with S3's `SlowDown` error body (AWS's throttling answer);
- `"internal"`: 500 `InternalError`;
- `"reset"`: the connection is closed after the request is read, with no response (a reset
  mid-upload when the request is an UploadPart);
- `"slow"`: the request is forwarded, its answer delayed by `slow_s`.

Counts of what was injected are in `injected`. A `RequestGate` holds the requests it matches until
the test lets them go (an S3 that stalls exactly where a test needs a process to wait).
"""

from __future__ import annotations

import http.client
import itertools
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from tests.support.http_server import serving

ERROR_BODY = ('<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{message}'
              '</Message><RequestId>fault-proxy</RequestId></Error>')
HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade"}


class RequestGate:
    """While closed on a predicate, the requests it matches wait (up to `max_hold_s`) before they
    are forwarded; closing it on another predicate lets the first one's go. `held` counts the
    requests that waited, `waiting` those waiting now."""

    def __init__(self, max_hold_s: float = 120.0) -> None:
        self.max_hold_s = max_hold_s
        self._matching: Callable[[str, str], bool] | None = None
        self._changed = threading.Condition()
        self.held = 0
        self.waiting = 0

    def close(self, matching: Callable[[str, str], bool]) -> None:
        with self._changed:
            self._matching = matching
            self._changed.notify_all()

    def open(self) -> None:
        with self._changed:
            self._matching = None
            self._changed.notify_all()

    def _holds(self, method: str, path: str) -> bool:
        return self._matching is not None and self._matching(method, path)

    def pass_through(self, method: str, path: str) -> None:
        with self._changed:
            if not self._holds(method, path):
                return
            self.held += 1
            self.waiting += 1
            try:
                self._changed.wait_for(lambda: not self._holds(method, path), timeout=self.max_hold_s)
            finally:
                self.waiting -= 1


class FaultPlan:
    def __init__(self, faults: Sequence[str], every: int,
                 matching: Callable[[str, str], bool] | None = None, slow_s: float = 2.0) -> None:
        self._faults = itertools.cycle(faults)
        self.every = every
        self.matching = matching or (lambda method, path: True)
        self.slow_s = slow_s
        self._seen = 0
        self._lock = threading.Lock()
        self.injected: Counter[str] = Counter()
        self.enabled = True

    def next_fault(self, method: str, path: str) -> str | None:
        with self._lock:
            if not self.enabled or not self.matching(method, path):
                return None
            self._seen += 1
            if self._seen % self.every:
                return None
            fault = next(self._faults)
            self.injected[fault] += 1
            return fault


def _handler(target: str, plan: FaultPlan, gate: RequestGate | None) -> type[BaseHTTPRequestHandler]:
    parts = urlsplit(target)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _body(self) -> bytes:
            if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                chunks = bytearray()
                while True:
                    line = self.rfile.readline()
                    size = int(line.split(b";")[0].strip() or b"0", 16)
                    chunk = self.rfile.read(size + 2)  # data and its CRLF
                    chunks += line + chunk
                    if size == 0:
                        while (trailer := self.rfile.readline()) not in (b"\r\n", b""):
                            chunks += trailer
                        chunks += b"\r\n"
                        return bytes(chunks)
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _forward(self) -> None:
            body = self._body()
            if gate is not None:
                gate.pass_through(self.command, self.path)
            fault = plan.next_fault(self.command, self.path)
            if fault == "reset":
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            if fault in ("slowdown", "internal"):
                status, code = (503, "SlowDown") if fault == "slowdown" else (500, "InternalError")
                payload = ERROR_BODY.format(code=code, message=f"injected {code}").encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
                return
            upstream = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
            try:
                headers = {name: value for name, value in self.headers.items()}
                upstream.request(self.command, self.path, body=body, headers=headers)
                response = upstream.getresponse()
                data = response.read()
            finally:
                upstream.close()
            if fault == "slow":
                time.sleep(plan.slow_s)
            self.send_response(response.status)
            head = self.command == "HEAD"  # its Content-Length is the object's size, not this body's
            for name, value in response.getheaders():
                if name.lower() not in HOP_BY_HOP and (head or name.lower() != "content-length"):
                    self.send_header(name, value)
            if not head:
                self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

    return Handler


class S3FaultProxy:
    def __init__(self, server: ThreadingHTTPServer, plan: FaultPlan) -> None:
        self.server = server
        self.plan = plan
        host, port = server.server_address[:2]
        self.endpoint_url = f"http://{host}:{port}"


@contextmanager
def s3_fault_proxy(target_endpoint: str, plan: FaultPlan,
                   gate: RequestGate | None = None) -> Iterator[S3FaultProxy]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(target_endpoint, plan, gate))
    server.daemon_threads = True
    with serving(server):
        yield S3FaultProxy(server, plan)
