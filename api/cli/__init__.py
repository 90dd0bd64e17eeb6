"""The `bulkinfer` command line.

Each command is a "module:function" named by string and imported only when invoked, so
`bulkinfer --help` and the client commands start fast and work on an install without torch
(`pip install bulkinfer[client]`). This package alone names the worker's and the engine's modules,
and only so, by string: the rest of `api/` never does.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    target: str  # "module:function"; the function takes argv and returns an exit code
    summary: str
    needs: str  # the extra that provides it, for a clear error when it is missing

    def load(self) -> Callable[[list[str]], int]:
        module_name, function_name = self.target.split(":")
        return getattr(importlib.import_module(module_name), function_name)


COMMANDS: dict[str, Command] = {
    "up": Command("bulkinfer.api.cli.stack_commands:up",
                  "Run Redis, the API and a worker here (data in ./.bulkinfer) "
                  "until Ctrl-C", "server"),
    "demo": Command("bulkinfer.api.cli.stack_commands:demo",
                    "Run a real job through the embedded stack and print "
                    "results (--offline: the engine alone)", "worker"),
    "make-checkpoint": Command("bulkinfer.engine.checkpoints:make_checkpoint_cli",
                               "Write a small deterministic Hugging Face checkpoint",
                               "worker"),
    "models": Command("bulkinfer.worker.models.model_commands:models_cli",
                      "Real models: `models import FILE.gguf DIR`, "
                      "`models fetch smollm2-135m-instruct`, `models list`", "worker"),
    "kv": Command("bulkinfer.worker.kv.commands:kv_cli",
                  "Prefix KV blocks workers saved to the store: `kv ls`, "
                  "`kv rm NAMESPACE|--all`", "worker"),
    "tune": Command("bulkinfer.worker.tuning.tune_cli:tune_cli",
                    "Measure engine settings for a model on this machine and "
                    "write the fastest for its workers", "worker"),
    "bench": Command("bulkinfer.benchmarks.cli:main",
                     "Benchmarks: `bench engine` | `suite` | `step` | `service` | `faults` | `spec` | "
                     "`batch-apis` | `embed` | `lora` | `kvstore` | `host`",
                     "worker"),
    "serve api": Command("bulkinfer.api.cli.serve:serve_api",
                         "Serve the HTTP API alone (BULKINFER_* settings)",
                         "server"),
    "serve worker": Command("bulkinfer.worker.process.main:serve_worker",
                            "Run a Celery worker hosting the engine (BULKINFER_* settings)", "worker"),
    "serve all": Command("bulkinfer.api.cli.serve:serve_all",
                         "Serve the API and run a worker against the configured "
                         "Redis and store (see docs/configuration.md)", "worker"),
    "run": Command("bulkinfer.worker.run.run_cli:run_cli",
                   "Run a Parquet / JSONL / OpenAI-batch / CSV file through the engine "
                   "here, no servers; resumable", "worker"),
    # Job commands over the SDK (api/cli/jobs.py; exit codes documented there and in docs/sdk-and-cli.md).
    "submit": Command("bulkinfer.api.cli.jobs:submit", "Submit a job: a local file (uploaded) or s3:// URI "
                      "(--wait: exit code = outcome)", "client"),
    "status": Command("bulkinfer.api.cli.jobs:status", "A job's state, rows, tokens and outputs", "client"),
    "list": Command("bulkinfer.api.cli.jobs:list_jobs", "Jobs, newest first", "client"),
    "cancel": Command("bulkinfer.api.cli.jobs:cancel", "Cancel a job that has not finished", "client"),
    "retry": Command("bulkinfer.api.cli.jobs:retry",
                     "Run an ended job's failed or unrun rows again as a new job "
                     "(--wait)", "client"),
    "results": Command("bulkinfer.api.cli.jobs:results",
                       "A succeeded job's rows (--partial: those finished so far): "
                       "JSON lines, or a file with -o", "client"),
    "usage": Command("bulkinfer.api.cli.jobs:usage", "Rows, tokens and engine seconds per tenant and model "
                     "(--since, --until, --tenant, --model)", "client"),
    "wait": Command("bulkinfer.api.cli.jobs:wait", "Wait for a job; exit 0 succeeded, 1 failed, 3 cancelled, "
                    "4 timed out", "client"),
    "schedule": Command("bulkinfer.api.cli.schedules:main",
                        "Scheduled ETL: schedule create|list|get|pause|resume|"
                        "delete|tick|jobs (api/cli/schedules.py)", "client"),
}


def usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: bulkinfer COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {command.summary}" for name, command in COMMANDS.items()]
    lines += ["", "Run `bulkinfer COMMAND --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in {"-h", "--help", "help"}:
        print(usage())
        return 0
    name, rest = args[0], args[1:]
    if rest and f"{name} {rest[0]}" in COMMANDS:  # two-word commands: `serve api`, `serve worker`
        name, rest = f"{name} {rest[0]}", rest[1:]
    command = COMMANDS.get(name)
    if command is None:
        print(f"bulkinfer: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    try:
        handler = command.load()
    except ModuleNotFoundError as error:
        print(f"bulkinfer {name}: needs the '{command.needs}' extra ({error}); "
              f"install it with: pip install 'bulkinfer[{command.needs}]'", file=sys.stderr)
        return 2
    return handler(rest)
