"""Command-line flags for `Settings`: every command that reads settings takes `--config` and the
flags of the settings it uses, named after the field (`broker_url` → `--broker-url`).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable
from typing import Literal, get_args, get_origin

from bulkinfer.jobs.lora_adapters import Adapter, AdapterRegistry, lora_flags_text
from bulkinfer.jobs.settings import ENVIRONMENT_NAMES, ConfigError, Settings

HELP = {
    "broker_url": "Redis URL of the broker and job state",
    "store_uri": "job store: s3://bucket/prefix or a local directory",
    "s3_endpoint_url": "S3 endpoint (MinIO, moto, …); default AWS",
    "models": "served models: JSON {name: dir or s3://…} or a path to such a file",
    "engine_options": "JSON object of EngineConfig fields for every engine",
    "speculative_config": 'speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'',
    "dtype": "compute dtype: auto (on a CPU by its flags: bf16 with AMX, fp32 without AVX512-BF16, else "
             "its kept verdict; the checkpoint's on CUDA) | float32 | bfloat16 | float16",
    "remeasure_dtype": "true: measure dtype auto's bf16-against-fp32 verdict for this CPU again (CPUs with "
                       "AVX512-BF16 but no AMX), replacing the one kept beside the model cache",
    "cpu_isa": "make every CPU-kind choice (dtype auto, native kernels, oneDNN, ATen) as on this smaller "
               "kind: avx2 | avx512 | avx512_bf16 | amx (default: the machine's own)",
    "tensor_parallel_size": "devices (ranks) each engine spans, its model split across them "
                            "(tensor parallel)",
    "batch_invariant": "true: a row's tokens and logprobs are bitwise those it gets alone, whatever shares "
                       "its steps (default: on for CPU, off on a GPU)",
    "model_cache": "where s3:// models are downloaded",
    "shard_lease_ttl_s": "shard lease TTL in seconds",
    "reaper_interval_s": "seconds between reaper ticks (re-sending steps whose worker died)",
    "retry_max_delay_s": "longest wait in seconds between retries of a step that met Redis or the store "
                         "down (1, 2, 4 ... s)",
    "max_task_attempts": "failures of one plan, shard or finalize before its job fails with the reason",
    "crash_split_after": "deliveries of a shard that killed their worker before it runs in halves "
                         "down to the row (a row that still kills it alone: worker_crashed)",
    "api_host": "address the API listens on",
    "api_port": "port the API listens on (0: any free port)",
    "worker_concurrency": "task threads per worker",
    "api_keys": "comma-separated API keys clients must send as Bearer tokens (unset: no auth)",
    "schedule_tick_s": "seconds between schedule ticks",
    "webhook_secret": "HMAC key that signs webhook deliveries",
    "webhook_max_attempts": "webhook delivery attempts",
    "webhook_retry_base_s": "first webhook retry delay in seconds (doubles)",
    "webhook_allow_http": "true: accept and call http:// webhook URLs",
    "webhook_allow_private": "true: accept and call webhooks to loopback, private and link-local addresses",
    "admin_api_keys": "comma-separated admin keys (or sha256:<hex>): they see every tenant's jobs",
    "tenant_prefixes": "JSON {tenant: [s3:// prefixes its inputs and outputs must lie under]}",
    "max_upload_bytes": "largest file a submit (or POST /v1/files) may upload (413 beyond)",
    "model_aliases": "JSON {alias: served model}: names a batch file may use for a served model",
    "tool_call_formats": "JSON {model: hermes|llama3_json|mistral}: how a model whose chat template has no "
                         "tool format writes calls",
    "image_max_bytes": "largest image a row may give, in bytes (default 20 MiB; that row's invalid_image "
                       "beyond)",
    "image_max_pixels": "most pixels (width x height) of a row's image (default 40000000)",
    "image_max_per_row": "most images one row may give (default 16)",
    "image_http_hosts": "comma-separated hosts http(s):// image URLs may name (default: none, no http "
                        "fetches)",
    "max_message_batch_bytes": "largest POST /v1/messages/batches body (default 64 MiB; 413 beyond)",
    "max_rows_per_job": "rows a job may have (the job fails at planning beyond)",
    "max_shards_per_job": "shards a job may plan into (the job fails at planning beyond)",
    "worker_models": "comma-separated models to start loading as soon as the worker is up "
                     "(serve worker: default every served model)",
    "max_schemas_per_job": "distinct response formats a job's rows may carry (row errors beyond)",
    "dedup_max_keys": "distinct rows the planner remembers to find copies across shards (0: none)",
    "shard_window_rows": "rows a shard keeps in the engine at once (read as the engine drains)",
    "max_jobs_in_flight": "queued, running or finalizing jobs per tenant (429 beyond)",
    "max_requests_per_s": "API requests per second per key (429 beyond)",
    "max_auth_failures_per_min": "wrong API keys a client address may send in a minute (then 429 until "
                                 "the minute ends)",
    "worker_metrics_port": "port of the worker's /metrics, /healthz and /readyz (0: none)",
    "log_format": "log lines as text (default) or json (one object a line)",
    "tenant_max_priority": "JSON {tenant: highest priority 0-9 it may use} (others: the default)",
    "default_tenant_max_priority": "highest priority a tenant not in tenant_max_priority may use (default 5)",
    "max_shard_size": "most rows in a shard, whatever shard_size a job asks (default 10000)",
    "max_shard_tokens": "most estimated tokens (prompt + expected output x n a row) in a shard (default "
                        "1000000)",
    "max_tokens_cap": "most tokens a row may generate (default 16384); a row without max_tokens generates "
                      "until it stops, within its model's context and this",
    "output_tokens_estimate": "tokens a row without max_tokens is expected to generate, for planning and "
                              "fair share, until the model's rows have measured it (default 256)",
    "share_prefix_cache_across_tenants": "true: one prefix cache for every tenant (default: one per tenant, "
                                         "so cached_tokens tells no tenant what another sent)",
    "lora_adapters": "LoRA adapters by name: JSON {name: folder or s3://…} (or {name: {location, model}}) "
                     "or name=location,… (--lora adds one)",
    "enable_lora": "true: engines serve LoRA adapters, also ones a job gives by location (default: "
                   "true when any is registered)",
    "max_loras": "LoRA adapters one engine step mixes (the engine's default: 1)",
    "max_lora_rank": "the highest LoRA rank served (the engine's default: 16)",
    "max_cpu_loras": "LoRA adapters kept in host memory, least recently used evicted",
    "kv_store": "prefix KV saved to the store and loaded by other workers: auto (on for a deployment "
                "whose store is S3, off for bulkinfer run) | on | off",
    "kv_store_uri": "where KV blocks live (under its kv/): s3://bucket/prefix or a directory (default: "
                    "the job store)",
    "kv_store_min_hits": "rows sharing a prefix before its KV blocks are saved (default 2)",
    "kv_store_budget_bytes": "stored KV bytes per model, least recently used deleted past it (default: "
                             "no limit)",
    "kv_store_cache_dir": "local disk cache of KV blocks (default: kv/ in the model cache)",
    "kv_store_cache_bytes": "size of that disk cache (default 10 GiB; 0: none)",
}
# The engines' LoRA settings, taken by every command that runs engines (serve worker, up, run).
LORA_SETTINGS = ("lora_adapters", "enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras")
# The prefix KV tier (worker/kv/store.py), taken by every command that runs engines.
KV_STORE_SETTINGS = ("kv_store", "kv_store_uri", "kv_store_min_hits", "kv_store_budget_bytes",
                     "kv_store_cache_dir", "kv_store_cache_bytes")
# Images in rows (jobs/image_limits.py), read where rows are read and images fetched; a worker
# applies the tenant rules of input_uri (tenant_prefixes) to every image location.
IMAGE_LIMIT_SETTINGS = ("image_max_bytes", "image_max_pixels", "image_max_per_row", "image_http_hosts")
IMAGE_SETTINGS = (*IMAGE_LIMIT_SETTINGS, "tenant_prefixes")
# The settings a worker reads: `bulkinfer serve worker`'s flags, and the worker side of `serve all`'s.
WORKER_SETTINGS = ("broker_url", "store_uri", "s3_endpoint_url", "models", "engine_options", "dtype",
                   "remeasure_dtype", "cpu_isa",
                   "speculative_config", "tensor_parallel_size", "batch_invariant",
                   "model_cache", "shard_lease_ttl_s", "reaper_interval_s", "retry_max_delay_s",
                   "max_task_attempts", "crash_split_after",
                   "max_rows_per_job", "max_shards_per_job", "max_schemas_per_job", "dedup_max_keys",
                   "shard_window_rows", "worker_concurrency", "worker_models", "schedule_tick_s",
                   "webhook_secret", "webhook_max_attempts", "webhook_retry_base_s", "webhook_allow_http",
                   "webhook_allow_private", "worker_metrics_port", "log_format",
                   "share_prefix_cache_across_tenants", "tenant_max_priority", "default_tenant_max_priority",
                   "max_shard_size", "max_shard_tokens", "max_tokens_cap", "output_tokens_estimate",
                   "tool_call_formats", *LORA_SETTINGS, *KV_STORE_SETTINGS, *IMAGE_SETTINGS)
# Flags older than the settings names; kept so existing command lines work.
ALIASES = {"api_host": ["--host"], "api_port": ["--port"], "worker_concurrency": ["--concurrency"]}


def _flag_type(field: str) -> Callable[[str], object]:
    annotation = Settings.model_fields[field].annotation
    kinds = get_args(annotation) or (annotation,)
    return next((kind for kind in (int, float) if kind in kinds), str)


def _choices(field: str) -> tuple[str, ...] | None:
    """The values of a setting typed as a Literal (e.g. `dtype`), for argparse to list and check."""
    kinds = get_args(Settings.model_fields[field].annotation)
    literal = next((kind for kind in kinds if get_origin(kind) is Literal), None)
    return get_args(literal) if literal is not None else None


def add_settings_arguments(parser: argparse.ArgumentParser, fields: Iterable[str]) -> None:
    """`--config` plus one flag per field (default None: not given, so env/file/defaults apply)."""
    group = parser.add_argument_group("settings (flags > BULKINFER_* variables > config file > defaults; "
                                      "see docs/configuration.md)")
    group.add_argument("--config", metavar="PATH",
                       help="TOML config file (default: $BULKINFER_CONFIG, else ./bulkinfer.toml if present)")
    for field in fields:
        if field not in ENVIRONMENT_NAMES:
            raise ValueError(f"not a setting: {field!r}")
        flags = [f"--{field.replace('_', '-')}", *ALIASES.get(field, [])]
        group.add_argument(*flags, dest=field, type=_flag_type(field), default=None, choices=_choices(field),
                           help=f"{HELP.get(field, field)} (${ENVIRONMENT_NAMES[field]})")
        if field == "lora_adapters":
            add_lora_flag(group)


def add_lora_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """`--lora NAME=LOCATION` (repeatable): registers one LoRA adapter, besides `lora_adapters`'."""
    parser.add_argument("--lora", action="append", dest="lora_flags", metavar="NAME=LOCATION", default=None,
                        help="register a LoRA adapter (repeatable): a PEFT folder or s3://… prefix")


