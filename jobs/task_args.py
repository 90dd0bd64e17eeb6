"""Command-line flags of a job's task, shared by `bulkinfer submit` and `bulkinfer run`."""

from __future__ import annotations

import argparse

# The spec fields these flags set (each flag's dest is the field's name; None: not given).
TASK_FIELDS = ("task", "dimensions", "truncate", "max_length", "pooling", "normalize", "apply_chat_template")


def add_task_arguments(parser: argparse.ArgumentParser) -> None:
    """--task, --dimensions, --truncate, --max-length, --pooling, --normalize and
    --[no-]apply-chat-template: what the job does with each prompt."""
    parser.add_argument("--apply-chat-template", action=argparse.BooleanOptionalAction, default=None,
                        help="--prompt-column/--template rows: through the model's chat template "
                             "(instructions as the system message; default: when the model has one) or, "
                             "with --no-apply-chat-template, as raw completion prompts")
    parser.add_argument("--task", choices=["generate", "embed"],
                        help="generate text (default) or embed each prompt as one vector (an embedding "
                             "model)")
    parser.add_argument("--dimensions", type=int, help="embed: keep the first N values of each vector, "
                        "renormalised (Matryoshka models)")
    parser.add_argument("--truncate", action="store_true", default=None,
                        help="embed: cut inputs longer than the model's maximum (default: such a row fails)")
    parser.add_argument("--max-length", type=int, dest="max_length",
                        help="embed: at most N tokens per input, within the model's maximum (default: the "
                             "model's)")
    parser.add_argument("--pooling", choices=["mean", "cls", "last"],
                        help="embed: how token vectors become one (default: the checkpoint's "
                             "sentence-transformers files, else last for a decoder, mean for an encoder)")
    parser.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                        help="embed: unit-length vectors (default: the checkpoint's files, else yes)")
