"""What the tasks of one worker process share: settings, the job repository, the model registry and
the engine hosts. Built once per process on first use (never at import: Celery imports the tasks
module in processes that run no task, such as `celery inspect`).
"""

from __future__ import annotations

import logging
import socket
import threading
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from bulkinfer.jobs.model_registry import ModelRegistry
from bulkinfer.jobs.object_store.base import ObjectStore
from bulkinfer.jobs.settings import Settings, process_settings
from bulkinfer.jobs.state.repository import JobRepository
from bulkinfer.jobs.tokenizer_files import ImageSpans, publish_tokenizer
from bulkinfer.worker.hosts.model_hosts import ModelHosts
from bulkinfer.worker.kv.store import kv_store_options

logger = logging.getLogger(__name__)

@dataclass
class WorkerContext:
    settings: Settings

    @cached_property
    def repository(self) -> JobRepository:
        return self.settings.repository()

    @property
    def store(self) -> ObjectStore:
        return self.repository.store

    @cached_property
    def registry(self) -> ModelRegistry:
        return self.settings.model_registry()

    @cached_property
    def hosts(self) -> ModelHosts:
        settings = self.settings
        return ModelHosts(self.registry, settings.engine_options_dict(),
                          s3_endpoint_url=settings.s3_endpoint_url, cache_dir=settings.model_cache_dir,
                          on_tokenizer=self._publish_tokenizer,
                          kv_store_options=kv_store_options(settings, deployment=True),
                          max_tokens_cap=settings.tokens_cap,
                          tool_call_formats=settings.tool_call_formats_dict())

    def _publish_tokenizer(self, name: str, tokenizer: Any, image_spans: ImageSpans | None = None) -> None:
        """Put a loaded model's tokenizer where the API's dry runs read it (jobs/tokenizer_files.py)."""
        try:
            publish_tokenizer(self.store, self.repository.prefix, name, tokenizer, socket.gethostname(),
                              image_spans)
        except Exception:  # noqa: BLE001 - only dry runs need it: the model serves without
            logger.exception("could not publish the tokenizer of %s", name)


_context: WorkerContext | None = None
_context_lock = threading.Lock()


def worker_context() -> WorkerContext:
    """The process's context, built on the process's settings the first time it is asked for."""
    global _context
    with _context_lock:
        if _context is None:
            context = WorkerContext(process_settings())
            # Build the shared members now, under the lock, so two task threads never build two.
            _ = context.repository, context.registry, context.hosts
            _context = context
        return _context


def built_worker_context() -> WorkerContext | None:
    """The process's context if something built it already (None: nothing to stop at exit)."""
    with _context_lock:
        return _context