def lora_adapters_override(args: argparse.Namespace, settings: Settings | None = None) -> str | None:
    """The `lora_adapters` a command line gives: `--lora-adapters`, else `settings`' (the environment
    or config file), with each `--lora NAME=LOCATION` added over them; None when it gives none."""
    flags = getattr(args, "lora_flags", None)
    base = getattr(args, "lora_adapters", None) or (settings.lora_adapters if settings is not None else None)
    if not flags:
        return getattr(args, "lora_adapters", None)
    added = json.loads(lora_flags_text(flags) or "{}")
    registered = {adapter.name: _adapter_entry(adapter) for adapter in AdapterRegistry.parse(base).all()}
    return json.dumps({**registered, **added})


def _adapter_entry(adapter: Adapter) -> str | dict[str, str]:
    if adapter.model is None:
        return adapter.location
    return {"location": adapter.location, "model": adapter.model}


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Settings for a parsed command line; raises `ConfigError` naming a bad key or value."""
    overrides = {field: getattr(args, field) for field in ENVIRONMENT_NAMES if hasattr(args, field)}
    if getattr(args, "lora_flags", None):  # --lora flags add to the adapters the environment or file gives
        try:
            overrides["lora_adapters"] = lora_adapters_override(args, Settings.from_env(config=args.config))
        except ValueError as error:  # a malformed --lora
            raise ConfigError(str(error)) from None
    return Settings.from_env(config=args.config, **overrides)
