"""Command-line flags of a job's task, shared by `bulkinfer submit` and `bulkinfer run`."""

from __future__ import annotations

import argparse


def add_task_arguments(parser: argparse.ArgumentParser) -> None:
    """--task, --dimensions and --truncate: what the job does with each prompt."""
    parser.add_argument("--task", choices=["generate", "embed"],
                        help="generate text (default) or embed each prompt as one vector (an embedding "
                             "model)")
    parser.add_argument("--dimensions", type=int, help="embed: keep the first N values of each vector, "
                        "renormalised (Matryoshka models)")
    parser.add_argument("--truncate", action="store_true", default=None,
                        help="embed: cut inputs longer than the model's maximum (default: such a row fails)")
