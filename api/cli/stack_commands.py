"""`bulkinfer up` (the embedded stack until Ctrl-C) and `bulkinfer demo` (a real job through it)."""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from bulkinfer.api.cli.stack import Stack, StackError, StackOptions, parse_model_spec
from bulkinfer.api.client import Client
from bulkinfer.jobs.demo_data import (
    INSTRUCTION,
    ORDERS,
    TEMPLATE,
    extraction_score,
    extraction_spec,
    order_jsonl,
    sample_jsonl,
)
from bulkinfer.jobs.model_presets import PRESET_NAMES
from bulkinfer.jobs.settings import ConfigError, Settings
from bulkinfer.jobs.settings_args import add_lora_flag, lora_adapters_override
from bulkinfer.jobs.state.status import JobState, JobStatus

DTYPES = ["auto", "float32", "bfloat16", "float16"]


def _stack_arguments(parser: argparse.ArgumentParser, port: int | None) -> None:
    """`port=None`: host and port default to the settings (`api_host`, `api_port`)."""
    parser.add_argument("--home", type=Path, default=Path(".bulkinfer"),
                        help="where Redis data, the job store, logs and models live (default: .bulkinfer)")
    parser.add_argument("--port", type=int, default=port, help="API port (0: any free port)")
    parser.add_argument("--host", default=None if port is None else "127.0.0.1")
    parser.add_argument("--model", action="append", dest="models", metavar="NAME[=LOCATION]", default=[],
                        help="serve this model (repeatable): a catalog name (smollm2-135m-instruct), a "
                        f"preset ({', '.join(PRESET_NAMES)}), or NAME=a folder, s3://… or FILE.gguf "
                        "(imported once); default: the config file's `models` table, else the --preset one")
    parser.add_argument("--preset", choices=PRESET_NAMES, default=None,
                        help="the random-weight checkpoint to serve, under this name (default small): built "
                        "once here, the same one `run --model small` uses")
    parser.add_argument("--models-dir", type=Path, default=None,
                        help="where preset checkpoints are built and kept (default: the checkpoint cache, "
                        "$BULKINFER_CACHE_DIR)")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="the engine's compute dtype (default: the dtype setting, else auto: bf16 on a "
                        "CPU with AMX, fp32 without AVX512-BF16, the kept verdict between; the checkpoint's "
                        "on CUDA)")


def _served_models(args: argparse.Namespace, settings: Settings | None) -> dict[str, str]:
    """--model flags, else (without --preset) the config's `models` table; {} means the preset."""
    if args.models:
        return dict(parse_model_spec(spec) for spec in args.models)
    if args.preset is None and settings is not None and settings.models:
        return {name: settings.model_registry().location(name) for name in settings.model_registry().names()}
    return {}


def up(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bulkinfer up", description="Run Redis, the API and one worker "
                                     "here, with jobs in a local directory, until Ctrl-C.")
    _stack_arguments(parser, port=None)
    parser.add_argument("--config", metavar="PATH", help="TOML config file (default: $BULKINFER_CONFIG, else "
                        "./bulkinfer.toml if present); the API and the worker `up` starts take every setting "
                        "from it but broker_url and store_uri (it runs its own Redis and store)")
    parser.add_argument("--api-keys", default=None, metavar="TENANT=KEY,...",
                        help="keys the API requires, per tenant (default: the api_keys setting; unset: open)")
    parser.add_argument("--admin-api-keys", default=None, metavar="KEY,...",
                        help="admin keys, which see every tenant's jobs (default: admin_api_keys)")
    parser.add_argument("--tensor-parallel-size", type=int, default=None, metavar="N",
                        help="devices the worker's engine spans, the model split across them (default: "
                        "the tensor_parallel_size setting, else 1)")
    add_lora_flag(parser)
    args = parser.parse_args(argv)
    try:
        settings = Settings.from_env(config=args.config, api_host=args.host, api_port=args.port,
                                     dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size,
                                     api_keys=args.api_keys,
                                     admin_api_keys=args.admin_api_keys)
        if args.lora_flags:
            settings = settings.model_copy(update={"lora_adapters": lora_adapters_override(args, settings)})
            settings = Settings.model_validate(settings.model_dump())  # the adapters checked as any setting
    except (ConfigError, ValueError) as error:
        print(f"bulkinfer up: {error}", file=sys.stderr)
        return 2
    try:
        options = StackOptions(home=args.home, host=settings.api_host, port=settings.api_port,
                               preset=args.preset or "small", models_dir=args.models_dir,
                               models=_served_models(args, settings), settings=settings)
        stack = Stack(options).start()
    except StackError as error:
        print(f"bulkinfer up: {error}", file=sys.stderr)
        return 1
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    print(f"api     {stack.url} (OpenAPI docs at {stack.url}/docs)")
    print(f"bulkinfer is up; jobs are kept in {stack.home / 'store'}. Ctrl-C to stop.", flush=True)
    problem = None
    while not stop.wait(0.5):
        problem = stack.problem()
        if problem:
            print(f"bulkinfer up: {problem}", file=sys.stderr)
            break
    print("stopping…", flush=True)
    stack.stop()
    print("stopped", flush=True)
    return 1 if problem else 0


class _Progress:
    """Prints a line whenever the row counts move."""

    def __init__(self) -> None:
        self._last: tuple[int, int, str] | None = None

    def __call__(self, status: JobStatus) -> None:
        done = status.rows.succeeded + status.rows.failed
        seen = (done, status.shards.done, status.state.value)
        if seen != self._last:
            self._last = seen
            total = status.rows.total or "?"
            print(f"  {status.state.value:<10} rows {done}/{total} done, shards {status.shards.done}/"
                  f"{status.shards.total or '?'}", flush=True)


