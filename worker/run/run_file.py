"""`bulkinfer run FILE -o OUT --model M`: a file through the engine here, with no servers.

The job machinery does the work: a `JobSpec` holds the options, the job readers read the input
(local or `s3://`), `bulkinfer.worker.hosts.engine_rows` turns rows into engine requests, one `EngineHost`
runs them and the job writers write OUT. Rows go in batches, two in the engine at a time (so it never
drains between batches); each finished batch is made durable before the next is written
(`bulkinfer.worker.run.run_output`), so a rerun after a kill skips the rows already written and repeats none.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from bulkinfer.jobs.formats.batch_task import task_given, with_task_of_lines
from bulkinfer.jobs.formats.detect import resolve_spec
from bulkinfer.jobs.formats.readers import read_shard_rows
from bulkinfer.jobs.formats.rows import Row, RowError
from bulkinfer.jobs.lora_adapters import Adapter, AdapterRegistry
from bulkinfer.jobs.model_registry import ModelRegistry
from bulkinfer.jobs.object_store.base import ObjectStore
from bulkinfer.jobs.object_store.factory import store_for_uri
from bulkinfer.jobs.output_tokens import max_tokens_problem
from bulkinfer.jobs.planning.sharding import ShardPlan, plan_shards
from bulkinfer.jobs.settings import Settings
from bulkinfer.jobs.spec import DELIMITED_FORMATS, InputFormat, JobSpec
from bulkinfer.worker.hosts.embed_rows import EmbedRun
from bulkinfer.worker.hosts.engine_host import EngineHost
from bulkinfer.worker.hosts.engine_rows import EngineRun, job_response_format_problem
from bulkinfer.worker.hosts.model_hosts import HostedModel, ModelHosts, embedding_dimension, task_problem
from bulkinfer.worker.hosts.row_window import start_run
from bulkinfer.worker.images.fetcher import ImageFetcher
from bulkinfer.worker.images.stores import StoreOpener
from bulkinfer.worker.kv.store import kv_store_options
from bulkinfer.worker.models.model_files import ModelUnavailable, local_model_dir
from bulkinfer.worker.run.run_output import ResumableOutput, open_output
from bulkinfer.worker.run.run_progress import RunProgress

DEFAULT_BATCH_ROWS = 64
IN_FLIGHT_BATCHES = 2  # one batch's rows wait in the engine while the previous one finishes
LOCAL_MODEL = "local"  # the registry name the run's model is hosted under


class RunError(RuntimeError):
    """The run cannot start or go on (bad model, unreadable input, engine gone); says why."""


@dataclass(frozen=True)
class RunSummary:
    rows: int  # in OUT now
    skipped: int  # already done by an earlier run, not recomputed
    computed: int  # by this run
    failed: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    seconds: float  # this run's
    run_completion_tokens: int  # this run's (the token counts above add up every run)
    dtype: str = ""  # the engine's compute dtype, and why
    speculation: dict | None = None  # the engine's speculative decoding figures (None: off)
    kv_store: dict | None = None  # the prefix KV tier's counters (None: off)
    prompt_formats: tuple[str, ...] = ()  # how this run's prompts were rendered (chat_template, chatml, raw)


def resolve_model(model: str, registry: ModelRegistry, cache_dir: Path | None = None) -> str:
    """Where the model's files are: a registry name's location, else the local folder of a
    checkpoint directory, `.gguf` file (imported once) or catalog name (fetched once)."""
    if model in registry:
        return registry.location(model)
    try:
        return str(local_model_dir(model, cache_dir).resolve())
    except ModelUnavailable as error:
        served = ", ".join(registry.names()) or "none registered"
        raise RunError(f"model {model!r} is not a registered model ({served}), and {error}") from None


def fingerprint(spec: JobSpec, store: ObjectStore, key: str) -> str:
    """Same spec and same input bytes (by size and etag), same fingerprint: only then resume."""
    info = store.head(key)
    text = f"{spec.canonical_json()}\n{info.size}\n{info.etag}"
    return hashlib.sha256(text.encode()).hexdigest()


def whole_file_shard(store: ObjectStore, key: str, spec: JobSpec) -> tuple[ShardPlan, int]:
    """One shard over the whole input (so OpenAI batch duplicate ids are caught across it) and the
    planner's row count (exact for Parquet and small JSONL, else an estimate).
    """
    plan = plan_shards(store, key, spec)  # also checks a Parquet file has the columns every row needs
    rows = sum(shard.estimated_rows for shard in plan)
    if spec.input_format == InputFormat.PARQUET:
        groups = sorted({group for shard in plan for group in shard.row_groups})
        return ShardPlan(index=0, estimated_rows=rows, rows_exact=True, row_groups=groups, row_start=0,
                         row_end=rows), rows
    if spec.input_format in DELIMITED_FORMATS:  # the rows after the header
        return ShardPlan(index=0, estimated_rows=rows, rows_exact=True, byte_start=plan[0].byte_start,
                         byte_end=store.head(key).size, row_start=0, row_end=rows), rows
    return ShardPlan(index=0, estimated_rows=rows, rows_exact=False, byte_start=0,
                     byte_end=store.head(key).size), rows


def batches(items: Iterator[Row | RowError], size: int, skip: int) -> Iterator[list[Row | RowError]]:
    """The items after the first `skip`, in lists of `size`."""
    batch: list[Row | RowError] = []
    for position, item in enumerate(items):
        if position < skip:
            continue
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def run_batches(hosted: HostedModel, items: Iterable[list[Row | RowError]], output: ResumableOutput,
                progress: RunProgress, images: ImageFetcher | None = None) -> None:
    """Keep `IN_FLIGHT_BATCHES` batches in the engine; write each one, in order, as it finishes."""
    in_flight: deque[EngineRun | EmbedRun] = deque()
    try:
        for items_of_batch in items:
            in_flight.append(start_run(hosted, items_of_batch, images=images))
            while len(in_flight) >= IN_FLIGHT_BATCHES:
                _finish(in_flight.popleft(), output, progress)
        while in_flight:
            _finish(in_flight.popleft(), output, progress)
    except BaseException:  # Ctrl-C or a failure: what is written stays, the rest is dropped
        for batch in in_flight:
            batch.abort()
        raise


def _finish(batch: EngineRun | EmbedRun, output: ResumableOutput, progress: RunProgress) -> None:
    rows = batch.outputs()
    output.append(rows)
    progress.advance(rows)


def _run_tool_format(settings: Settings, spec: JobSpec) -> dict[str, str]:
    """The run's one model takes the format the settings give its name (or, with one entry, that one)."""
    formats = settings.tool_call_formats_dict()
    chosen = formats.get(spec.model) or (next(iter(formats.values())) if len(formats) == 1 else None)
    return {LOCAL_MODEL: chosen} if chosen else {}


