"""A row's LoRA adapter as the engine's `LoRARequest`: the name checked against the adapters
registered on the model, the folder fetched once per worker process, an id that always means the
same adapter in this process's engines (vLLM's rule).

Adapters from S3 are downloaded once into `<model_cache>/loras/` (beside the models, shared by the
machine's workers) and, once resolved, kept in memory for the process's life: a later job on the
same adapter neither lists nor reads the store again.
"""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path

from bulkinfer.engine import LoRARequest
from bulkinfer.engine.errors import LoRAAdapterError
from bulkinfer.engine.lora import read_adapter_config
from bulkinfer.jobs.formats.rows import Row, RowErrorCode
from bulkinfer.jobs.lora_adapters import ADAPTER_CONFIG, UnknownAdapter, is_adapter_location
from bulkinfer.jobs.model_registry import ModelNotRun, ModelRegistry
from bulkinfer.worker.models.model_files import ModelUnavailable, downloaded_folder
from bulkinfer.worker.transient import is_transient

LORA_CACHE_FOLDER = "loras"
# How long a refused adapter (missing, not a LoRA folder) stays refused before it is fetched again:
# its rows fail at once instead of each listing the store, and a fixed upload is seen soon after.
REFUSAL_TTL_S = 60.0


class AdapterRefused(ValueError):
    """The row's adapter cannot be used; becomes the row's error with `code`."""

    def __init__(self, code: RowErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class AdapterRequests:
    """The `LoRARequest` of each adapter one model's rows name, resolved once per process."""

    def __init__(self, model: str, registry: ModelRegistry, cache_dir: Path,
                 endpoint_url: str | None = None) -> None:
        self.model = model
        self.registry = registry
        self.cache_dir = cache_dir
        self.endpoint_url = endpoint_url
        self._requests: dict[str, LoRARequest] = {}  # adapter name or job location -> its request
        self._refused: dict[str, tuple[float, AdapterRefused]] = {}  # name -> (when, why)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.fetches = 0  # adapters resolved from their location (downloaded or found on disk)

    def for_row(self, row: Row) -> LoRARequest | None:
        """The row's adapter (None: the base model); raises `AdapterRefused` naming the problem, or a
        transient store error (the shard is tried again)."""
        try:
            name = self.registry.row_adapter(self.model, row.lora, row.lora_required, row.lora_names_model)
        except ModelNotRun as unknown:
            raise AdapterRefused(RowErrorCode.UNKNOWN_MODEL, str(unknown)) from None
        except UnknownAdapter as unknown:
            raise AdapterRefused(RowErrorCode.UNKNOWN_LORA, str(unknown)) from None
        if name is None:
            return None
        if is_adapter_location(name):  # only ever the job's own lora, checked at submit
            return self._request(name, name)
        return self._request(name, self.registry.adapters.get(self.model, name).location)

    def _request(self, name: str, location: str) -> LoRARequest:
        with self._lock:  # one fetch per adapter, however many task threads ask at once
            known = self._requests.get(name)
            if known is not None:
                return known
            refused = self._refused.get(name)
            if refused is not None and time.monotonic() - refused[0] < REFUSAL_TTL_S:
                raise AdapterRefused(refused[1].code, str(refused[1]))
            try:
                folder = self._fetch(name, location)
                try:
                    read_adapter_config(folder)
                except LoRAAdapterError as error:
                    message = f"LoRA adapter {name!r}: {error}"
                    raise AdapterRefused(RowErrorCode.INVALID_LORA, message) from None
            except AdapterRefused as refusal:
                self._refused[name] = (time.monotonic(), refusal)
                raise
            request = LoRARequest(name, next(self._ids), str(folder))
            self._requests[name] = request
            return request

    def _fetch(self, name: str, location: str) -> Path:
        self.fetches += 1
        if location.startswith("s3://"):
            try:
                return downloaded_folder(location, self.cache_dir / LORA_CACHE_FOLDER, self.endpoint_url,
                                         ADAPTER_CONFIG, "LoRA adapter")
            except ModelUnavailable as error:
                raise AdapterRefused(RowErrorCode.INVALID_LORA, f"LoRA adapter {name!r}: {error}") from None
            except Exception as error:
                if is_transient(error):
                    raise
                raise AdapterRefused(RowErrorCode.INVALID_LORA,
                                     f"LoRA adapter {name!r}: cannot fetch {location}: {error}") from None
        folder = Path(location.removeprefix("file://")).expanduser()
        if not (folder / ADAPTER_CONFIG).is_file():
            raise AdapterRefused(RowErrorCode.INVALID_LORA, f"LoRA adapter {name!r}: no {ADAPTER_CONFIG} "
                                 f"in {location}")
        return folder
