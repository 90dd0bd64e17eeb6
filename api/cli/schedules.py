"""`bulkinfer schedule create | list | get | pause | resume | delete | tick | jobs`, over the SDK.

    bulkinfer schedule create --cron '*/10 * * * *' --input-prefix 's3://bucket/incoming/*.jsonl' \\
        --model small --prompt-column q --webhook-url https://example.com/hooks/bulkinfer
    bulkinfer schedule tick sched-…      # submit new objects now

Exit codes: 0 the request succeeded, 2 usage error, the API refused, or it could not be reached.
Every command takes --api-url (default $BULKINFER_API_URL), --api-key (default $BULKINFER_API_KEY)
and --json (machine-readable output on stdout).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from bulkinfer.api.client import ApiError, Client
from bulkinfer.api.client.client import API_KEY_ENV, API_URL_ENV, resolve_base_url
from bulkinfer.jobs.scheduling.schedules import ScheduleView

EXIT_OK = 0
EXIT_ERROR = 2
ACTIONS = ("create", "list", "get", "pause", "resume", "delete", "tick", "jobs")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bulkinfer schedule", description="Scheduled ETL: one job per new "
                                     "object under an input prefix, each time a cron expression fires.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--api-url", default=None, help=f"the API (default ${API_URL_ENV})")
    common.add_argument("--api-key", default=None, help=f"sent as a Bearer token (default ${API_KEY_ENV})")
    common.add_argument("--json", action="store_true", help="print JSON on stdout, for scripts")
    actions = parser.add_subparsers(dest="action", required=True, metavar="|".join(ACTIONS))
    create = actions.add_parser("create", parents=[common], help="create a schedule")
    create.add_argument("--cron", required=True, help="5 fields in UTC (6: seconds last), e.g. '0 * * * *'")
    create.add_argument("--input-prefix", required=True, help="s3://bucket/prefix/ or a glob "
                        "(s3://bucket/in/*.jsonl); a local store path works too")
    create.add_argument("--job", default=None, metavar="JSON|@FILE",
                        help="the job template: a JobSpec without input_uri, as JSON or @path")
    create.add_argument("--model", help="job.model (overrides --job)")
    create.add_argument("--prompt-column", help="job.prompt_column (overrides --job)")
    create.add_argument("--template", help="job.template (overrides --job)")
    create.add_argument("--max-tokens", type=int, help="job.sampling.max_tokens (overrides --job)")
    create.add_argument("--name", help="a name for people")
    create.add_argument("--webhook-url", help="POSTed each job's final status, signed")
    create.add_argument("--paused", action="store_true", help="create it paused")
    actions.add_parser("list", parents=[common], help="every schedule")
    for action, text in [("get", "a schedule and its tick state"), ("pause", "stop submitting"),
                         ("resume", "submit again"), ("delete", "delete it (its jobs stay)"),
                         ("tick", "submit new objects now"), ("jobs", "the objects submitted, with jobs")]:
        actions.add_parser(action, parents=[common], help=text).add_argument("schedule_id")
    return parser


def _job_template(args: argparse.Namespace) -> dict[str, Any]:
    text = args.job or "{}"
    job = json.loads(Path(text[1:]).read_text() if text.startswith("@") else text)
    if not isinstance(job, dict):
        raise ValueError("--job must be a JSON object")
    for field in ("model", "prompt_column", "template"):
        if getattr(args, field) is not None:
            job[field] = getattr(args, field)
    if args.max_tokens is not None:
        job["sampling"] = {**job.get("sampling", {}), "max_tokens": args.max_tokens}
    return job


def _describe(view: ScheduleView) -> str:
    runtime = view.runtime
    state = "paused" if view.paused else f"next {runtime.next_tick_at:%Y-%m-%d %H:%M:%S}Z"
    line = f"{view.id}  {view.cron!r:>16}  {view.input_prefix}  {state}  jobs {runtime.jobs_submitted}"
    name = f"  ({view.name})" if view.name else ""
    error = f"\n  last error: {runtime.last_error}" if runtime.last_error else ""
    return line + name + error


def _act(client: Client, args: argparse.Namespace) -> Any:
    """The action's result as JSON-able data, printing the human form unless --json."""
    schedules = client.schedules
    if args.action == "create":
        view = schedules.create(cron=args.cron, input_prefix=args.input_prefix, job=_job_template(args),
                                name=args.name, webhook_url=args.webhook_url, paused=args.paused or None)
        return view.model_dump(mode="json"), _describe(view)
    if args.action == "list":
        views = schedules.list()
        return ([view.model_dump(mode="json") for view in views],
                "\n".join(_describe(view) for view in views) or "no schedules")
    if args.action == "delete":
        schedules.delete(args.schedule_id)
        return {"deleted": args.schedule_id}, f"deleted {args.schedule_id}"
    if args.action == "tick":
        report = schedules.tick(args.schedule_id)
        lines = [f"{item.job_id}  {item.key}" for item in report.submitted]
        lines.append(f"{len(report.submitted)} job(s) submitted" + (f"; error: {report.error}"
                                                                     if report.error else ""))
        return report.model_dump(mode="json"), "\n".join(lines)
    if args.action == "jobs":
        objects = schedules.submitted(args.schedule_id)
        return ([item.model_dump(mode="json") for item in objects],
                "\n".join(f"{item.job_id}  {item.key}  {item.etag}" for item in objects) or "none yet")
    action: Callable[[str], ScheduleView] = getattr(schedules, args.action)  # get, pause, resume
    view = action(args.schedule_id)
    return view.model_dump(mode="json"), _describe(view)


def main(argv: list[str]) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    try:
        with Client(args.api_url, api_key=args.api_key) as client:
            data, text = _act(client, args)
    except ApiError as error:
        message = f"{error.status_code}: {error.message}"
    except httpx.TransportError as error:
        message = f"cannot reach the API at {resolve_base_url(args.api_url)}: {error}"
    except (OSError, ValueError) as error:
        message = str(error)
    else:
        print(json.dumps(data, indent=2, ensure_ascii=False) if args.json else text)
        return EXIT_OK
    if args.json:
        print(json.dumps({"error": message}))
    print(f"bulkinfer schedule {args.action}: {message}", file=sys.stderr)
    return EXIT_ERROR