def run_file(spec: JobSpec, output_path: Path, settings: Settings, *, model_location: str,
             batch_rows: int = DEFAULT_BATCH_ROWS, overwrite: bool = False, show_progress: bool = True,
             say: Callable[[str], None] = print) -> RunSummary:
    """Run `spec`'s input (format resolved) through the engine into `output_path`, resuming a partial
    output of the same spec and input. Raises `RunError` or `OutputConflict`.
    """
    problem = job_response_format_problem(spec) or max_tokens_problem(
        spec.sampling.max_tokens, settings.tokens_cap, "sampling.max_tokens")
    if problem is not None:  # once for the run, not once per row
        raise RunError(problem)
    store, key = store_for_uri(spec.input_uri, endpoint_url=settings.s3_endpoint_url)
    shard, estimated_rows = whole_file_shard(store, key, spec)
    output = open_output(output_path, spec, fingerprint(spec, store, key), job_id=_job_id(spec),
                         created=int(time.time()), overwrite=overwrite)
    skipped = output.progress.rows_done
    if skipped:
        say(f"resuming {output_path}: {skipped} rows already done, skipping them")
    # Every registered adapter runs on the one model of a run, whatever model it is registered on.
    adapters = AdapterRegistry(Adapter(adapter.name, adapter.location)
                               for adapter in AdapterRegistry.parse(settings.lora_adapters).all())
    hosts = ModelHosts(ModelRegistry({LOCAL_MODEL: model_location}, adapters=adapters),
                       settings.engine_options_dict(),
                       s3_endpoint_url=settings.s3_endpoint_url, cache_dir=settings.model_cache_dir,
                       kv_store_options=kv_store_options(settings, deployment=False),
                       max_tokens_cap=settings.tokens_cap, tool_call_formats=_run_tool_format(settings, spec))
    try:
        hosted = hosts.get(LOCAL_MODEL, embed=spec.is_embed)
        for _ in ("before", "after"):  # the task at once; the model's size once it is loaded
            problem = task_problem(spec, hosted)
            if problem is not None:
                raise RunError(problem)
            hosted.host.wait_ready()
        output.embedding_dimension = embedding_dimension(spec, hosted)
        choice = hosted.host.dtype_choice
        started = time.monotonic()  # rates count inference, not the model load
        # A local run reads the images its rows name wherever its user can (no tenant rules).
        images = ImageFetcher(StoreOpener(settings.s3_endpoint_url), settings.image_limits())
        total = max(estimated_rows, skipped)
        with RunProgress(total=total, done=skipped, enabled=show_progress) as progress, images:
            run_batches(hosted, batches(read_shard_rows(store, key, spec, shard), batch_rows, skipped),
                        output, progress, images)
        engine_host = None if hosted.is_embedding else cast(EngineHost, hosted.host)
        metrics = {} if engine_host is None else engine_host.call(lambda engine: engine.get_metrics())
        kv_stats = None
        if engine_host is not None and hosts.kv_store_options:
            kv_stats = engine_host.call(lambda engine: engine.kv_store_stats())
    finally:
        hosts.stop()
    output.finish()
    done = output.progress
    return RunSummary(rows=done.rows_done, skipped=skipped, computed=done.rows_done - skipped,
                      failed=done.rows_failed, prompt_tokens=done.prompt_tokens,
                      cached_tokens=done.cached_tokens, completion_tokens=done.completion_tokens,
                      seconds=time.monotonic() - started, run_completion_tokens=progress.completion_tokens,
                      dtype=f"{choice.dtype} ({choice.reason})" if choice else "",
                      speculation=metrics.get("speculative_decoding"), kv_store=kv_stats,
                      prompt_formats=tuple(sorted(progress.prompt_formats)))


