"""The command line of `bulkinfer run` (see `bulkinfer.worker.run.run_file`): flags → a `JobSpec` and
settings."""

from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path
from typing import Any, Union, get_args, get_origin

from pydantic import ValidationError

from bulkinfer.cpu_isa import apply_cpu_isa_cap
from bulkinfer.jobs.errors import InputError
from bulkinfer.jobs.model_presets import PRESET_NAMES
from bulkinfer.jobs.sampling import JobSampling
from bulkinfer.jobs.settings import ConfigError, Settings
from bulkinfer.jobs.settings_args import (
    IMAGE_LIMIT_SETTINGS,
    KV_STORE_SETTINGS,
    LORA_SETTINGS,
    add_settings_arguments,
    settings_from_args,
)
from bulkinfer.jobs.spec import InputFormat, JobSpec, check_user_spec, validation_messages
from bulkinfer.jobs.task_args import TASK_FIELDS, add_task_arguments

RUN_SETTINGS = ("models", "engine_options", "dtype", "remeasure_dtype", "cpu_isa", "speculative_config",
                "tensor_parallel_size",
                "batch_invariant", "model_cache", "s3_endpoint_url", "max_tokens_cap", "tool_call_formats",
                *LORA_SETTINGS,
                *KV_STORE_SETTINGS,
                *IMAGE_LIMIT_SETTINGS)  # `run` reads the user's own files: no tenant rules
FORMATS = [value.value for value in InputFormat]


def _sampling_flag(group: argparse._ArgumentGroup, name: str, annotation: Any, help_text: str | None) -> None:
    """One flag per job sampling field, typed from the field (so a new field gets its flag)."""
    kinds = [kind for kind in get_args(annotation) if kind is not type(None)] or [annotation]
    kind = kinds[0]
    flag = f"--{name.replace('_', '-')}"
    common: dict[str, Any] = {"dest": f"sampling_{name}", "default": None}
    if kind is bool:  # --ignore-eos / --no-ignore-eos; neither: the job's default
        group.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_text, **common)
    elif get_origin(kind) is list:
        group.add_argument(flag, action="append", type=get_args(kind)[0], metavar=name.upper(),
                           help=f"{help_text or name} (repeatable)", **common)
    elif get_origin(kind) in (Union, types.UnionType) or kind not in (int, float, str):
        group.add_argument(flag, type=json.loads, metavar="JSON", help=f"{help_text or name} (JSON)",
                           **common)
    else:
        group.add_argument(flag, type=kind, metavar=name.upper(), help=help_text, **common)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bulkinfer run",
        description="Run a Parquet, JSONL, OpenAI-batch, CSV or TSV file through the engine here (no "
                    "servers) and write every row's output to OUT, in input order. Rerunning after an "
                    "interruption resumes: rows already written are skipped, none is written twice.")
    parser.add_argument("input", metavar="FILE", help="the input: a local path or s3://bucket/key")
    parser.add_argument("-o", "--output", required=True, type=Path, metavar="OUT", help="the output file")
    parser.add_argument("--model", help="a registered model name (BULKINFER_MODELS), a checkpoint folder, "
                        "a .gguf file (imported once), a catalog name (smollm2-135m-instruct, fetched "
                        f"once) or a preset ({', '.join(PRESET_NAMES)}: random weights, built once)")
    add_job_arguments(parser)
    parser.add_argument("--format", dest="output_format", choices=FORMATS,
                        help="output format (default: from OUT's name, else the input's)")
    parser.add_argument("--batch-size", type=int, default=64, help="rows written per batch (default 64)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT instead of resuming it")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on the terminal")
    add_settings_arguments(parser, RUN_SETTINGS)
    return parser


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that say how an input file's rows become prompts and sampling (`spec_from_args`)."""
    parser.add_argument("--spec", help="a JobSpec as JSON (or @path of a JSON file), without input_uri; "
                        "the flags below override its fields")
    mapping = parser.add_argument_group("rows → prompts (one of; none for OpenAI batch input)")
    mapping.add_argument("--prompt-column", help="the column holding each row's prompt")
    mapping.add_argument("--messages-column", help="the column holding each row's chat messages")
    mapping.add_argument("--template", help="prompt text with {column} placeholders")
    parser.add_argument("--image-column", help="with --prompt-column or --template: the column of each row's "
                        "images (bytes, a data: URL, a path or s3:// URI, or a list of those)")
    parser.add_argument("--instructions", help="shared text placed first in every prompt")
    parser.add_argument("--id-column", help="the column of row ids (default: the row number for Parquet, "
                        "CSV and TSV, the line's byte offset for JSONL, as in jobs)")
    parser.add_argument("--passthrough", action="append", dest="passthrough_columns", metavar="COLUMN",
                        help="copy this input column to the output (repeatable)")
    parser.add_argument("--input-format", choices=FORMATS, help="default: detected from the file")
    parser.add_argument("--adapter", dest="lora", metavar="NAME", help="the LoRA adapter every row runs on "
                        "(the job's lora): a name --lora registers, or the adapter's folder")
    parser.add_argument("--lora-column", help="the column naming each row's LoRA adapter (empty: --adapter, "
                        "else the base model)")
    add_task_arguments(parser)
    sampling = parser.add_argument_group("sampling (the job's defaults; rows may override them)")
    for name, field in JobSampling.model_fields.items():
        _sampling_flag(sampling, name, field.annotation, field.description)


