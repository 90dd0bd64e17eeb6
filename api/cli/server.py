"""Serve the API with uvicorn in a background thread (the embedded stack and tests use it)."""

from __future__ import annotations

import threading
import time
from typing import Any

import uvicorn
from fastapi import FastAPI


class ServerThread:
    """`with ServerThread(app, port=...) as server:` serves at `server.url` until the block ends."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 8000,
                 log_level: str = "warning", json_logs: bool = False) -> None:
        # JSON logs: uvicorn's loggers go to the root logger's JSON handler (api/cli/serve.py).
        logs: dict[str, Any] = {"log_config": None} if json_logs else {}
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on", **logs)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="bulkinfer-api", daemon=True)
        self.url = f"http://{host}:{port}"

    def start(self, timeout: float = 30) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the API server stopped while starting (is {self.url} in use?)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the API server did not start within {timeout}s")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 10) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()
