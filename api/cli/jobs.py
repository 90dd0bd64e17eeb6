"""`bulkinfer submit | status | list | cancel | results | wait`: the job commands, over the SDK.

Exit codes, for cron and CI (`EXIT_*` below):

    0  the job succeeded (for submit without --wait, list, cancel, results: the request succeeded)
    1  the job failed
    2  usage error, the API refused the request, or the API could not be reached
    3  the job was cancelled
    4  --timeout ran out before the job finished (submit --wait, wait)
    5  the job succeeded but some rows failed, with --strict (without it, that is 0: failed rows are
       part of a succeeded job's output, each with its error)
    6  status: the job has not finished yet (queued, running or finalizing)
    7  the job expired: its completion_window passed first (its finished rows are in its results)
  130  interrupted (Ctrl-C); the job is not cancelled

Every command takes --api-url (default $BULKINFER_API_URL, else http://127.0.0.1:8000) and
--api-key (default $BULKINFER_API_KEY); --json prints machine-readable JSON on stdout. Progress goes
to stderr, and only when stderr is a terminal.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from bulkinfer.api.client import ApiError, Client, JobState, JobStatus, WaitTimeout
from bulkinfer.api.client.client import API_KEY_ENV, API_URL_ENV, resolve_base_url
from bulkinfer.api.client.inputs import is_uri
from bulkinfer.jobs.planning.estimate_report import JobEstimate
from bulkinfer.jobs.state.usage import UsageLine
from bulkinfer.jobs.task_args import TASK_FIELDS, add_task_arguments

EXIT_SUCCEEDED = 0
EXIT_FAILED = 1
EXIT_ERROR = 2
EXIT_CANCELLED = 3
EXIT_TIMEOUT = 4
EXIT_ROWS_FAILED = 5
EXIT_NOT_FINISHED = 6
EXIT_EXPIRED = 7
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports SIGINT

STRICT_HELP = "exit 5 when the job succeeded with failed rows"
EXIT_CODES_HELP = ("exit codes: 0 succeeded, 1 failed, 2 usage/API error, 3 cancelled, 4 timed out, "
                   "5 succeeded with failed rows (--strict), 6 not finished (status), 7 expired "
                   "(its completion_window passed; its finished rows are in its results)")


def exit_code(status: JobStatus, *, strict: bool = False) -> int:
    """What a job's state means to a script (see the module docstring)."""
    if status.state == JobState.SUCCEEDED:
        return EXIT_ROWS_FAILED if strict and status.rows.failed else EXIT_SUCCEEDED
    if status.state == JobState.FAILED:
        return EXIT_FAILED
    if status.state == JobState.CANCELLED:
        return EXIT_CANCELLED
    if status.state == JobState.EXPIRED:
        return EXIT_EXPIRED
    return EXIT_NOT_FINISHED


# -- arguments ------------------------------------------------------------------------------------


def _parser(command: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"bulkinfer {command}", description=description,
                                     epilog=EXIT_CODES_HELP)
    parser.add_argument("--api-url", default=None, help=f"the API (default ${API_URL_ENV}, else "
                        "http://127.0.0.1:8000)")
    parser.add_argument("--api-key", default=None, help=f"sent as a Bearer token (default ${API_KEY_ENV})")
    parser.add_argument("--json", action="store_true", help="print JSON on stdout, for scripts")
    return parser


def _wait_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--timeout", type=float, default=None, help="give up waiting after this many "
                        "seconds (exit 4); default: wait as long as it takes")
    parser.add_argument("--poll-interval", type=float, default=2.0, help="seconds between polls (default 2)")
    parser.add_argument("--strict", action="store_true", help=STRICT_HELP)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar, even on a terminal")


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace | int:
    """The arguments, or the exit code argparse chose (0 for --help, 2 for a usage error)."""
    try:
        return parser.parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)


def _client(args: argparse.Namespace) -> Client:
    return Client(args.api_url, api_key=args.api_key)