def _spec_data(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    if text.startswith("@"):
        text = Path(text[1:]).expanduser().read_text()
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError("--spec must be a JSON object (a JobSpec without input_uri)")
    check_user_spec(data)  # the fields only the server sets, refused as a submit refuses them
    return data


def spec_from_args(args: argparse.Namespace, model_name: str) -> JobSpec:
    """The JobSpec of a command line (input format not yet detected); raises ValidationError."""
    data = _spec_data(args.spec)
    data["input_uri"] = args.input if "://" in args.input else str(Path(args.input).expanduser().resolve())
    data["model"] = model_name
    for name in ("prompt_column", "messages_column", "template", "image_column", "instructions", "id_column",
                 "passthrough_columns", "input_format", "lora", "lora_column", *TASK_FIELDS):
        if getattr(args, name) is not None:
            data[name] = getattr(args, name)
    sampling = {name: getattr(args, f"sampling_{name}") for name in JobSampling.model_fields
                if getattr(args, f"sampling_{name}") is not None}
    if sampling or "sampling" in data:
        data["sampling"] = {**data.get("sampling", {}), **sampling}
    data.pop("output_format", None)  # chosen after the input format is known (see resolved_run_spec)
    return JobSpec.model_validate(data)


def run_cli(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prog = "bulkinfer run"
    try:
        settings: Settings = settings_from_args(args)
        apply_cpu_isa_cap(settings.cpu_isa)  # before the engine imports torch
        spec_model = _spec_data(args.spec).get("model")
    except (ConfigError, ValueError, OSError) as error:
        print(f"{prog}: {error}", file=sys.stderr)
        return 2
    model = args.model or spec_model
    if not model:
        print(f"{prog}: give --model (a registered name, a checkpoint folder, a .gguf file, a catalog "
              "name or a preset)", file=sys.stderr)
        return 2
    if args.batch_size < 1:
        print(f"{prog}: --batch-size must be at least 1", file=sys.stderr)
        return 2
    # Imported here: the engine (torch) loads only once the command line is known to be good.
    from bulkinfer.worker.hosts.engine_host import EngineUnavailable
    from bulkinfer.worker.models.model_files import ModelUnavailable
    from bulkinfer.worker.run.run_file import (
        RunError,
        print_summary,
        resolve_model,
        resolved_run_spec,
        run_file,
    )
    from bulkinfer.worker.run.run_output import AlreadyComplete, OutputConflict

    try:
        location = resolve_model(model, settings.model_registry(), settings.model_cache_dir)
        # A preset keeps its name (its folder's is a cache key); a folder or file goes by its own.
        name = model if model in settings.model_registry() or model in PRESET_NAMES else Path(location).name
        output_format = InputFormat(args.output_format) if args.output_format else None
        spec = resolved_run_spec(spec_from_args(args, name), args.output, output_format, settings)
    except ValidationError as error:
        print(f"{prog}: the options do not make a valid job:\n  " + "\n  ".join(validation_messages(error)),
              file=sys.stderr)
        return 2
    except (RunError, InputError, ValueError, OSError) as error:
        print(f"{prog}: {error}", file=sys.stderr)
        return 2
    try:
        summary = run_file(spec, args.output, settings, model_location=location, batch_rows=args.batch_size,
                           overwrite=args.overwrite, show_progress=not args.no_progress)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; the rows written so far are kept: run the same command again to resume",
              file=sys.stderr)
        return 130
    except AlreadyComplete as complete:
        print(f"{args.output} is already complete: {complete.progress.rows_done} rows "
              f"({complete.progress.rows_failed} failed) from this same run; nothing to do "
              "(--overwrite runs it again)")
        return 0
    except (RunError, OutputConflict, EngineUnavailable, ModelUnavailable, InputError, OSError,
            ValueError) as error:
        print(f"{prog}: {error}", file=sys.stderr)
        return 1
    print_summary(summary, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli())