def _job_id(spec: JobSpec) -> str:
    """Stands in for a job id in OpenAI batch output ids: the same for the same spec, across resumes."""
    return f"local-{spec.spec_hash()[:24]}"


def resolved_run_spec(spec: JobSpec, output_path: Path, output_format: InputFormat | None,
                  settings: Settings) -> JobSpec:
    """The spec with the input format detected, the task of OpenAI batch lines read from their urls
    when not given (`MixedTasks` for a file of both kinds), and the output format chosen:
    `output_format`, else what OUT's name says (`.parquet`; `.jsonl` is OpenAI batch for OpenAI
    batch input), else the input's format.
    """
    from bulkinfer.jobs.spec import format_from_name

    store, key = store_for_uri(spec.input_uri, endpoint_url=settings.s3_endpoint_url)
    resolved = with_task_of_lines(resolve_spec(spec, store, key), task_given(spec), store, key)
    by_name = format_from_name(output_path.name)
    openai_input = resolved.input_format == InputFormat.OPENAI_BATCH
    if output_format is None and by_name == InputFormat.JSONL and openai_input:
        by_name = InputFormat.OPENAI_BATCH
    chosen = output_format or by_name or resolved.input_format
    assert chosen is not None  # resolve_spec detected the input's format
    data = resolved.model_dump(mode="json", by_alias=True, exclude_none=True)
    data["output_format"] = InputFormat(chosen).value
    return JobSpec.model_validate(data)


def print_summary(summary: RunSummary, output_path: Path, say: Callable[[str], None] = print) -> None:
    seconds = max(summary.seconds, 1e-9)
    say(f"rows: {summary.rows} in {output_path} ({summary.computed} this run, {summary.skipped} skipped as "
        f"already done), {summary.failed} failed")
    say(f"tokens: prompt {summary.prompt_tokens}, from prefix cache {summary.cached_tokens}, "
        f"completion {summary.completion_tokens}")
    say(f"this run: {summary.seconds:.2f}s, {summary.computed / seconds:.1f} rows/s, "
        f"{summary.run_completion_tokens / seconds:.1f} output tok/s"
        + (f", dtype {summary.dtype}" if summary.dtype else ""))
    if summary.prompt_formats:
        say(f"prompts rendered as: {', '.join(summary.prompt_formats)}")
    spec = summary.speculation
    if spec is not None:
        say(f"speculative decoding ({spec['method']}): {spec['num_draft_tokens']} drafts, "
            f"{spec['acceptance_rate']:.0%} accepted, {spec['mean_accepted_length']:.2f} tokens per "
            f"verification, on in {spec['steps_on']} of {spec['steps_on'] + spec['steps_off']} steps")
    kv = summary.kv_store
    if kv is not None:
        say(f"prefix KV store: loaded {kv['hits_blocks']:.0f} blocks "
            f"({kv['loaded_bytes'] / 2**20:.1f} MiB in {kv['load_seconds']:.2f}s), "
            f"saved {kv['saved_blocks']:.0f} blocks "
            f"({kv['saved_bytes'] / 2**20:.1f} MiB), {kv['failed_loads']:.0f} failed loads, "
            f"{kv['corrupt_blocks']:.0f} corrupt blocks")

