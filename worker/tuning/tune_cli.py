"""`bulkinfer tune --model M [--workload FILE]`: find this machine's fastest engine settings for M.

Each trial builds a fresh engine with the candidate settings and runs the same rows through it
(all at once, as a shard's batches reach a worker), timing submit to last token;
worker/tuning/tuned_settings.py says what is searched and where the winner is written. The rows: the first
`--rows` of FILE (a job input, read and rendered exactly as a job's: the same mapping and sampling flags as
`bulkinfer run`), or without FILE a batch-job shape (one of 4 shared 300-token instructions + a 50-400-token
tail each, 128 output tokens, greedy).
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bulkinfer.cpu_isa import apply_cpu_isa_cap
from bulkinfer.engine.dtype_verdict import VERDICTS_FILE_NAME
from bulkinfer.jobs.settings import ConfigError, Settings
from bulkinfer.jobs.settings_args import add_settings_arguments, settings_from_args
from bulkinfer.worker.run.run_cli import add_job_arguments, spec_from_args
from bulkinfer.worker.tuning.tuned_settings import (
    DEFAULTS,
    Measure,
    Trial,
    TuneResult,
    machine_signature,
    search,
    tuned_path,
    write_tuned,
)

TUNE_SETTINGS = ("models", "engine_options", "dtype", "remeasure_dtype", "cpu_isa", "model_cache",
                 "s3_endpoint_url")
TUNED_KEYS = ("max_num_seqs", "max_num_batched_tokens", "kv_cache_memory")

Workload = list[tuple[list[int], Any]]  # (prompt token ids, engine SamplingParams)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bulkinfer tune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a registered name, checkpoint folder, .gguf file "
                        "or catalog name")
    parser.add_argument("--workload", metavar="FILE", help="a job input file (local or s3://) whose rows "
                        "to measure with; default: a shared-instruction batch of random tokens")
    parser.add_argument("--rows", type=int, default=128, help="rows per trial (default 128)")
    parser.add_argument("--dry-run", action="store_true", help="measure and print, write nothing")
    add_job_arguments(parser)
    add_settings_arguments(parser, TUNE_SETTINGS)
    return parser


def default_workload(tokenizer: Any, rows: int, seed: int = 0) -> Workload:
    from bulkinfer.engine import SamplingParams

    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    ordinary = [t for t in range(len(tokenizer)) if t not in special]
    instructions = [[rng.choice(ordinary) for _ in range(300)] for _ in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    return [(instructions[i % 4] + [rng.choice(ordinary) for _ in range(rng.randint(50, 400))], params)
            for i in range(rows)]


def file_workload(args: argparse.Namespace, settings: Settings, model_dir: Path, tokenizer: Any) -> Workload:
    """The first `--rows` runnable rows of FILE, rendered as a worker renders them."""
    from bulkinfer.jobs.formats.readers import read_shard_rows
    from bulkinfer.jobs.formats.rows import RowError
    from bulkinfer.jobs.object_store.factory import store_for_uri
    from bulkinfer.worker.hosts.engine_rows import engine_sampling
    from bulkinfer.worker.hosts.prompt_renderer import PromptRenderer, RowRejected
    from bulkinfer.worker.run.run_file import resolved_run_spec, whole_file_shard

    args.input = args.workload
    spec = resolved_run_spec(spec_from_args(args, model_dir.name), Path("tune.jsonl"), None, settings)
    store, key = store_for_uri(spec.input_uri, endpoint_url=settings.s3_endpoint_url)
    shard, _ = whole_file_shard(store, key, spec)
    renderer = PromptRenderer(tokenizer)
    workload: Workload = []
    for item in itertools.islice(read_shard_rows(store, key, spec, shard), args.rows):
        if isinstance(item, RowError):
            continue
        try:
            workload.append((renderer.token_ids(item), engine_sampling(item.sampling, item.response_format)))
        except RowRejected:
            continue
    if not workload:
        raise ValueError(f"{args.workload}: no runnable rows in the first {args.rows}")
    return workload


def measure_with(model_dir: Path, base: dict[str, Any], workload: Workload) -> Measure:
    """A trial: a fresh engine with `base` + the candidate options, every row at once."""
    from bulkinfer.engine import LLM

    def measure(options: dict[str, Any]) -> Trial:
        try:
            llm = LLM(model=str(model_dir), **{**base, **options})
        except (RuntimeError, ValueError, MemoryError) as error:
            return Trial(options, 0.0, 0, error=str(error))
        runner = llm.engine.runner
        started = time.perf_counter()
        outputs = llm.generate([prompt for prompt, _ in workload], [params for _, params in workload])
        wall = time.perf_counter() - started
        metrics = llm.get_metrics()
        failed = [o.error for o in outputs if o.finish_reason == "error"]
        return Trial(options, wall, sum(o.num_completion_tokens for o in outputs),
                     preemptions=metrics["num_preemptions"], kv_blocks=runner.num_kv_blocks,
                     kv_bytes=runner.num_kv_blocks * runner.kv_block_bytes,
                     error=f"{len(failed)} rows failed: {failed[0]}" if failed else None)

    return measure


def print_result(result: TuneResult, say: Callable[[str], None] = print) -> None:
    say("| max_num_seqs | max_num_batched_tokens | KV budget | wall s | output tok/s | preemptions |")
    say("| ---: | ---: | --- | ---: | ---: | ---: |")
    for t in result.trials:
        kv = f"{t.options['kv_cache_memory'] / 2**20:,.0f} MiB" if "kv_cache_memory" in t.options else (
            f"default ({t.kv_bytes / 2**20:,.0f} MiB)" if t.kv_bytes else "default")
        figures = t.error or f"{t.wall_s:.2f} | {t.output_tps:,.1f} | {t.preemptions}"
        say(f"| {t.options['max_num_seqs']} | {t.options['max_num_batched_tokens']} | {kv} | {figures} |")
    default = result.default
    gain = f" ({result.best.output_tps / default.output_tps:.2f}× the defaults {DEFAULTS})" if (
        default and default.output_tps) else ""
    say(f"best: {result.best.options}: {result.best.output_tps:,.1f} output tok/s{gain}")


def tune_cli(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prog = "bulkinfer tune"
    try:
        settings = settings_from_args(args)
        apply_cpu_isa_cap(settings.cpu_isa)  # before the engine imports torch
    except (ConfigError, ValueError, OSError) as error:
        print(f"{prog}: {error}", file=sys.stderr)
        return 2
    if args.rows < 1:
        print(f"{prog}: --rows must be at least 1", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer

    from bulkinfer.worker.run.run_file import RunError, resolve_model

    try:
        model_dir = Path(resolve_model(args.model, settings.model_registry(), settings.model_cache_dir))
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        workload = (file_workload(args, settings, model_dir, tokenizer) if args.workload
                    else default_workload(tokenizer, args.rows))
    except (RunError, ValueError, OSError) as error:
        print(f"{prog}: {error}", file=sys.stderr)
        return 2
    base = {k: v for k, v in settings.engine_options_dict().items() if k not in TUNED_KEYS}
    # dtype auto as the worker will choose it: the verdict kept beside the model cache.
    base.setdefault("dtype_verdicts", str(settings.model_cache_dir / VERDICTS_FILE_NAME))
    signature = machine_signature(str(base.get("device", "cpu")), str(base.get("dtype", "auto")))
    print(f"tuning {model_dir} on {signature}: {len(workload)} rows, "
          f"{sum(len(p) for p, _ in workload):,} prompt tokens per trial")
    try:
        result = search(measure_with(model_dir, base, workload))
    except RuntimeError as error:
        print(f"{prog}: {error}", file=sys.stderr)
        return 1
    print_result(result)
    if args.dry_run:
        return 0
    path = tuned_path(settings.model_cache_dir, model_dir)
    write_tuned(path, model_dir, signature, result, args.workload or f"default ({args.rows} rows)")
    print(f"wrote {path}: workers loading this model on this machine use these settings "
          "(explicit engine_options still win)")
    return 0


if __name__ == "__main__":
    sys.exit(tune_cli())
