"""`bulkinfer serve api`: the HTTP API alone, configured from BULKINFER_* environment variables."""

from __future__ import annotations

import argparse


def serve_api(argv: list[str]) -> int:
    import uvicorn

    parser = argparse.ArgumentParser(prog="bulkinfer serve api",
                                     description="Serve the HTTP API (settings from BULKINFER_* variables).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    uvicorn.run("api.app:create_app", factory=True, host=args.host, port=args.port, log_level=args.log_level)
    return 0
