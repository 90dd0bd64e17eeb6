"""A model's files on local disk, from any location a registry, `bulkinfer run`, `up` or `bench`
takes:

- a folder with config.json: used as it is;
- `s3://bucket/prefix`: downloaded once into the model cache and reused after that
  (`s3://…/file.gguf`: the file is downloaded, then imported as below);
- a `.gguf` file: imported once into the model cache, keyed by the file's sha256;
- a catalog name (`smollm2-135m-instruct`, worker/models/model_catalog.py): fetched and imported once;
- a preset name (`tiny`, `small`: jobs/model_presets.py): a random-weight checkpoint built once into
  the checkpoint cache (engine/checkpoints.py's `cached_checkpoint`), the same one for every command.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from bulkinfer.jobs.model_presets import PRESET_NAMES
from bulkinfer.jobs.object_store.factory import store_for_uri
from bulkinfer.worker.models.gguf_import import GgufImportError, import_gguf
from bulkinfer.worker.models.model_cache import cache_lock, file_sha256, model_cache_dir
from bulkinfer.worker.models.model_catalog import CATALOG, CatalogError, fetch_catalog_model
from bulkinfer.worker.transient import is_transient

# The dtype an imported .gguf is stored in: what these models are released in, half of fp32's
# disk, and exact for the engine to upcast when the CPU runs fp32.
GGUF_IMPORT_DTYPE = "bfloat16"
# What a preset name builds (engine/checkpoints.py): one recipe, so one folder on a machine.
PRESET_ARCH = "llama"
PRESET_SEED = 0
# Written last into a downloaded folder: a folder without it is a download that did not finish.
COMPLETE_MARKER = ".bulkinfer-complete"
COPY_CHUNK = 8 << 20


class ModelUnavailable(RuntimeError):
    """The model's files cannot be found or fetched; the message says where we looked."""


def local_model_dir(location: str, cache_dir: Path | None = None, *,
                    endpoint_url: str | None = None) -> Path:
    """A local directory holding the model at `location` (a folder, `file://…`, `s3://…`, a
    `.gguf` file, a catalog name or a preset name); raises ModelUnavailable saying what was tried."""
    cache = cache_dir or model_cache_dir()
    if location.startswith("s3://"):
        if location.endswith(".gguf"):
            return imported_gguf_dir(_downloaded_file(location, cache, endpoint_url), cache)
        return _downloaded(location, cache, endpoint_url)
    path = Path(location.removeprefix("file://")).expanduser()
    if (path / "config.json").is_file():
        return path
    if path.suffix == ".gguf" and path.is_file():
        return imported_gguf_dir(path, cache)
    if location in CATALOG and not path.exists():
        try:
            return fetch_catalog_model(location, cache_dir=cache)
        except (CatalogError, GgufImportError) as error:
            raise ModelUnavailable(f"cannot fetch catalog model {location!r}: {error}") from None
    if location in PRESET_NAMES and not path.exists():
        return preset_checkpoint(location)
    if path.is_dir():
        raise ModelUnavailable(f"no model at {location}: {path / 'config.json'} does not exist")
    raise ModelUnavailable(f"no model at {location}: not a folder with config.json, a .gguf file, an "
                           f"s3:// URI, a catalog name ({', '.join(CATALOG)}) or a preset "
                           f"({', '.join(PRESET_NAMES)})")


def preset_checkpoint(name: str) -> Path:
    """The folder of preset `name`, built the first time (a second or two) and reused after that."""
    from bulkinfer.engine.checkpoints import cached_checkpoint  # torch: only when a preset is asked for

    return cached_checkpoint(preset=name, arch=PRESET_ARCH, seed=PRESET_SEED)


def built_preset(name: str) -> Path | None:
    """Preset `name`'s folder if it was built on this machine, else None (nothing is built)."""
    from bulkinfer.engine.checkpoints import cached_checkpoint_path, is_cached

    folder = cached_checkpoint_path(preset=name, arch=PRESET_ARCH, seed=PRESET_SEED)
    return folder if is_cached(folder) else None


