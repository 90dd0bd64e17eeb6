"""Deployment settings shared by the API, the workers and the CLI: flags > environment > config
file > defaults.

Every setting has one name: the field below, its file key (the same), its variable
(`BULKINFER_<NAME>`) and, where a command takes it, its flag (`--name-with-dashes`). The config
file is TOML: `--config PATH`, else `$BULKINFER_CONFIG`, else `./bulkinfer.toml` when present. The
full list with defaults and meanings is docs/configuration.md. Plain pydantic, no extra dependency.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from bulkinfer.jobs.deadlines import DEFAULT_MAX_WINDOW, window_seconds
from bulkinfer.jobs.image_limits import (
    DEFAULT_IMAGE_MAX_BYTES,
    DEFAULT_IMAGE_MAX_PIXELS,
    DEFAULT_IMAGES_PER_ROW,
    ImageLimits,
    parse_http_hosts,
)
from bulkinfer.jobs.layout import KV_STORE_AREA
from bulkinfer.jobs.object_store.base import ObjectStore
from bulkinfer.jobs.output_tokens import DEFAULT_MAX_TOKENS_CAP, DEFAULT_OUTPUT_TOKENS_ESTIMATE
from bulkinfer.jobs.priority_caps import (
    DEFAULT_TENANT_MAX_PRIORITY,
    effective_priority,
    parse_tenant_max_priority,
    priority_problem,
)
from bulkinfer.jobs.tenant_prefixes import tenant_prefixes

if TYPE_CHECKING:
    import redis

    from bulkinfer.jobs.model_registry import ModelRegistry
    from bulkinfer.jobs.spec import JobSpec
    from bulkinfer.jobs.state.repository import JobRepository

DEFAULT_BROKER_URL = "redis://127.0.0.1:6379/0"
DEFAULT_STORE_URI = "./.bulkinfer/store"
DEFAULT_SHARD_LEASE_TTL_S = 30.0
DEFAULT_REAPER_INTERVAL_S = 15.0
DEFAULT_RETRY_MAX_DELAY_S = 60.0
DEFAULT_CRASH_SPLIT_AFTER = 2
DEFAULT_MAX_SHARD_SIZE = 10_000
DEFAULT_MAX_SHARD_TOKENS = 1_000_000
DEFAULT_MODEL_CACHE = Path.home() / ".cache" / "bulkinfer" / "models"
DEFAULT_KV_STORE_MIN_HITS = 2
DEFAULT_KV_STORE_CACHE_BYTES = 10 << 30
CONFIG_ENV = "BULKINFER_CONFIG"
DEFAULT_CONFIG_FILE = "bulkinfer.toml"
# field name → environment variable (the file key is the field name)
ENVIRONMENT_NAMES = {
    "broker_url": "BULKINFER_BROKER_URL",
    "store_uri": "BULKINFER_STORE_URI",
    "s3_endpoint_url": "BULKINFER_S3_ENDPOINT_URL",
    "models": "BULKINFER_MODELS",
    "engine_options": "BULKINFER_ENGINE_OPTIONS",
    "dtype": "BULKINFER_DTYPE",
    "remeasure_dtype": "BULKINFER_REMEASURE_DTYPE",
    "cpu_isa": "BULKINFER_CPU_ISA",
    "speculative_config": "BULKINFER_SPECULATIVE_CONFIG",
    "tensor_parallel_size": "BULKINFER_TENSOR_PARALLEL_SIZE",
    "batch_invariant": "BULKINFER_BATCH_INVARIANT",
    "model_cache": "BULKINFER_MODEL_CACHE",
    "shard_lease_ttl_s": "BULKINFER_SHARD_LEASE_TTL_S",
    "reaper_interval_s": "BULKINFER_REAPER_INTERVAL_S",
    "retry_max_delay_s": "BULKINFER_RETRY_MAX_DELAY_S",
    "max_task_attempts": "BULKINFER_MAX_TASK_ATTEMPTS",
    "crash_split_after": "BULKINFER_CRASH_SPLIT_AFTER",
    "api_host": "BULKINFER_API_HOST",
    "api_port": "BULKINFER_API_PORT",
    "worker_concurrency": "BULKINFER_WORKER_CONCURRENCY",
    "worker_models": "BULKINFER_WORKER_MODELS",
    "worker_metrics_port": "BULKINFER_WORKER_METRICS_PORT",
    "log_format": "BULKINFER_LOG_FORMAT",
    "api_keys": "BULKINFER_API_KEYS",
    "admin_api_keys": "BULKINFER_ADMIN_API_KEYS",
    "tenant_prefixes": "BULKINFER_TENANT_PREFIXES",
    "max_upload_bytes": "BULKINFER_MAX_UPLOAD_BYTES",
    "model_aliases": "BULKINFER_MODEL_ALIASES",
    "max_message_batch_bytes": "BULKINFER_MAX_MESSAGE_BATCH_BYTES",
    "max_rows_per_job": "BULKINFER_MAX_ROWS_PER_JOB",
    "max_shards_per_job": "BULKINFER_MAX_SHARDS_PER_JOB",
    "max_schemas_per_job": "BULKINFER_MAX_SCHEMAS_PER_JOB",
    "dedup_max_keys": "BULKINFER_DEDUP_MAX_KEYS",
    "shard_window_rows": "BULKINFER_SHARD_WINDOW_ROWS",
    "max_jobs_in_flight": "BULKINFER_MAX_JOBS_IN_FLIGHT",
    "max_completion_window": "BULKINFER_MAX_COMPLETION_WINDOW",
    "max_requests_per_s": "BULKINFER_MAX_REQUESTS_PER_S",
    "max_auth_failures_per_min": "BULKINFER_MAX_AUTH_FAILURES_PER_MIN",
    # Schedules and webhooks (docs/schedules-and-webhooks.md).
    "schedule_tick_s": "BULKINFER_SCHEDULE_TICK_S",
    "webhook_secret": "BULKINFER_WEBHOOK_SECRET",
    "webhook_max_attempts": "BULKINFER_WEBHOOK_MAX_ATTEMPTS",
    "webhook_retry_base_s": "BULKINFER_WEBHOOK_RETRY_BASE_S",
    "webhook_allow_http": "BULKINFER_WEBHOOK_ALLOW_HTTP",
    "webhook_allow_private": "BULKINFER_WEBHOOK_ALLOW_PRIVATE",
    "share_prefix_cache_across_tenants": "BULKINFER_SHARE_PREFIX_CACHE_ACROSS_TENANTS",
    # Fair use between tenants (jobs/priority_caps.py, jobs/planning/shard_cost.py).
    "tenant_max_priority": "BULKINFER_TENANT_MAX_PRIORITY",
    "default_tenant_max_priority": "BULKINFER_DEFAULT_TENANT_MAX_PRIORITY",
    "max_shard_size": "BULKINFER_MAX_SHARD_SIZE",
    "max_shard_tokens": "BULKINFER_MAX_SHARD_TOKENS",
    # Output lengths (jobs/output_tokens.py): the most a row may generate, and what planning expects.
    "max_tokens_cap": "BULKINFER_MAX_TOKENS_CAP",
    "output_tokens_estimate": "BULKINFER_OUTPUT_TOKENS_ESTIMATE",
    # LoRA adapters (jobs/lora_adapters.py) and the engines' LoRA limits (vLLM's names).
    "lora_adapters": "BULKINFER_LORA_ADAPTERS",
    # Tool-call formats for models whose chat template has none (worker/tools/formats.py).
    "tool_call_formats": "BULKINFER_TOOL_CALL_FORMATS",
    # Images in rows (jobs/image_limits.py, worker/images/).
    "image_max_bytes": "BULKINFER_IMAGE_MAX_BYTES",
    "image_max_pixels": "BULKINFER_IMAGE_MAX_PIXELS",
    "image_max_per_row": "BULKINFER_IMAGE_MAX_PER_ROW",
    "image_http_hosts": "BULKINFER_IMAGE_HTTP_HOSTS",
    "enable_lora": "BULKINFER_ENABLE_LORA",
    "max_loras": "BULKINFER_MAX_LORAS",
    "max_lora_rank": "BULKINFER_MAX_LORA_RANK",
    "max_cpu_loras": "BULKINFER_MAX_CPU_LORAS",
    # Prefix KV saved to the object store and loaded back by other workers (worker/kv/store.py).
    "kv_store": "BULKINFER_KV_STORE",
    "kv_store_uri": "BULKINFER_KV_STORE_URI",
    "kv_store_min_hits": "BULKINFER_KV_STORE_MIN_HITS",
    "kv_store_budget_bytes": "BULKINFER_KV_STORE_BUDGET_BYTES",
    "kv_store_cache_dir": "BULKINFER_KV_STORE_CACHE_DIR",
    "kv_store_cache_bytes": "BULKINFER_KV_STORE_CACHE_BYTES",
}


class ConfigError(ValueError):
    """A setting is unknown or invalid; the message names it and where it came from."""


class Settings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    broker_url: str = DEFAULT_BROKER_URL
    store_uri: str = DEFAULT_STORE_URI
    s3_endpoint_url: str | None = None
    models: str | None = None  # JSON {"name": "dir or s3://…"}, or a path to such a file
    # Worker side. None: the reading module's own default (see docs/configuration.md).
    engine_options: str | None = None  # JSON object of EngineConfig fields
    # The engines' compute dtype (over engine_options' `dtype`); None: "auto", chosen per machine.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = None
    # true: `auto` on a CPU whose flags do not settle it measures its bf16 verdict again, replacing
    # the one kept beside the model cache (engine/dtype_verdict.py); over engine_options' own.
    remeasure_dtype: bool | None = None
    # Make every CPU-kind choice as on this smaller kind (bulkinfer/cpu_isa.py); None: the machine's.
    cpu_isa: Literal["avx2", "avx512", "avx512_bf16", "amx"] | None = None
    # JSON object: the engines' speculative decoding (vLLM's keys, engine/speculative/config.py),
    # over engine_options' own `speculative_config`; None: as engine_options say (default off).
    speculative_config: str | None = None
    # Ranks (devices) each engine spans (tensor parallel), over engine_options' own; None: as
    # engine_options say (default 1).
    tensor_parallel_size: int | None = Field(None, ge=1)
    # A row's output bitwise independent of the rows sharing its steps (engine/config.py). None: the
    # engine's default (on for CPU, off on a GPU); over engine_options' own.
    batch_invariant: bool | None = None
    model_cache: str | None = None
    shard_lease_ttl_s: float | None = Field(None, gt=0)
    reaper_interval_s: float | None = Field(None, gt=0)
    # The longest wait between retries of a step that met Redis or the store down (1, 2, 4 … s).
    retry_max_delay_s: float | None = Field(None, gt=0)
    # Failures (other than Redis or the store being down) of one plan, shard or finalize before its
    # job fails with the reason; None: 3 (worker/shards/task_attempts.py).
    max_task_attempts: int | None = Field(None, ge=1)
    # Deliveries of a shard that killed their worker process (SIGKILL, out of memory, a native
    # crash) before the shard is split in halves down to the row (worker/shards/shard_crashes.py); None: 2.
    crash_split_after: int | None = Field(None, ge=1)
    # Servers: what `serve api|all` and `up` listen on, and `serve worker|all`'s task threads.
    api_host: str = "127.0.0.1"
    api_port: int = Field(8000, ge=0, le=65535)
    worker_concurrency: int = Field(2, ge=1)
    worker_models: str | None = None  # comma-separated models a worker loads at start (serve worker sets it)
    # A worker's own HTTP endpoint (worker/process/status_server.py): /metrics, /healthz, /readyz; 0: none.
    worker_metrics_port: int = Field(9400, ge=0, le=65535)
    # Log lines: "text" (the default, for a terminal) or "json" (one object a line, for collectors).
    log_format: Literal["text", "json"] = "text"
    # Keys the API accepts as `Authorization: Bearer <key>`: comma-separated `tenant=key` (a key may be
    # `sha256:<hex>`; a bare key is the tenant "default"); unset: no auth (api/auth.py).
    api_keys: str | None = None
    admin_api_keys: str | None = None  # keys that see every tenant's jobs and schedules
    # JSON {tenant: [prefixes its input_uri, output_uri, input_prefix must lie under]} (api/storage_rules.py)
    tenant_prefixes: str | None = None
    # Limits (docs/configuration.md); None: no limit. Uploads and request rates answer 413 / 429 at
    # the API; rows and shards fail the job at planning, naming the limit. An upload streams to the
    # store (never held in memory); its limit bounds the store's disk, and a bigger input is named by
    # input_uri (1 GiB: past OpenAI's 512 MB per file).
    max_upload_bytes: int = Field(1 << 30, ge=1)
    # Other names for served models (JSON {alias: served name}): a batch file written for OpenAI or
    # Anthropic names their models, and runs unchanged when the name is an alias of one served here.
    model_aliases: str | None = None
    # The largest POST /v1/messages/batches body (its requests are inline; Anthropic takes 256 MB).
    max_message_batch_bytes: int = Field(64 << 20, ge=1 << 20)
    max_rows_per_job: int | None = Field(None, ge=1)
    max_shards_per_job: int | None = Field(None, ge=1)
    # Distinct response formats a job's rows may carry (worker/shards/schema_limit.py): bounds its compile
    # time.
    max_schemas_per_job: int = Field(256, ge=1)
    # Memory bounds: distinct rows the planner remembers to find copies across shards
    # (jobs/planning/job_dedup.py), and rows a shard keeps in the engine at once (worker/hosts/row_window.py).
    dedup_max_keys: int = Field(1_000_000, ge=0)
    shard_window_rows: int = Field(1024, ge=1)
    max_jobs_in_flight: int | None = Field(None, ge=1)  # per tenant: queued, running or finalizing
    # The longest completion_window a job may ask ('7d', '24h' or seconds); a longer one answers 422.
    max_completion_window: str = DEFAULT_MAX_WINDOW
    max_requests_per_s: int | None = Field(None, ge=1)  # per API key (per tenant on an open API)
    # Wrong API keys one client address may send in a minute before it waits (api/auth_failures.py).
    max_auth_failures_per_min: int = Field(30, ge=1)
    # Schedules and webhooks (docs/schedules-and-webhooks.md); None: that module's default.
    schedule_tick_s: float | None = Field(None, gt=0)
    webhook_secret: str | None = None  # HMAC key of X-Bulkinfer-Signature; unset: unsigned
    webhook_max_attempts: int | None = Field(None, ge=1)
    webhook_retry_base_s: float | None = Field(None, gt=0)
    # Where webhooks may go: https only, and only to public addresses, unless these allow more.
    webhook_allow_http: bool = False
    webhook_allow_private: bool = False
    # Off: each tenant's rows hit only its own prefix-cache blocks (their cached_tokens would tell
    # one tenant which prompts another sent). On: one cache for all, for tenants that trust each other.
    share_prefix_cache_across_tenants: bool = False
    # Which priorities each tenant may use ({tenant: highest}; the others: the default, `normal`),
    # and how big a shard may get (rows, estimated tokens): a shard is what a free worker slot is
    # given, so its size bounds how long another tenant's new job waits for one.
    tenant_max_priority: str | None = None
    default_tenant_max_priority: int = Field(DEFAULT_TENANT_MAX_PRIORITY, ge=0, le=9)
    max_shard_size: int = Field(DEFAULT_MAX_SHARD_SIZE, ge=1)
    max_shard_tokens: int = Field(DEFAULT_MAX_SHARD_TOKENS, ge=1)
    # A row without max_tokens generates until it stops, bounded by its model's context and this; a
    # row or job asking for more is refused, naming it. None: 16384 (jobs/output_tokens.py).
    max_tokens_cap: int | None = Field(None, ge=1)
    # Tokens a row without max_tokens is expected to generate, for shard sizes, the fair queue and dry
    # runs, until the model's own rows have measured it. None: 256 (jobs/output_tokens.py).
    output_tokens_estimate: int | None = Field(None, ge=1)
    # LoRA adapters by name (JSON {name: location}, or name=location,...: jobs/lora_adapters.py), and
    # the engines' LoRA settings over engine_options' own. enable_lora None: on when adapters are
    # registered (a job may then also give an adapter by location).
    lora_adapters: str | None = None
    # The tool-call format of each model whose chat template has none of its own, or to override it
    # (JSON {model: hermes | llama3_json | mistral}), as vLLM's --tool-call-parser.
    tool_call_formats: str | None = None
    # Images in rows: an image's bytes and pixels, images per row (each past it: that row's
    # invalid_image error), and the hosts http(s):// image URLs may name (comma-separated; none: no
    # http fetches). Store locations follow the input_uri rules (jobs/storage_rules.py).
    image_max_bytes: int = Field(DEFAULT_IMAGE_MAX_BYTES, ge=1)
    image_max_pixels: int = Field(DEFAULT_IMAGE_MAX_PIXELS, ge=1)
    image_max_per_row: int = Field(DEFAULT_IMAGES_PER_ROW, ge=1)
    image_http_hosts: str | None = None
    enable_lora: bool | None = None
    max_loras: int | None = Field(None, ge=1)  # adapters in one engine step
    max_lora_rank: int | None = Field(None, ge=1)
    max_cpu_loras: int | None = Field(None, ge=1)  # adapters kept in host memory (least recently used out)
    # Prefix KV in the object store (worker/kv/store.py): "auto" is on for a deployment whose store is
    # S3 (`up`, `serve worker`), off for `bulkinfer run`. Blocks go under `<kv_store_uri>/kv/`
    # (default: the job store's), a disk cache in front of it (default: `kv/` in the model cache).
    kv_store: Literal["auto", "on", "off"] = "auto"
    kv_store_uri: str | None = None
    kv_store_min_hits: int | None = Field(None, ge=1)  # rows sharing a prefix before it is saved
    kv_store_budget_bytes: int | None = Field(None, ge=1)  # per model namespace; None: unbounded
    kv_store_cache_dir: str | None = None
    kv_store_cache_bytes: int | None = Field(None, ge=0)  # 0: no disk cache

    @field_validator("max_completion_window")
    @classmethod
    def _window_parses(cls, value: str) -> str:
        window_seconds(value)
        return value

    @field_validator("store_uri", "kv_store_uri")
    @classmethod
    def _store_uri_is_usable(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if value.startswith("s3://"):
            if not value[len("s3://"):].split("/", 1)[0]:
                raise ValueError(f"s3 store URI has no bucket: {value!r} (expected s3://bucket/prefix)")
        elif "://" in value and not value.startswith("file://"):
            raise ValueError(f"store URI must be s3://bucket/prefix or a local directory, got {value!r}")
        return value

    @field_validator("tenant_max_priority")
    @classmethod
    def _caps_parse(cls, value: str | None) -> str | None:
        parse_tenant_max_priority(value)
        return value

    @field_validator("tool_call_formats")
    @classmethod
    def _tool_call_formats_parse(cls, value: str | None) -> str | None:
        from bulkinfer.jobs.tool_calls import parse_tool_call_formats

        parse_tool_call_formats(value)
        return value

    @field_validator("tenant_prefixes")
    @classmethod
    def _tenant_prefixes_parse(cls, value: str | None) -> str | None:
        # Refused at start, not at the first submit or image a worker reads.
        tenant_prefixes(value)
        return value

    @field_validator("lora_adapters")
    @classmethod
    def _adapters_parse(cls, value: str | None) -> str | None:
        from bulkinfer.jobs.lora_adapters import AdapterRegistry

        AdapterRegistry.parse(value)
        return value

    @field_validator("models", "engine_options", "speculative_config", "tenant_prefixes",
                     "tenant_max_priority", "model_aliases", "lora_adapters", "tool_call_formats",
                     mode="before")
    @classmethod
    def _tables_become_json(cls, value: Any) -> Any:
        # A TOML table (or a dict from code) is kept as the JSON text the variable would hold.
        return json.dumps(value, sort_keys=True) if isinstance(value, dict) else value

    @field_validator("engine_options", "speculative_config")
    @classmethod
    def _engine_options_are_an_object(cls, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"not JSON ({error.msg})") from None
        if not isinstance(parsed, dict):
            raise ValueError("must be a JSON object (of EngineConfig fields; of speculative_config keys)")
        return value

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *,
                 config: str | os.PathLike[str] | None = None, **overrides: Any) -> Settings:
        """Settings from flags (`overrides`, None = not given) over the environment (empty variables
        count as unset) over the config file over the defaults. Raises `ConfigError` naming the key
        and where it came from.
        """
        environ = os.environ if environ is None else environ
        unknown = sorted(set(overrides) - set(cls.model_fields))
        if unknown:
            raise TypeError(f"Settings has no field {unknown[0]!r}")
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        path = config_path(environ, config)
        if path is not None:
            for key, value in read_config_file(path).items():
                values[key], sources[key] = value, f"{path}: key {key!r}"
        for field, name in ENVIRONMENT_NAMES.items():
            if environ.get(name):
                values[field], sources[field] = environ[name], f"environment variable {name}"
        for field, value in overrides.items():
            if value is not None:
                values[field], sources[field] = value, f"--{field.replace('_', '-')}"
        try:
            return cls.model_validate(values)
        except ValidationError as error:
            item = error.errors()[0]
            field = str(item["loc"][0]) if item["loc"] else ""
            message = item["msg"].removeprefix("Value error, ")
            raise ConfigError(f"{sources.get(field, field)}: {message}") from None

    def to_env(self) -> dict[str, str]:
        """The variables that give a child process (a worker) these same settings."""
        return {name: str(getattr(self, field)) for field, name in ENVIRONMENT_NAMES.items()
                if getattr(self, field) is not None}

    # Derived values, each with its default in one place; modules take them from the Settings
    # object they are handed (a worker's context), never from the environment.
    @property
    def lease_ttl(self) -> float:
        """A shard, plan or finalize lease's TTL in seconds."""
        return self.shard_lease_ttl_s or DEFAULT_SHARD_LEASE_TTL_S

    @property
    def retry_max_delay(self) -> float:
        """The longest backoff between retries of a step that met an infrastructure fault."""
        return self.retry_max_delay_s or DEFAULT_RETRY_MAX_DELAY_S

    @property
    def reaper_tick(self) -> float:
        """Seconds between the reaper's ticks."""
        return self.reaper_interval_s or DEFAULT_REAPER_INTERVAL_S

    @property
    def crashes_before_split(self) -> int:
        """Crashed deliveries of a shard before it runs in halves (worker/shards/shard_crashes.py)."""
        return self.crash_split_after or DEFAULT_CRASH_SPLIT_AFTER

    @property
    def tokens_cap(self) -> int:
        """The most tokens a row may generate (`max_tokens_cap`)."""
        return self.max_tokens_cap or DEFAULT_MAX_TOKENS_CAP

    @property
    def output_estimate(self) -> int:
        """What a row without max_tokens is expected to generate before the model has measured it."""
        return self.output_tokens_estimate or DEFAULT_OUTPUT_TOKENS_ESTIMATE

    @property
    def model_cache_dir(self) -> Path:
        return Path(self.model_cache).expanduser() if self.model_cache else DEFAULT_MODEL_CACHE

    @property
    def preload_models(self) -> list[str]:
        return [name.strip() for name in (self.worker_models or "").split(",") if name.strip()]

    def log_secrets(self) -> list[str]:
        """What no log line may contain (jobs/log_format.py): these settings' keys and secrets."""
        from bulkinfer.jobs.log_format import secret_values

        return secret_values([self.api_keys, self.admin_api_keys, self.webhook_secret])

    @property
    def lora_enabled(self) -> bool:
        """Whether the engines serve LoRA adapters: `enable_lora`, else whether any is registered."""
        from bulkinfer.jobs.lora_adapters import AdapterRegistry

        if self.enable_lora is not None:
            return self.enable_lora
        return bool(AdapterRegistry.parse(self.lora_adapters))

    def tool_call_formats_dict(self) -> dict[str, str]:
        """`tool_call_formats` as {model: format}."""
        from bulkinfer.jobs.tool_calls import parse_tool_call_formats

        return parse_tool_call_formats(self.tool_call_formats)

    def engine_options_dict(self) -> dict[str, Any]:
        """`engine_options` with the `dtype`, `remeasure_dtype`, `speculative_config`,
        `tensor_parallel_size`, `batch_invariant` and LoRA settings over its own, when set."""
        options = json.loads(self.engine_options) if self.engine_options else {}
        if self.speculative_config:
            options["speculative_config"] = json.loads(self.speculative_config)
        if self.tensor_parallel_size is not None:
            options["tensor_parallel_size"] = self.tensor_parallel_size
        if self.batch_invariant is not None:
            options["batch_invariant"] = self.batch_invariant
        if self.remeasure_dtype is not None:
            options["remeasure_dtype"] = self.remeasure_dtype
        if self.enable_lora is not None or self.lora_enabled:
            options["enable_lora"] = self.lora_enabled
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            if getattr(self, name) is not None:
                options[name] = getattr(self, name)
        return {**options, "dtype": self.dtype} if self.dtype else options

    def priority_caps(self) -> dict[str, int]:
        """{tenant: the highest priority it may use}; other tenants: `default_tenant_max_priority`."""
        return parse_tenant_max_priority(self.tenant_max_priority)

    def job_priority(self, spec: JobSpec) -> int:
        """The priority a job's shards run at: its own, capped for its tenant (jobs/priority_caps.py)."""
        return effective_priority(self.priority_caps(), self.default_tenant_max_priority, spec)

    def priority_problem(self, tenant: str | None, priority: int) -> str | None:
        """Why `tenant` may not ask for `priority` (None: it may)."""
        return priority_problem(self.priority_caps(), self.default_tenant_max_priority, tenant, priority)

    @property
    def is_local_store(self) -> bool:
        return not self.store_uri.startswith("s3://")

    def local_store_root(self) -> Path:
        """The directory of a local store, absolute (relative paths are taken from the cwd)."""
        if not self.is_local_store:
            raise ValueError(f"the store is not local: {self.store_uri}")
        return Path(self.store_uri.removeprefix("file://")).expanduser().resolve()

    def open_store(self) -> tuple[ObjectStore, str]:
        """The job store and the key prefix jobs live under in it."""
        return self._open_store_uri(self.store_uri)

    def open_kv_store(self, client: Any = None) -> tuple[ObjectStore, str]:
        """The store the KV blocks live in and its key prefix (`kv_store_location`); `client`: the
        boto3 client an S3 one uses (the KV tier's has short timeouts: worker/kv/store.py)."""
        return self._open_store_uri(self.kv_store_location, client)

    def _open_store_uri(self, uri: str, client: Any = None) -> tuple[ObjectStore, str]:
        if not uri.startswith("s3://"):
            from bulkinfer.jobs.object_store.local import LocalObjectStore

            return LocalObjectStore(Path(uri.removeprefix("file://")).expanduser().resolve()), ""
        from bulkinfer.jobs.object_store.s3 import S3ObjectStore

        bucket, _, prefix = uri[len("s3://"):].partition("/")
        return S3ObjectStore(bucket, endpoint_url=self.s3_endpoint_url, client=client), prefix.strip("/")

    def image_limits(self) -> ImageLimits:
        """The `image_*` settings as the readers and the image fetcher apply them."""
        return ImageLimits(self.image_max_bytes, self.image_max_pixels, self.image_max_per_row,
                           parse_http_hosts(self.image_http_hosts))

    def kv_store_enabled(self, *, deployment: bool) -> bool:
        """Whether engines save and load prefix KV in the store: `kv_store`, and for "auto" whether
        this is a deployment (`up`, `serve worker`; not `bulkinfer run`) whose store is a bucket."""
        if self.kv_store != "auto":
            return self.kv_store == "on"
        return deployment and not self.is_local_store

    @property
    def kv_store_location(self) -> str:
        """The store URI the KV blocks live under (in its `kv/` area): `kv_store_uri`, else the job
        store's."""
        return self.kv_store_uri or self.store_uri

    @property
    def kv_cache_dir(self) -> Path:
        """The local disk cache of KV blocks: `kv_store_cache_dir`, else `kv/` in the model cache (a
        worker's writable, kept volume, as its `loras/`)."""
        if self.kv_store_cache_dir:
            return Path(self.kv_store_cache_dir).expanduser()
        return self.model_cache_dir / KV_STORE_AREA

    @property
    def kv_cache_bytes(self) -> int:
        """The disk cache's size in bytes (0: no disk cache)."""
        if self.kv_store_cache_bytes is None:
            return DEFAULT_KV_STORE_CACHE_BYTES
        return self.kv_store_cache_bytes

    @property
    def kv_min_hits(self) -> int:
        return self.kv_store_min_hits or DEFAULT_KV_STORE_MIN_HITS

    def redis_client(self) -> redis.Redis:
        import redis

        # A Redis that is unreachable (not refusing), or that stops answering mid-command, must fail
        # the call (tasks retry it; the API answers 503), not hang it. No command of ours blocks
        # server-side, so 10 s is only ever reached by a dead connection.
        return redis.Redis.from_url(self.broker_url, socket_connect_timeout=5, socket_timeout=10,
                                    health_check_interval=30)

    def model_registry(self) -> ModelRegistry:
        from bulkinfer.jobs.model_registry import ModelRegistry

        return ModelRegistry.parse(self.models, self.model_aliases, self.lora_adapters)

    def repository(self) -> JobRepository:
        from bulkinfer.jobs.state.repository import JobRepository

        store, prefix = self.open_store()
        return JobRepository(store, self.redis_client(), prefix=prefix)


