"""`bulkinfer serve api` (the HTTP API alone) and `bulkinfer serve all` (the API plus a worker, one
command, against the Redis and store the settings name).

Settings: flags > `BULKINFER_*` variables > config file > defaults (docs/configuration.md). The
worker of `serve all` is a child process (`python -m bulkinfer.api.cli serve worker`), never imported here:
the API side stays torch-free. It gets the resolved settings through its environment, runs in its
own session (a Ctrl-C reaches only us) and is stopped after the API: SIGTERM lets it finish its
shards for a while, then it is killed and the shard reaper of any worker re-sends its shard.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from bulkinfer.jobs.settings import ConfigError, Settings
from bulkinfer.jobs.settings_args import WORKER_SETTINGS, add_settings_arguments, settings_from_args

API_SETTINGS = ("broker_url", "store_uri", "s3_endpoint_url", "models", "api_host", "api_port", "api_keys",
                "admin_api_keys", "tenant_prefixes", "webhook_allow_http", "webhook_allow_private",
                "max_upload_bytes", "max_jobs_in_flight", "max_requests_per_s", "max_auth_failures_per_min",
                "max_completion_window", "log_format", "tenant_max_priority", "default_tenant_max_priority",
                "max_shard_size", "max_shard_tokens", "max_tokens_cap", "output_tokens_estimate",
                "lora_adapters", "enable_lora")
WORKER_ONLY_SETTINGS = tuple(name for name in WORKER_SETTINGS if name not in API_SETTINGS)
SOURCE_ROOT = Path(__file__).resolve().parents[1]
WORKER_STOP_TIMEOUT_S = 30


def _settings(args: argparse.Namespace, command: str) -> Settings | None:
    try:
        return settings_from_args(args)
    except ConfigError as error:
        print(f"bulkinfer {command}: {error}", file=sys.stderr)
        return None


def serve_api(argv: list[str]) -> int:
    import uvicorn

    from bulkinfer.api.app import create_app

    parser = argparse.ArgumentParser(prog="bulkinfer serve api", description="Serve the HTTP API.")
    parser.add_argument("--log-level", default="info")
    add_settings_arguments(parser, API_SETTINGS)
    args = parser.parse_args(argv)
    settings = _settings(args, "serve api")
    if settings is None:
        return 2
    json_logs = _use_json_logs(settings, args.log_level)
    logs: dict[str, Any] = {"log_config": None} if json_logs else {}
    uvicorn.run(create_app(settings), host=settings.api_host, port=settings.api_port,
                log_level=args.log_level, **logs)
    return 0


def _use_json_logs(settings: Settings, level: str) -> bool:
    """`log_format = "json"`: the root logger writes JSON lines, and uvicorn is told to log there."""
    if settings.log_format != "json":
        return False
    from bulkinfer.jobs.log_format import configure_json_logging

    configure_json_logging(level, settings.log_secrets())
    return True


def serve_all_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bulkinfer serve all",
        description="Serve the API and run one worker (in a child process) against the Redis and object "
                    "store of the settings, until Ctrl-C or SIGTERM.")
    parser.add_argument("--log-level", default="info", help="the API's log level")
    worker = parser.add_argument_group("worker")
    worker.add_argument("--model", action="append", dest="served_models", metavar="NAME",
                        help="serve this registry model (repeatable; default: every model of the registry)")
    worker.add_argument("--no-preload", action="store_true", help="load each model on its first shard")
    worker.add_argument("--hostname", "-n", help="the worker's Celery node name")
    worker.add_argument("--worker-log", type=Path, default=None,
                        help="write the worker's output to this file (default: this terminal)")
    add_settings_arguments(parser, API_SETTINGS + WORKER_ONLY_SETTINGS)
    return parser


def worker_command(args: argparse.Namespace) -> list[str]:
    """The child's command line; its settings come through the environment."""
    command = [sys.executable, "-m", "bulkinfer.api.cli", "serve", "worker"]
    for name in args.served_models or []:
        command += ["--model", name]
    if args.no_preload:
        command.append("--no-preload")
    if args.hostname:
        command += ["-n", args.hostname]
    return command


def serve_all(argv: list[str]) -> int:
    from bulkinfer.api.app import create_app
    from bulkinfer.api.cli.server import ServerThread
    from bulkinfer.api.cli.stack import stop_process

    args = serve_all_parser().parse_args(argv)
    settings = _settings(args, "serve all")
    if settings is None:
        return 2
    registry = settings.model_registry()
    try:
        if not registry.names():
            raise ValueError("no models to serve: set BULKINFER_MODELS or `models` in the config file")
        for name in args.served_models or []:
            registry.queue_for(name)  # UnknownModel names the served ones
    except (LookupError, ValueError) as error:
        print(f"bulkinfer serve all: {error}", file=sys.stderr)
        return 2
    env = {**os.environ, **settings.to_env(),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(SOURCE_ROOT), os.environ.get("PYTHONPATH")]))}
    log = open(args.worker_log, "ab") if args.worker_log else None  # noqa: SIM115 - closed below
    worker = subprocess.Popen(worker_command(args), env=env, stdout=log,
                              stderr=subprocess.STDOUT if log else None, start_new_session=True)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    server = None
    code = 0
    try:
        server = ServerThread(create_app(settings), host=settings.api_host, port=settings.api_port,
                              log_level=args.log_level,
                              json_logs=_use_json_logs(settings, args.log_level)).start()
        print(f"api     {server.url} (OpenAPI docs at {server.url}/docs)", flush=True)
        models = args.served_models or registry.names()
        print(f"worker  pid {worker.pid}, models {', '.join(models)}", flush=True)
        while not stop.wait(0.5):
            if worker.poll() is not None:
                print(f"bulkinfer serve all: the worker exited with code {worker.returncode}",
                      file=sys.stderr)
                code = 1
                break
    except (RuntimeError, TimeoutError) as error:
        print(f"bulkinfer serve all: {error}", file=sys.stderr)
        code = 1
    finally:
        print("stopping…", flush=True)
        if server is not None:
            server.stop()
        stop_process(worker, WORKER_STOP_TIMEOUT_S)
        if log is not None:
            log.close()
    return code
