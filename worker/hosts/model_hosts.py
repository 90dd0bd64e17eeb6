"""The engines of a worker process: one `EngineHost` per served model, built on first use; an
embedding model (`bulkinfer.engine.embedder.is_embedding_model`) gets an `EmbedHost` instead, and runs only
embed jobs. A decoder checkpoint without sentence-transformers files generates; an embed job on it
(`get(name, embed=True)`) loads it a second time, as an embedder (last-token pooling unless the job
says otherwise, as Qwen3-Embedding), beside its engine when generate jobs use it too.

Resolving a model (and downloading it from S3) happens in the calling thread; only the engine
build itself runs on the engine thread, so that thread never touches the object store.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bulkinfer.engine import EngineConfig, LLMEngine
from bulkinfer.engine.dtype_verdict import VERDICTS_FILE_NAME
from bulkinfer.engine.multimodal.families import image_family
from bulkinfer.engine.multimodal.processing import ImageProcessorFamily
from bulkinfer.jobs.model_registry import ModelRegistry
from bulkinfer.jobs.output_tokens import DEFAULT_MAX_TOKENS_CAP
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.jobs.tokenizer_files import ImageSpans
from bulkinfer.worker.hosts.embed_host import EmbedHost
from bulkinfer.worker.hosts.engine_host import EngineHost
from bulkinfer.worker.hosts.lora_requests import AdapterRequests
from bulkinfer.worker.hosts.prompt_renderer import PromptRenderer
from bulkinfer.worker.models.embedding_size import checkpoint_dimension
from bulkinfer.worker.models.model_cache import model_cache_dir
from bulkinfer.worker.models.model_files import local_model_dir
from bulkinfer.worker.tuning.tuned_settings import machine_signature, tuned_engine_options

logger = logging.getLogger(__name__)

# Jobs say "higher priority runs sooner" (0-9); the engine schedules lower values first.
DEFAULT_ENGINE_OPTIONS: dict[str, Any] = {"scheduling_policy": "priority"}


def engine_options(options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """`EngineConfig` fields (other than `model`) over the worker's defaults, from the settings'
    `engine_options` (with the `dtype` setting in: `Settings.engine_options_dict`); an unknown
    field is refused by name."""
    options = dict(options or {})
    known = {field.name for field in dataclasses.fields(EngineConfig)} - {"model"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"engine_options: unknown engine option {unknown[0]!r} "
                         f"(known: {', '.join(sorted(known))})")
    return {**DEFAULT_ENGINE_OPTIONS, **options}


@dataclass(frozen=True)
class HostedModel:
    name: str
    directory: Path
    host: EngineHost | EmbedHost
    renderer: PromptRenderer
    adapters: AdapterRequests | None = None  # its rows' LoRA adapters (a generating model's)
    max_tokens_cap: int = DEFAULT_MAX_TOKENS_CAP  # the most a row may generate (the deployment's setting)

    @property
    def is_embedding(self) -> bool:
        """An embedding model: it embeds rows (EmbedHost) and cannot generate."""
        return isinstance(self.host, EmbedHost)


class ModelHosts:
    def __init__(self, registry: ModelRegistry, engine_options: dict[str, Any] | None = None, *,
                 s3_endpoint_url: str | None = None, cache_dir: Path | None = None,
                 on_tokenizer: Callable[[str, Any, ImageSpans | None], None] | None = None,
                 kv_store_options: Mapping[str, Any] | None = None,
                 max_tokens_cap: int = DEFAULT_MAX_TOKENS_CAP,
                 tool_call_formats: Mapping[str, str] | None = None) -> None:
        """`engine_options` are checked when a model loads (`engine_options()`), so a bad one fails
        that model's jobs with the reason instead of every task before it can say why.
        `on_tokenizer(name, tokenizer, image_spans)` sees each model's tokenizer once loaded (and the
        tokens its images take, for a model that takes images). `kv_store_options`:
        the prefix KV tier's engine fields (worker/kv/store.py), shared by every model's engine.
        `max_tokens_cap`: the most a row may generate (the `max_tokens_cap` setting);
        `tool_call_formats`: {model: format} for templates without one (the `tool_call_formats` setting)."""
        self.on_tokenizer = on_tokenizer
        self.tool_call_formats = dict(tool_call_formats or {})
        self.max_tokens_cap = max_tokens_cap
        self.registry = registry
        self.engine_options = engine_options
        self.kv_store_options = dict(kv_store_options or {})
        self.s3_endpoint_url = s3_endpoint_url
        self.cache_dir = cache_dir
        self._models: dict[tuple[str, bool], HostedModel] = {}  # (name, hosted as an embedder)
        self._embedding_models: dict[str, bool] = {}  # name -> is an embedding model, once resolved
        self._lock = threading.Lock()

    def get(self, name: str, *, embed: bool = False) -> HostedModel:
        """The hosted model, loading it the first time (and again if its last load failed); `embed`:
        as an embedder (an embedding model always is one; a decoder is then hosted a second time).

        Raises `UnknownModel` for a name the registry lacks and `ModelUnavailable` when its files
        cannot be found or fetched; the engine itself finishes loading in its own thread (see
        `EngineHost.wait_ready`).
        """
        with self._lock:
            known = self._embedding_models.get(name)
            hosted = None if known is None else self._models.get((name, embed or known))
            if hosted is None or hosted.host.failure is not None:
                hosted = self._load(name, embed)
                self._models[(name, hosted.is_embedding)] = hosted
            return hosted

    def _load(self, name: str, embed: bool) -> HostedModel:
        from transformers import AutoTokenizer

        directory = local_model_dir(self.registry.location(name), self.cache_dir,
                                    endpoint_url=self.s3_endpoint_url)
        config = self.engine_config(directory)
        # The tokenizer first, then the engine: loading a tokenizer runs its own thread pool, and
        # a dtype verdict measured beside it (engine/dtype_benchmark.py, once per CPU) would meet it.
        tokenizer = AutoTokenizer.from_pretrained(directory)
        from bulkinfer.engine.embedder import Embedder, is_embedding_model

        embedding_model = is_embedding_model(directory)
        self._embedding_models[name] = embedding_model
        family = None if embedding_model or embed else image_family(directory, tokenizer)
        renderer = PromptRenderer(tokenizer, self.tool_call_formats.get(name), family, name)
        if self.on_tokenizer is not None:
            self.on_tokenizer(name, tokenizer, image_spans(family))
        if embedding_model or embed:
            options: dict[str, Any] = {"dtype": config.dtype, "device": config.device,
                       "dtype_verdicts": config.dtype_verdicts, "remeasure_dtype": config.remeasure_dtype}
            host: EngineHost | EmbedHost = EmbedHost(lambda: Embedder.load(directory, **options), name=name)
        else:
            host = EngineHost(lambda: LLMEngine(config), name=name)
        host.start()
        logger.info("loading model %s from %s", name, directory)
        adapters = None
        if isinstance(host, EngineHost):
            adapters = AdapterRequests(name, self.registry, self.cache_dir or model_cache_dir(),
                                       endpoint_url=self.s3_endpoint_url)
        return HostedModel(name, directory, host, renderer, adapters, self.max_tokens_cap)

    def engine_config(self, directory: Path) -> EngineConfig:
        """The model's engine settings: the explicit `engine_options` over `bulkinfer tune`'s for this
        model on this machine (worker/tuning/tuned_settings.py) over the engine's defaults."""
        explicit = engine_options(self.engine_options)
        signature = machine_signature(str(explicit.get("device", "cpu")), str(explicit.get("dtype", "auto")))
        cache_dir = self.cache_dir or model_cache_dir()
        tuned = tuned_engine_options(cache_dir, directory, signature)
        # dtype auto's kept verdict lives beside the models (engine/dtype_verdict.py).
        verdicts = {"dtype_verdicts": str(cache_dir / VERDICTS_FILE_NAME)}
        return EngineConfig(model=str(directory),
                            **{**verdicts, **tuned, **explicit, **self.kv_store_options})

    def hosted(self) -> list[HostedModel]:
        """The models this process hosts now (loaded, loading or failed), one per name, as heartbeats
        and metrics report them: a decoder hosted both ways is reported by its engine."""
        with self._lock:
            models = list(self._models.items())
        by_name: dict[str, HostedModel] = {}
        for (name, as_embedder), hosted in models:
            if not as_embedder or name not in by_name:
                by_name[name] = hosted
        return list(by_name.values())

    def state(self, name: str) -> str:
        """One model's state: "loaded", "loading", "not loaded" or "failed: <why>"."""
        with self._lock:
            hosted = self._models.get((name, False)) or self._models.get((name, True))
        if hosted is None:
            return "not loaded"
        if hosted.host.failure is not None:
            return f"failed: {hosted.host.failure}"
        return "loaded" if hosted.host.loaded else "loading"

    def preload(self, names: Iterable[str]) -> threading.Thread:
        """Load these models in a background thread (at worker start), logging failures."""

        def load_all() -> None:
            for name in names:
                try:
                    self.get(name).host.wait_ready()
                except Exception:  # noqa: BLE001 - the first shard reports it to its job
                    logger.exception("preloading model %s failed", name)

        thread = threading.Thread(target=load_all, name="model-preload", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        with self._lock:
            for hosted in self._models.values():
                hosted.host.stop()
            self._models.clear()


def task_problem(spec: JobSpec, hosted: HostedModel) -> str | None:
    """Why the job cannot run on this model (an embed job on a model not hosted as an embedder, a
    generate job on an embedding model, or, once it is loaded, `dimensions` or `max_length` past the
    model's or a `pooling` its checkpoint does not allow), or None."""
    if spec.is_embed and not hosted.is_embedding:
        return (f"model {hosted.name!r} is hosted to generate text, not to embed: an embed job asks for "
                "it with ModelHosts.get(name, embed=True)")
    if not spec.is_embed and hosted.is_embedding:
        return (f"model {hosted.name!r} is an embedding model and cannot generate text: run it with task "
                "'embed' (OpenAI batch lines: url /v1/embeddings)")
    size = hosted.host.dimension if isinstance(hosted.host, EmbedHost) else None
    if spec.dimensions is not None and size is not None and spec.dimensions > size:
        return f"dimensions {spec.dimensions} is more than model {hosted.name!r}'s {size}"
    longest = hosted.host.max_length if isinstance(hosted.host, EmbedHost) else None
    if spec.max_length is not None and longest is not None and spec.max_length > longest:
        return (f"max_length {spec.max_length} is more than model {hosted.name!r}'s maximum of {longest} "
                "tokens per input")
    fixed = hosted.host.fixed_pooling if isinstance(hosted.host, EmbedHost) else None
    if spec.pooling is not None and fixed is not None and spec.pooling != fixed:
        return (f"pooling {spec.pooling!r}: model {hosted.name!r} was trained with {fixed!r} pooling (its "
                f"sentence-transformers files fix it); omit pooling or ask for {fixed!r}")
    return None


def embedding_dimension(spec: JobSpec, hosted: HostedModel) -> int | None:
    """The size of an embed job's vectors: its `dimensions`, else the loaded model's, else (the rows
    ended before it loaded) its checkpoint's (worker/models/embedding_size.py)."""
    if not isinstance(hosted.host, EmbedHost):
        return None
    return spec.dimensions or hosted.host.dimension or checkpoint_dimension(hosted.directory)


def image_spans(family: ImageProcessorFamily | None) -> ImageSpans | None:
    """What a dry run needs to count a model's image tokens (None: a text-only model)."""
    if family is None:
        return None
    low, most = family.span_bounds()
    return ImageSpans(family.placeholder_text, low, most)
