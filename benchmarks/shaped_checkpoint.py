"""Random weights in a real model's shape, for benchmarks on machines its weights cannot reach.

A lent GPU machine has no network and takes a small working tree, so a real checkpoint cannot travel
there; its `config.json` and tokenizer can. Throughput does not depend on the weights' values
(benchmarks ignore EOS and fix every output length), so a model of the same shape with random
weights measures what the real one would. `--set` changes the shape (a 1B-class model under the
same tokenizer, say):

    python -m bulkinfer.benchmarks.shaped_checkpoint SOURCE OUT [--set hidden_size=2048 num_hidden_layers=16
    ...]
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

import torch

# What a checkpoint folder holds besides its weights and config (the files that exist are copied).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json", "vocab.json", "merges.txt",
                   "tokenizer.model")


def parse_overrides(items: list[str]) -> dict[str, int | float | str]:
    """`["hidden_size=2048", "rms_norm_eps=1e-5"]` -> {"hidden_size": 2048, "rms_norm_eps": 1e-05}."""
    overrides: dict[str, int | float | str] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected NAME=VALUE")
        value: int | float | str = text
        for kind in (int, float):
            try:
                value = kind(text)
                break
            except ValueError:
                continue
        overrides[key] = value
    return overrides


def build_shaped_checkpoint(source: str | Path, out: str | Path,
                            overrides: Mapping[str, object] | None = None,
                            *, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                            device: str = "cpu") -> Path:
    """Write `out`: `source`'s config (with `overrides`) and tokenizer, and random weights of that shape."""
    from transformers import AutoConfig, AutoModelForCausalLM

    source, out, overrides = Path(source), Path(out), dict(overrides or {})
    config = AutoConfig.from_pretrained(source)
    for key, value in overrides.items():
        if not hasattr(config, key):
            raise ValueError(f"{source / 'config.json'} has no setting {key!r} to change")
        setattr(config, key, value)
    if "hidden_size" in overrides or "num_attention_heads" in overrides:
        config.head_dim = config.hidden_size // config.num_attention_heads
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, max_shard_size="1000GB")  # one file: what count_parameters reads
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bulkinfer.benchmarks.shaped_checkpoint",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="a folder with config.json and the tokenizer "
                        "(weights unused)")
    parser.add_argument("out", type=Path, help="the folder to write")
    parser.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE", help="config changes")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--device", default="cpu", help="where to draw the weights (cuda is faster for 1B+)")
    args = parser.parse_args(argv)
    try:
        overrides = parse_overrides(args.set)
        path = build_shaped_checkpoint(args.source, args.out, overrides, dtype=getattr(torch, args.dtype),
                                       device=args.device)
    except (OSError, ValueError) as exc:
        print(f"shaped_checkpoint: {exc}", file=sys.stderr)
        return 2
    from bulkinfer.engine.checkpoints import count_parameters

    print(f"{path}: {count_parameters(path):,} parameters")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
