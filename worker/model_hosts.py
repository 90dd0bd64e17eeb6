"""The engines of a worker process: one `EngineHost` per served model, built on first use.

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

from engine import EngineConfig, LLMEngine
from jobs.model_registry import ModelRegistry
from worker.engine_host import EngineHost
from worker.engine_rows import PromptRenderer
from worker.model_cache import model_cache_dir
from worker.model_files import local_model_dir
from worker.tuning import machine_signature, tuned_engine_options

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
    host: EngineHost
    renderer: PromptRenderer


class ModelHosts:
    def __init__(self, registry: ModelRegistry, engine_options: dict[str, Any] | None = None, *,
                 s3_endpoint_url: str | None = None, cache_dir: Path | None = None,
                 on_tokenizer: Callable[[str, Any], None] | None = None) -> None:
        """`engine_options` are checked when a model loads (`engine_options()`), so a bad one fails
        that model's jobs with the reason instead of every task before it can say why.
        `on_tokenizer(name, tokenizer)` sees each model's tokenizer once loaded."""
        self.on_tokenizer = on_tokenizer
        self.registry = registry
        self.engine_options = engine_options
        self.s3_endpoint_url = s3_endpoint_url
        self.cache_dir = cache_dir
        self._models: dict[str, HostedModel] = {}
        self._lock = threading.Lock()

    def get(self, name: str) -> HostedModel:
        """The hosted model, loading it the first time (and again if its last load failed).

        Raises `UnknownModel` for a name the registry lacks and `ModelUnavailable` when its files
        cannot be found or fetched; the engine itself finishes loading in its own thread (see
        `EngineHost.wait_ready`).
        """
        with self._lock:
            hosted = self._models.get(name)
            if hosted is None or hosted.host.failure is not None:
                hosted = self._load(name)
                self._models[name] = hosted
            return hosted

    def _load(self, name: str) -> HostedModel:
        from transformers import AutoTokenizer

        directory = local_model_dir(self.registry.location(name), self.cache_dir,
                                    endpoint_url=self.s3_endpoint_url)
        config = self.engine_config(directory)
        # The tokenizer first, then the engine: loading a tokenizer runs its own thread pool, and
        # the engine's start-up dtype probe (engine/dtype_choice.py) timed beside it read 4-5x
        # low and once chose fp32 on an AMX CPU.
        tokenizer = AutoTokenizer.from_pretrained(directory)
        if self.on_tokenizer is not None:
            self.on_tokenizer(name, tokenizer)
        renderer = PromptRenderer(tokenizer)
        host = EngineHost(lambda: LLMEngine(config), name=name).start()
        logger.info("loading model %s from %s", name, directory)
        return HostedModel(name, directory, host, renderer)

    def engine_config(self, directory: Path) -> EngineConfig:
        """The model's engine settings: the explicit `engine_options` over `bulkinfer tune`'s for this
        model on this machine (worker/tuning.py) over the engine's defaults."""
        explicit = engine_options(self.engine_options)
        signature = machine_signature(str(explicit.get("device", "cpu")), str(explicit.get("dtype", "auto")))
        tuned = tuned_engine_options(self.cache_dir or model_cache_dir(), directory, signature)
        return EngineConfig(model=str(directory), **{**tuned, **explicit})

    def hosted(self) -> list[HostedModel]:
        """The models this process hosts now (loaded, loading or failed)."""
        with self._lock:
            return list(self._models.values())

    def state(self, name: str) -> str:
        """One model's state: "loaded", "loading", "not loaded" or "failed: <why>"."""
        with self._lock:
            hosted = self._models.get(name)
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