def _print_figures(status: JobStatus, submit_to_done_s: float) -> None:
    rows, usage = status.rows, status.usage
    running_s = ((status.finished_at - status.started_at).total_seconds()
                 if status.finished_at and status.started_at else submit_to_done_s)
    print(f"\nrows: {rows.total} ({rows.succeeded} succeeded, {rows.failed} failed), "
          f"shards: {status.shards.total}")
    print(f"tokens: prompt {usage.prompt}, served from prefix cache {usage.cached} "
          f"({usage.cached / max(usage.prompt, 1):.0%}), completion {usage.completion}")
    print(f"wall time: {submit_to_done_s:.2f}s from submit to done ({running_s:.2f}s running)")
    print(f"throughput: {rows.total / running_s:.1f} rows/s, "
          f"{usage.completion / running_s:.1f} output tok/s, "
          f"{(usage.prompt + usage.completion) / running_s:.1f} total tok/s")


DEMO_MODEL = "smollm2-135m-instruct"


def demo(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="bulkinfer demo", description="Start the embedded stack and run a real job through API → "
        f"Celery → worker → object store: by default {DEMO_MODEL} (fetched once) extracts fields from "
        "short order messages under one shared instruction with a JSON schema; --preset runs the old "
        "support-ticket job on a random-weight checkpoint. Prints outputs and the job's figures.")
    _stack_arguments(parser, port=0)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=None, help="default 64 (32 with --preset)")
    parser.add_argument("--shard-size", type=int, default=16, help="rows per shard")
    parser.add_argument("--timeout", type=float, default=900, help="seconds to wait for the job")
    parser.add_argument("--offline", action="store_true",
                        help="run the engine-only demo instead (no API, Celery or store)")
    args = parser.parse_args(argv)
    if args.preset is None and not args.models:
        args.models = [DEMO_MODEL]
    args.max_tokens = args.max_tokens or (32 if args.preset else 64)
    if args.offline:
        from bulkinfer.api.cli import (
            Command,  # the engine's own demo, loaded by name like every engine command
        )

        offline = ["--rows", str(args.rows), "--max-tokens", str(args.max_tokens)]
        offline += ["--dtype", args.dtype] if args.dtype else []
        offline += ["--preset", args.preset] if args.preset else ["--model", args.models[0]]
        return Command("bulkinfer.worker.run.offline_demo:demo_cli", "the engine-only demo",
                       "worker").load()(offline)

    demo_home = args.home / "demo"
    for leftover in ("redis", "store", "logs"):  # each demo starts from an empty Redis and store
        shutil.rmtree(demo_home / leftover, ignore_errors=True)
    try:
        options = StackOptions(home=demo_home, host=args.host, port=args.port, preset=args.preset or "small",
                               models_dir=args.models_dir,
                               models=_served_models(args, None),
                               engine_options={"dtype": args.dtype} if args.dtype else {})
        print(f"bulkinfer demo: {args.rows} rows through API → Celery → worker → object store")
        started = time.perf_counter()
        with Stack(options) as stack:
            print(f"api     {stack.url}\nstack ready in {time.perf_counter() - started:.1f}s", flush=True)
            return _run_demo_job(stack, args)
    except StackError as error:
        print(f"bulkinfer demo: {error}", file=sys.stderr)
        return 1


def _run_demo_job(stack: Stack, args: argparse.Namespace) -> int:
    real_model = stack.options.model_name not in PRESET_NAMES
    if real_model:
        spec = extraction_spec(stack.options.model_name, args.shard_size, args.max_tokens)
        data = order_jsonl(args.rows)
    else:
        spec = {"model": stack.options.model_name, "id_column": "id", "template": TEMPLATE,
                "instructions": INSTRUCTION, "shard_size": args.shard_size,
                "sampling": {"temperature": 0, "max_tokens": args.max_tokens}}
        data = sample_jsonl(args.rows)
    with Client(stack.url, timeout=60) as client, tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "rows.jsonl"
        path.write_bytes(data)
        submitted = time.perf_counter()
        job = client.jobs.create(spec, file=path)
        print(f"\nsubmitted {job.job_id} (model '{spec['model']}', upload {path.stat().st_size} bytes)")
        final = client.jobs.wait(job.job_id, poll_interval=0.25, timeout=args.timeout,
                                 progress=False, on_progress=_Progress())
        submit_to_done = time.perf_counter() - submitted
        if final.state != JobState.SUCCEEDED:
            print(f"\njob {final.job_id} {final.state.value}: {final.error}", file=sys.stderr)
            return 1
        rows = list(client.jobs.results(final.job_id))
        if real_model:
            _print_extractions(rows)
        else:
            for row in rows[:3]:
                print(f"\n- {row['id']}\n  output ({row['finish_reason']}): {str(row['text'])[:120]!r}")
            print("\n(a random-weight checkpoint built locally: its text is noise, its figures are real)")
        _print_figures(final, submit_to_done)
        dtypes = client.jobs.result_parts(final.job_id).dtypes
        print(f"engine dtype: {', '.join(dtypes) or '?'} (chosen by the worker for this machine; "
              "--dtype overrides)")
        print(f"outputs: {final.output_uris[0] if final.output_uris else '-'} …")
    return 0 if final.rows.failed == 0 else 1


def _print_extractions(rows: list[dict]) -> None:
    print()
    for row in rows[: len(ORDERS)]:
        print(f"- {row['id']} {row['order']}\n  -> {row['text']}")
    right, valid = extraction_score(rows)
    print(f"\nvalid JSON in {valid}/{len(rows)} rows; "
          f"name, city and quantity all right in {right}/{len(rows)}")