def _run(command: str, args: argparse.Namespace, body: Callable[[Client], int]) -> int:
    """Run `body` with a client; API refusals and unreachable servers become exit 2 with a message."""
    try:
        with _client(args) as client:
            return body(client)
    except ApiError as error:
        _fail(command, f"{error.status_code}: {error.message}", args)
    except httpx.TransportError as error:
        _fail(command, f"cannot reach the API at {resolve_base_url(args.api_url)}: {error}", args)
    except BrokenPipeError:
        # `bulkinfer results ID | head`: the reader had enough. Not an error; say nothing more.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_SUCCEEDED
    except (OSError, TypeError, ValueError) as error:
        _fail(command, str(error), args)
    except KeyboardInterrupt:  # a wait stopped by hand: the job itself keeps going
        print(f"bulkinfer {command}: interrupted (the job is not cancelled: bulkinfer cancel JOB_ID)",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_ERROR


def _fail(command: str, message: str, args: argparse.Namespace) -> None:
    if getattr(args, "json", False):
        print(json.dumps({"error": message}))
    print(f"bulkinfer {command}: {message}", file=sys.stderr)


# -- output ---------------------------------------------------------------------------------------


def _json(value: Any) -> None:
    print(json.dumps(value, indent=2, ensure_ascii=False))


def _status_json(status: JobStatus) -> dict[str, Any]:
    return status.model_dump(mode="json")


def _describe(status: JobStatus) -> str:
    rows = status.rows
    lines = [f"job       {status.job_id}", f"state     {status.state.value}",
             f"rows      {rows.succeeded + rows.failed}/{rows.total} done ({rows.succeeded} succeeded, "
             f"{rows.failed} failed)",
             f"shards    {status.shards.done}/{status.shards.total}",
             f"tokens    prompt {status.usage.prompt} (cached {status.usage.cached}), "
             f"completion {status.usage.completion}",
             f"created   {status.created_at.isoformat(timespec='seconds')}"]
    for label, moment in (("started", status.started_at), ("finished", status.finished_at)):
        if moment is not None:
            lines.append(f"{label:<9} {moment.isoformat(timespec='seconds')}")
    if status.output_uris:
        lines.append(f"outputs   {status.output_uris[0]}" + (f" (+{len(status.output_uris) - 1} more)"
                                                            if len(status.output_uris) > 1 else ""))
    if status.error:
        lines.append(f"error     {status.error}")
    return "\n".join(lines)


def _report(status: JobStatus, args: argparse.Namespace) -> None:
    if args.json:
        _json(_status_json(status))
    else:
        print(_describe(status))


def _report_started(client: Client, job: JobStatus, args: argparse.Namespace, started: str) -> int:
    """A job just created: say so (`started` names it), then with --wait wait and report its end."""
    if not args.wait:
        if args.json:
            _json(_status_json(job))
        else:
            print(f"{started} ({job.state.value})")
        return EXIT_SUCCEEDED
    if not args.json:
        print(f"{started}; waiting", file=sys.stderr)
    return _wait_and_report(client, job.job_id, args)


def _wait_and_report(client: Client, job_id: str, args: argparse.Namespace) -> int:
    try:
        final = client.jobs.wait(job_id, poll_interval=args.poll_interval, timeout=args.timeout,
                                 progress=not args.no_progress)
    except WaitTimeout as timeout:
        if args.json:
            _json({**_status_json(timeout.status), "timed_out": True})
        print(f"bulkinfer: {timeout}", file=sys.stderr)
        return EXIT_TIMEOUT
    _report(final, args)
    return exit_code(final, strict=args.strict)


# -- commands -------------------------------------------------------------------------------------


def submit(argv: list[str]) -> int:
    parser = _parser("submit", "Submit a job: a local file (uploaded) or an s3:// URI.")
    parser.add_argument("input", metavar="FILE|s3://…", help="the rows: Parquet, JSONL, OpenAI-batch JSONL, "
                        "CSV or TSV (a header row naming the columns)")
    parser.add_argument("--model", required=True, help="a model the deployment serves")
    mapping = parser.add_mutually_exclusive_group()
    mapping.add_argument("--prompt-column", help="the column holding each row's prompt")
    mapping.add_argument("--template", help="a prompt template with {column} placeholders")
    mapping.add_argument("--messages-column", help="the column holding each row's chat messages")
    parser.add_argument("--image-column", help="with --prompt-column or --template: the column holding each "
                        "row's images (bytes, a data: URL, an s3:// or store path, or a list of those); rows "
                        "with images run as chat")
    parser.add_argument("--instructions", help="shared text placed first in every prompt")
    parser.add_argument("--id-column", help="the column holding row ids (default: the row's index)")
    parser.add_argument("--lora", help="the LoRA adapter every row runs on: a name registered on the model "
                        "(GET /models lists them) or the adapter's s3:// folder")
    parser.add_argument("--lora-column", help="the column naming each row's LoRA adapter (empty: --lora, "
                        "else the base model)")
    add_task_arguments(parser)
    parser.add_argument("--max-tokens", type=int, help="sampling.max_tokens")
    parser.add_argument("--temperature", type=float, help="sampling.temperature")
    parser.add_argument("--sampling", type=json_argument, default=None, help="sampling as a JSON object "
                        "or @file.json (--max-tokens/--temperature override its fields)")
    output_shape = parser.add_mutually_exclusive_group()
    output_shape.add_argument("--json-schema", type=json_argument, metavar="SCHEMA", help="constrain every "
                              "output to this JSON schema (JSON or @schema.json); outputs are written parsed")
    output_shape.add_argument("--json-object", action="store_true",
                              help="constrain every output to a JSON object")
    parser.add_argument("--webhook-url", help="POSTed the job's final status, signed, when it ends")
    parser.add_argument("--output", dest="output_uri", help="where output parts go (s3://bucket/prefix/)")
    parser.add_argument("--output-format", choices=["parquet", "jsonl", "openai_batch", "csv", "tsv"],
                        help="default: the input's format")
    parser.add_argument("--shard-size", type=int, help="rows per shard")
    parser.add_argument("--priority", type=_priority, help="high, normal, low or 0-9 (higher runs sooner)")
    parser.add_argument("--completion-window", default=None, metavar="WINDOW",
                        help="how long the job may take ('24h', '90m' or seconds); rows not done by then "
                             "end expired")
    parser.add_argument("--metadata", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--idempotency-key", help="submitting again with the same key and spec returns "
                        "the same job (and makes the submit safe to retry)")
    parser.add_argument("--spec", type=json_argument, default=None, metavar="JSON",
                        help="more JobSpec fields as a JSON object or @spec.json (the options above win)")
    parser.add_argument("--wait", action="store_true", help="wait for the job; the exit code is its outcome")
    parser.add_argument("--dry-run", action="store_true",
                        help="check everything, print an estimate (rows, tokens, run time); create nothing")
    _wait_options(parser)
    args = _parse(parser, argv)
    if isinstance(args, int):
        return args
    try:
        spec = _spec_from(args)
    except ValueError as error:
        parser.print_usage(sys.stderr)
        print(f"bulkinfer submit: {error}", file=sys.stderr)
        return EXIT_ERROR

    def body(client: Client) -> int:
        source = args.input if is_uri(args.input) else _local_file(args.input)
        if args.dry_run:
            _print_estimate(client.jobs.estimate(spec, input=source), args)
            return EXIT_SUCCEEDED
        job = client.jobs.create(spec, input=source)
        return _report_started(client, job, args, f"submitted {job.job_id}")

    return _run("submit", args, body)


def _print_estimate(estimate: JobEstimate, args: argparse.Namespace) -> None:
    if args.json:
        _json(estimate.model_dump(mode="json"))
        return

    def tokens(value: int | None) -> str:
        return "unknown (no tokenizer published yet)" if value is None else f"{value:,}"

    read = "" if estimate.rows_read == estimate.rows else f" (about; {estimate.rows_read:,} read)"
    seconds = estimate.estimated_seconds
    run_time = "unknown" if seconds is None else f"about {seconds:,.0f} s"
    print(f"dry run: nothing was created\n"
          f"  rows              {estimate.rows:,}{read} in {estimate.shards} shard(s); "
          f"{estimate.rows_failing:,} would fail, {estimate.rows_deduplicated:,} deduplicated\n"
          f"  prompt tokens     {tokens(estimate.prompt_tokens)}, of them in shared prefixes "
          f"{tokens(estimate.shared_prefix_tokens)}\n"
          f"  output tokens     about {estimate.expected_output_tokens:,}, at most "
          f"{estimate.max_output_tokens:,}\n"
          f"  run time          {run_time} ({estimate.estimate_basis})")
    for problem in estimate.problems:
        print(f"  would fail: {problem}")


def json_argument(text: str) -> Any:
    """A JSON value given inline, or as @path to a file holding it."""
    if text.startswith("@"):
        try:
            text = Path(text[1:]).read_text()
        except OSError as error:
            raise argparse.ArgumentTypeError(f"cannot read {text[1:]}: {error.strerror}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error.msg} (line {error.lineno})") from None


def _local_file(path: str) -> str:
    if not os.path.isfile(path):
        raise ValueError(f"{path!r} is not a file (an object in S3 is s3://bucket/key)")
    return path


def _priority(text: str) -> int | str:
    return int(text) if text.isdigit() else text


def _spec_from(args: argparse.Namespace) -> dict[str, Any]:
    if not isinstance(args.spec or {}, dict) or not isinstance(args.sampling or {}, dict):
        raise ValueError("--spec and --sampling must be JSON objects")
    spec: dict[str, Any] = dict(args.spec or {})
    sampling = dict(spec.get("sampling") or {}) | dict(args.sampling or {})
    if args.max_tokens is not None:
        sampling["max_tokens"] = args.max_tokens
    if args.temperature is not None:
        sampling["temperature"] = args.temperature
    if sampling:
        spec["sampling"] = sampling
    if args.json_schema is not None:
        if not isinstance(args.json_schema, dict):
            raise ValueError("--json-schema must be a JSON object (a JSON schema)")
        spec["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "output", "schema": args.json_schema}}
    elif args.json_object:
        spec["response_format"] = {"type": "json_object"}
    for field in ("model", "prompt_column", "template", "messages_column", "image_column", "instructions",
                  "id_column", "lora", "lora_column", "output_uri", "output_format", "shard_size", "priority",
                  "idempotency_key", "webhook_url", "completion_window", *TASK_FIELDS):
        value = getattr(args, field)
        if value is not None:
            spec[field] = value
    metadata = dict(spec.get("metadata") or {})
    for pair in args.metadata:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"--metadata {pair!r}: expected KEY=VALUE")
        metadata[key] = value
    if metadata:
        spec["metadata"] = metadata
    return spec


def status(argv: list[str]) -> int:
    parser = _parser("status", "A job's state, rows, tokens and outputs. Exit code: the job's outcome "
                     "(6 while it has not finished).")
    parser.add_argument("job_id")
    parser.add_argument("--strict", action="store_true", help=STRICT_HELP)
    args = _parse(parser, argv)
    if isinstance(args, int):
        return args

    def body(client: Client) -> int:
        current = client.jobs.get(args.job_id)
        _report(current, args)
        return exit_code(current, strict=args.strict)

    return _run("status", args, body)


def list_jobs(argv: list[str]) -> int:
    parser = _parser("list", "Jobs, newest first.")
    parser.add_argument("--status", choices=[state.value for state in JobState],
                        help="only jobs in this state")
    parser.add_argument("--limit", type=int, default=20, help="at most this many jobs (default 20)")
    parser.add_argument("--all", action="store_true", help="every job, following every page")
    args = _parse(parser, argv)
    if isinstance(args, int):
        return args

    def body(client: Client) -> int:
        jobs = client.jobs.list(status=args.status, limit=None if args.all else args.limit)
        if args.json:
            _json([_status_json(job) for job in jobs])
            return EXIT_SUCCEEDED
        print(f"{'JOB':<36}  {'STATE':<10}  {'ROWS DONE':>13}  {'FAILED':>6}  CREATED")
        for job in jobs:
            done = f"{job.rows.succeeded + job.rows.failed}/{job.rows.total}"
            print(f"{job.job_id:<36}  {job.state.value:<10}  {done:>13}  {job.rows.failed:>6}  "
                  f"{job.created_at.isoformat(timespec='seconds')}")
        return EXIT_SUCCEEDED

    return _run("list", args, body)


def cancel(argv: list[str]) -> int:
    parser = _parser("cancel", "Cancel a job that has not finished (exit 2 if it already has).")
    parser.add_argument("job_id")
    args = _parse(parser, argv)
    if isinstance(args, int):
        return args

    def body(client: Client) -> int:
        _report(client.jobs.cancel(args.job_id), args)
        return EXIT_SUCCEEDED

    return _run("cancel", args, body)


def retry(argv: list[str]) -> int:
    parser = _parser("retry", "A new job over the rows of an ended job that failed, expired or never ran "
                              "(same spec); `results --merged` then gives one row per input row.")
    parser.add_argument("job_id")
    parser.add_argument("--error-code", action="append", dest="error_codes", default=None, metavar="CODE",
                        help="only rows that failed with CODE (repeatable; not_run: rows that never ran)")
    parser.add_argument("--wait", action="store_true",
                        help="wait for the retry; the exit code is its outcome")
    _wait_options(parser)
    args = _parse(parser, argv)
    if isinstance(args, int):
        return args

    def body(client: Client) -> int:
        job = client.jobs.retry(args.job_id, error_codes=args.error_codes)
        return _report_started(client, job, args,
                               f"retrying {job.rows.total} rows of {args.job_id} as {job.job_id}")

    return _run("retry", args, body)


def results(argv: list[str]) -> int:
    parser = _parser("results", "A succeeded job's rows (with --partial, those finished so far; with "
                                "--merged, across its retries): JSON lines on stdout, or a file with -o.")
    parser.add_argument("job_id")
    parser.add_argument("--partial", action="store_true",
                        help="also for a running, failed or cancelled job: the rows of the shards finished "
                             "so far (stderr says how many)")
    parser.add_argument("--merged", action="store_true",
                        help="one row per input row across this job and the jobs it retried: the latest "
                             "success, else the latest error")
    parser.add_argument("-o", "--output", default=None, metavar="PATH",
                        help="write to PATH: Parquet for .parquet, JSON lines for .jsonl, CSV for .csv, "
                             "TSV for .tsv, else the job's output format")
    args = _parse(parser, argv)
    if isinstance(args, int):
        return args

    def body(client: Client) -> int:
        if args.merged:
            return _merged_results(client, args)
        rows = client.jobs.results(args.job_id, partial=args.partial)
        if rows.partial:  # on stderr, so the rows on stdout stay clean
            info = rows.info
            print(f"partial: job {args.job_id} is {info.state}; {info.shards_done} of {info.shards_total} "
                  f"shards, {info.rows.total} rows so far", file=sys.stderr)
        if args.output is None:
            out = sys.stdout
            for row in rows:
                out.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
            out.flush()
            return EXIT_SUCCEEDED
        path = rows.download(args.output)
        if args.json:
            _json({"job_id": args.job_id, "path": str(path), "rows": rows.info.rows.total,
                   "output_format": rows.output_format})
        else:
            print(f"wrote {rows.info.rows.total} rows of {args.job_id} to {path}")
        return EXIT_SUCCEEDED

    return _run("results", args, body)


def _merged_results(client: Client, args: argparse.Namespace) -> int:
    if args.partial:
        raise ValueError("--merged already takes whatever each job of the chain has finished; omit --partial")
    merged = client.jobs.results(args.job_id, merged=True)
    if args.output is None:
        count = 0
        for row in merged:
            sys.stdout.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
            count += 1
        sys.stdout.flush()
    else:
        path = merged.download(args.output)
        count = None
    where = "" if args.output is None else f" to {args.output}"
    missing = merged.missing_shards
    note = f"; {missing} shard(s) no job has finished are missing" if missing else ""
    if args.json and args.output is not None:
        _json({"job_id": args.job_id, "path": str(path), "chain": merged.chain,
               "missing_shards": merged.missing_shards})
    else:
        rows = "" if count is None else f"{count} rows "
        print(f"merged {rows}of {' → '.join(merged.chain or [])}{where}{note}", file=sys.stderr)
    return EXIT_SUCCEEDED


def usage(argv: list[str]) -> int:
    parser = _parser("usage", "Rows, tokens and engine seconds per tenant and model over a time range "
                              "(by the hour; default: the last 30 days).")
    parser.add_argument("--since", type=_when, default=None, help="ISO date or time (UTC unless it says)")
    parser.add_argument("--until", type=_when, default=None, help="ISO date or time; default: now")
    parser.add_argument("--tenant", default=None,
                        help="one tenant (an admin key; a tenant's key sees its own)")
    parser.add_argument("--model", default=None, help="one model")
    args = _parse(parser, argv)
    if isinstance(args, int):
        return args

    def body(client: Client) -> int:
        report = client.usage(since=args.since, until=args.until, tenant=args.tenant, model=args.model)
        if args.json:
            _json(report.model_dump(mode="json"))
            return EXIT_SUCCEEDED
        print(f"usage {report.since:%Y-%m-%d %H:%M} → {report.until:%Y-%m-%d %H:%M} UTC")
        header = ("tenant", "model", "shards", "rows", "failed", "dedup", "prompt", "cached", "completion",
                  "engine s")
        table = [header] + [_usage_cells(line) for line in [*report.lines, report.total]]
        widths = [max(len(row[column]) for row in table) for column in range(len(header))]
        for number, row in enumerate(table):
            if number == len(table) - 1:
                print("  ".join("-" * width for width in widths))
            print("  ".join(cell.ljust(width) if column < 2 else cell.rjust(width)
                            for column, (cell, width) in enumerate(zip(row, widths, strict=True))))
        return EXIT_SUCCEEDED

    return _run("usage", args, body)


def _when(text: str) -> datetime:
    value = datetime.fromisoformat(text)
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def _usage_cells(line: UsageLine) -> tuple[str, ...]:
    usage_ = line.usage
    return (line.tenant or "-", line.model, str(line.shards), f"{line.rows:,}", f"{line.rows_failed:,}",
            f"{line.rows_deduplicated:,}", f"{usage_.prompt:,}", f"{usage_.cached:,}",
            f"{usage_.completion:,}", f"{usage_.engine_seconds:,.1f}")


def wait(argv: list[str]) -> int:
    parser = _parser("wait", "Wait for a job to finish; the exit code is its outcome.")
    parser.add_argument("job_id")
    _wait_options(parser)
    args = _parse(parser, argv)
    if isinstance(args, int):
        return args
    return _run("wait", args, lambda client: _wait_and_report(client, args.job_id, args))
