"""`bulkinfer kv ls|rm`: what the prefix KV tier holds in the object store, and deleting it.

Reads the store the settings name (`kv_store_uri`, else the job store; `s3_endpoint_url`), as the
workers write it, so it works from any machine with the store's credentials: no worker, no engine.
`ls` names the model of each namespace where the served model's folder (`models`) is on this machine.
"""

from __future__ import annotations

import argparse
import sys
import time

from bulkinfer.jobs.layout import KV_STORE_AREA
from bulkinfer.jobs.settings import ConfigError, Settings
from bulkinfer.jobs.settings_args import add_settings_arguments, settings_from_args
from bulkinfer.worker.kv.store import open_kv_blobs

ROOT = f"{KV_STORE_AREA}/"
STORE_SETTINGS = ("store_uri", "kv_store_uri", "s3_endpoint_url", "models")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bulkinfer kv", description="The prefix KV blocks workers saved "
                                     "to the object store: list them per model namespace, or delete them.")
    commands = parser.add_subparsers(dest="command", required=True)
    listing = commands.add_parser("ls", help="namespaces (model, dtype, tensor-parallel rank, block size) "
                                  "with their blocks, bytes and last write")
    listing.add_argument("prefix", nargs="?", default=ROOT, help=f"only namespaces under it (default {ROOT})")
    add_settings_arguments(listing, STORE_SETTINGS)
    removing = commands.add_parser("rm", help="delete the blocks under a namespace (as `kv ls` prints it)")
    which = removing.add_mutually_exclusive_group(required=True)
    which.add_argument("prefix", nargs="?", help=f"a namespace or any prefix under {ROOT}")
    which.add_argument("--all", action="store_true", help="every stored block of every model")
    add_settings_arguments(removing, STORE_SETTINGS)
    return parser


def kv_cli(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    prefix = ROOT if getattr(args, "all", False) else args.prefix
    if not prefix.startswith(ROOT):
        print(f"bulkinfer kv {args.command}: {prefix!r} is not a KV prefix: namespaces start with {ROOT!r} "
              "(see `bulkinfer kv ls`)", file=sys.stderr)
        return 2
    try:
        settings = settings_from_args(args)
        blobs = open_kv_blobs(settings, fail_fast=False)
    except (ConfigError, ValueError) as error:
        print(f"bulkinfer kv {args.command}: {error}", file=sys.stderr)
        return 2
    from bulkinfer.engine.kv_connector.catalog import list_entries, remove

    where = blobs.store.uri(blobs.prefix + prefix)
    if args.command == "rm":
        print(f"deleted {remove(blobs, prefix)} blocks under {where}")
        return 0
    entries = list_entries(blobs, prefix=prefix)
    print(f"store: {where}")
    if not entries:
        print("no blocks stored")
        return 0
    names = _served_model_digests(settings)
    print(f"{'namespace':<60} {'model':<16} {'blocks':>8} {'bytes':>12}  last write (UTC)")
    for entry in entries:
        model = names.get(entry.namespace.split("/")[1], "-")
        print(f"{entry.namespace:<60} {model:<16} {entry.blocks:>8} {_size(entry.bytes):>12}  "
              f"{_when(entry.last_used)}")
    total_bytes = sum(entry.bytes for entry in entries)
    print(f"total: {sum(entry.blocks for entry in entries)} blocks, {_size(total_bytes)}")
    return 0


def _served_model_digests(settings: Settings) -> dict[str, str]:
    """{namespace model digest: served model name} for the served models whose folders are on this
    machine (a namespace names its model by a digest of its weights: engine/kv_connector/keys.py)."""
    from bulkinfer.engine.kv_connector.keys import namespace
    from bulkinfer.engine.kv_connector.model_identity import model_identity
    from bulkinfer.worker.models.model_commands import local_model_folder

    registry = settings.model_registry()
    names = {}
    for name in registry.names():
        folder = local_model_folder(registry.location(name))
        if folder is not None:
            names[namespace(model_identity(folder), "float32", 0, 1, 16).split("/")[1]] = name
    return names


def _size(count: float) -> str:
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    step = 0
    while count >= 1024 and step < len(units) - 1:
        count, step = count / 1024, step + 1
    return f"{count:.0f} B" if step == 0 else f"{count:.1f} {units[step]}"


def _when(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(seconds)) if seconds else "-"
