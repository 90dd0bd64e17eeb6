"""Starting a worker: `bulkinfer serve worker` builds and runs the equivalent of

    celery -A bulkinfer.worker.process.celery_app worker --pool=threads --concurrency=2 \\
        -Q bulkinfer.control,bulkinfer.model.<name>

and starts loading the served models in the background as soon as the worker is up. Settings come
from flags, `BULKINFER_*` variables and the config file (docs/configuration.md), read once: the
process runs on that `Settings` object (`bulkinfer.jobs.settings.configure_process`), handed down to every
module.
"""

from __future__ import annotations

import argparse

from bulkinfer.jobs.model_registry import ModelRegistry
from bulkinfer.jobs.names import CONTROL_QUEUE
from bulkinfer.jobs.settings import configure_process
from bulkinfer.jobs.settings_args import WORKER_SETTINGS, add_settings_arguments, settings_from_args

DEFAULT_CONCURRENCY = 2


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """The worker's own flags (also taken by `serve all`)."""
    parser.add_argument("--model", action="append", dest="served_models", metavar="NAME",
                        help="serve this registry model (repeatable; default: every model of the registry)")
    parser.add_argument("--no-control", action="store_true",
                        help="do not take plan/finalize tasks (run them on other workers)")
    parser.add_argument("--no-preload", action="store_true",
                        help="load each model on its first shard instead of at start")
    parser.add_argument("--hostname", "-n", help="the Celery node name (default: celery@<host>)")
    parser.add_argument("--loglevel", default="INFO")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bulkinfer serve worker",
        description="Run a worker: one engine per served model, shards of those models, plus plan and "
                    "finalize tasks.")
    add_worker_arguments(parser)
    add_settings_arguments(parser, WORKER_SETTINGS)
    return parser.parse_args(argv)


def worker_argv(args: argparse.Namespace, registry: ModelRegistry) -> tuple[list[str], list[str]]:
    """(Celery worker arguments, models to serve); raises ValueError for a model the registry lacks."""
    models = args.served_models or registry.names()
    if not models:
        raise ValueError("no models to serve: set BULKINFER_MODELS (a JSON object of name → directory or "
                         "s3:// prefix), `models` in the config file, or pass --model")
    queues = [registry.queue_for(name) for name in models]  # UnknownModel names the served ones
    if not args.no_control:
        queues.insert(0, CONTROL_QUEUE)
    concurrency = args.worker_concurrency or DEFAULT_CONCURRENCY
    if concurrency < 1:
        raise ValueError(f"--concurrency must be at least 1, got {concurrency}")
    argv = ["worker", "--pool=threads", f"--concurrency={concurrency}", "-Q", ",".join(queues),
            f"--loglevel={args.loglevel}"]
    if args.hostname:
        argv += ["-n", args.hostname]
    return argv, models


def serve_worker(argv: list[str]) -> int:
    """Run a worker in this process until it is stopped (SIGTERM: finish running shards, then exit)."""
    args = parse_args(argv)
    try:
        settings = settings_from_args(args)
        args.worker_concurrency = settings.worker_concurrency
        celery_argv, models = worker_argv(args, settings.model_registry())
    except (LookupError, ValueError) as error:  # ConfigError is a ValueError
        print(f"bulkinfer serve worker: {error}", flush=True)
        return 2
    # The process runs on these settings (the context, leases, reaper and engines take them from
    # here); the app is built on them when it is first imported, just below.
    preload = None if args.no_preload else settings.worker_models or ",".join(models)
    configure_process(settings.model_copy(update={"worker_models": preload}))
    from bulkinfer.worker.process.celery_app import app

    app.conf.update(broker_url=settings.broker_url, result_backend=settings.broker_url)
    app.worker_main(celery_argv)
    return 0