def imported_gguf_dir(path: Path, cache_dir: Path) -> Path:
    """The folder a .gguf file was imported into, importing it the first time. Keyed by the file's
    sha256, so the same file under another name is imported once and a changed file again."""
    key = f"gguf-{file_sha256(path)[:16]}"
    target = cache_dir / key
    if (target / "config.json").is_file():
        return target
    with cache_lock(cache_dir, key):
        if (target / "config.json").is_file():
            return target
        try:
            return import_gguf(path, target, GGUF_IMPORT_DTYPE, overwrite=True)
        except GgufImportError as error:
            raise ModelUnavailable(f"cannot serve {path}: {error}") from None


def _downloaded_file(location: str, cache_dir: Path, endpoint_url: str | None) -> Path:
    """One object (a .gguf file) downloaded once into the cache."""
    digest = hashlib.sha256(location.encode()).hexdigest()[:16]
    target = cache_dir / "downloads" / f"{digest}-{location.rsplit('/', 1)[-1]}"
    if target.is_file():
        return target
    store, key = store_for_uri(location, endpoint_url=endpoint_url)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{target.name}.{os.getpid()}.part")
    try:
        with store.open_read(key) as source, open(staging, "wb") as sink:
            shutil.copyfileobj(source, sink, COPY_CHUNK)
        os.replace(staging, target)
    except Exception as error:
        if is_transient(error):
            raise
        raise ModelUnavailable(f"cannot download the model at {location}: {error}") from error
    finally:
        staging.unlink(missing_ok=True)
    return target


def _downloaded(location: str, cache_dir: Path, endpoint_url: str | None) -> Path:
    return downloaded_folder(location, cache_dir, endpoint_url, "config.json", "model")


def downloaded_folder(location: str, cache_dir: Path, endpoint_url: str | None, required: str,
                      what: str) -> Path:
    """The folder of objects under the `s3://…` prefix `location`, downloaded once into `cache_dir`
    and reused after that; `ModelUnavailable` when it cannot be fetched or lacks the file `required`
    (`what`: the model, or a LoRA adapter, for the message)."""
    prefix_uri = location.rstrip("/") + "/"
    digest = hashlib.sha256(prefix_uri.encode()).hexdigest()[:16]
    target = cache_dir / f"{prefix_uri.rstrip('/').rsplit('/', 1)[-1]}-{digest}"
    if (target / COMPLETE_MARKER).is_file():
        return target
    store, prefix = store_for_uri(prefix_uri, endpoint_url=endpoint_url)
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Download into a private folder and rename it into place, so two processes fetching the same
    # model at once never read each other's half-written files.
    staging = Path(tempfile.mkdtemp(prefix=".download-", dir=cache_dir))
    try:
        count = 0
        for info in store.list(prefix):
            relative = info.key[len(prefix):]
            if not relative or relative.endswith("/"):
                continue
            destination = staging / relative
            destination.parent.mkdir(parents=True, exist_ok=True)
            with store.open_read(info.key) as source, open(destination, "wb") as sink:
                shutil.copyfileobj(source, sink, COPY_CHUNK)
            count += 1
        if not (staging / required).is_file():
            raise ModelUnavailable(f"no {what} at {location}: {count} object(s) there, none is {required}")
        (staging / COMPLETE_MARKER).write_text(location)
        if target.exists():  # an unfinished earlier download, or another process won the race
            if (target / COMPLETE_MARKER).is_file():
                return target
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.replace(staging, target)
        except OSError:
            if not (target / COMPLETE_MARKER).is_file():
                raise
        return target
    except ModelUnavailable:
        raise
    except Exception as error:
        if is_transient(error):  # the store is down for a moment: the task retries
            raise
        raise ModelUnavailable(f"cannot download the {what} at {location}: {error}") from error
    finally:
        shutil.rmtree(staging, ignore_errors=True)