def config_path(environ: Mapping[str, str], config: str | os.PathLike[str] | None = None) -> Path | None:
    """The config file to read: `config`, else `$BULKINFER_CONFIG` (both must exist), else
    `./bulkinfer.toml` if there is one, else None.
    """
    chosen = config or environ.get(CONFIG_ENV)
    if chosen:
        path = Path(chosen).expanduser()
        if not path.is_file():
            where = "--config" if config else CONFIG_ENV
            raise ConfigError(f"{where}: no config file at {path}")
        return path
    default = Path(DEFAULT_CONFIG_FILE)
    return default if default.is_file() else None


def read_config_file(path: Path) -> dict[str, Any]:
    """The file's settings; raises `ConfigError` for bad TOML or a key that is not a setting."""
    try:
        data = tomllib.loads(path.read_text())
    except OSError as error:
        raise ConfigError(f"{path}: cannot read it ({error.strerror})") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: not valid TOML ({error})") from None
    for key in data:
        if key not in ENVIRONMENT_NAMES:
            raise ConfigError(f"{path}: unknown key {key!r} (known keys: {', '.join(ENVIRONMENT_NAMES)}; "
                              "see docs/configuration.md)")
    return data


_process_settings: Settings | None = None


def configure_process(settings: Settings) -> None:
    """The settings this process runs with (`serve worker` builds them from its flags first)."""
    global _process_settings
    _process_settings = settings


def process_settings() -> Settings:
    """This process's settings: those `configure_process` set, else read from the environment and
    the config file, once. Worker modules get them from here, or from the context built on them."""
    global _process_settings
    if _process_settings is None:
        _process_settings = Settings.from_env()
    return _process_settings
