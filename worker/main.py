"""Starting a worker: `bulkinfer serve worker` builds and runs the equivalent of

    celery -A worker.celery_app worker --pool=threads --concurrency=2 \\
        -Q bulkinfer.control,bulkinfer.model.<name>

and starts loading the served models in the background as soon as the worker is up.
"""

from __future__ import annotations

import argparse
import os

from jobs.models import CONTROL_QUEUE, ModelRegistry
from jobs.settings import Settings
from worker.celery_app import PRELOAD_MODELS_ENV


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bulkinfer serve worker",
        description="Run a worker: one engine per served model, shards of those models, plus plan and "
                    "finalize tasks. Settings come from BULKINFER_* variables (see docs/pipeline.md).")
    parser.add_argument("--model", action="append", dest="models", metavar="NAME",
                        help="serve this registry model (repeatable; default: all of BULKINFER_MODELS)")
    parser.add_argument("--concurrency", type=int, default=2,
                        help="task threads (default 2: one shard's rows wait in the engine as another ends)")
    parser.add_argument("--no-control", action="store_true",
                        help="do not take plan/finalize tasks (run them on other workers)")
    parser.add_argument("--no-preload", action="store_true",
                        help="load each model on its first shard instead of at start")
    parser.add_argument("--hostname", "-n", help="the Celery node name (default: celery@<host>)")
    parser.add_argument("--loglevel", default="INFO")
    return parser.parse_args(argv)


def worker_argv(args: argparse.Namespace, registry: ModelRegistry) -> tuple[list[str], list[str]]:
    """(Celery worker arguments, models to serve); raises ValueError for a model the registry lacks."""
    models = args.models or registry.names()
    if not models:
        raise ValueError("no models to serve: set BULKINFER_MODELS (a JSON object of name → directory or "
                         "s3:// prefix) or pass --model")
    queues = [registry.queue_for(name) for name in models]  # UnknownModel names the served ones
    if not args.no_control:
        queues.insert(0, CONTROL_QUEUE)
    if args.concurrency < 1:
        raise ValueError(f"--concurrency must be at least 1, got {args.concurrency}")
    argv = ["worker", "--pool=threads", f"--concurrency={args.concurrency}", "-Q", ",".join(queues),
            f"--loglevel={args.loglevel}"]
    if args.hostname:
        argv += ["-n", args.hostname]
    return argv, models


def serve_worker(argv: list[str]) -> int:
    """Run a worker in this process until it is stopped (SIGTERM: finish running shards, then exit)."""
    args = parse_args(argv)
    try:
        celery_argv, models = worker_argv(args, Settings.from_env().model_registry())
    except (LookupError, ValueError) as error:
        print(f"bulkinfer serve worker: {error}", flush=True)
        return 2
    if not args.no_preload:
        os.environ[PRELOAD_MODELS_ENV] = ",".join(models)
    from worker.celery_app import app

    app.worker_main(celery_argv)
    return 0
