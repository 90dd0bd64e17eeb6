"""How an embedding model turns hidden states into one vector: pooling, normalisation, max length.

Read from the checkpoint's sentence-transformers files when present (``modules.json``,
``<pooling folder>/config.json``, ``sentence_bert_config.json``; sentence-transformers 2 to 6
layouts), else from the caller's arguments, else the defaults: mean pooling (last-token for a
decoder model, whose causal attention leaves only the last token seeing the whole text), normalized,
as many tokens as the position embeddings allow.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F

from bulkinfer.engine.models.llama_config import UnsupportedModelError

logger = logging.getLogger(__name__)

Pooling = Literal["mean", "cls", "last"]
POOLINGS: tuple[str, ...] = ("mean", "cls", "last")
# sentence-transformers' pooling mode names -> ours.
_ST_POOLING = {"mean": "mean", "cls": "cls", "lasttoken": "last"}
_ST_LEGACY_KEYS = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
                   "pooling_mode_lasttoken": "last", "pooling_mode_max_tokens": "max",
                   "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                   "pooling_mode_weightedmean_tokens": "weightedmean"}
# A tokenizer's model_max_length when it sets none (transformers' VERY_LARGE_INTEGER).
_NO_TOKENIZER_LIMIT = 10**9


@dataclass(frozen=True)
class PoolingConfig:
    pooling: Pooling
    normalize: bool
    max_length: int  # tokens, incl. special tokens
    dimension: int  # the model's embedding size


@dataclass(frozen=True)
class SentenceTransformersFiles:
    """What a checkpoint's sentence-transformers files say (None: they do not say)."""

    pooling: str | None
    normalize: bool
    max_length: int | None
    do_lower_case: bool


def _module_kind(type_name: str) -> str:
    return type_name.rsplit(".", 1)[-1]


def read_sentence_transformers(model_dir: str | Path) -> SentenceTransformersFiles | None:
    """The checkpoint's sentence-transformers settings; None without ``modules.json``. A module
    or pooling mode we do not compute (Dense, max pooling, ...) raises UnsupportedModelError: its
    vectors would differ from the model's."""
    folder = Path(model_dir)
    modules_path = folder / "modules.json"
    if not modules_path.is_file():
        return None
    modules: list[dict[str, Any]] = json.loads(modules_path.read_text())
    pooling: str | None = None
    normalize = False
    for module in modules:
        kind = _module_kind(module.get("type", ""))
        if kind == "Transformer":
            continue
        if kind == "Normalize":
            normalize = True
        elif kind == "Pooling":
            pooling = _read_pooling(folder / module.get("path", "") / "config.json")
        else:
            raise UnsupportedModelError(
                f"{modules_path}: sentence-transformers module {module.get('type')!r} is not supported "
                "(supported: Transformer, Pooling, Normalize)"
            )
    bert_config_path = folder / "sentence_bert_config.json"
    bert_config = json.loads(bert_config_path.read_text()) if bert_config_path.is_file() else {}
    max_length = bert_config.get("max_seq_length")
    if max_length is None:  # sentence-transformers >= 6 keeps it as the tokenizer's model_max_length
        tokenizer_config_path = folder / "tokenizer_config.json"
        if tokenizer_config_path.is_file():
            limit = json.loads(tokenizer_config_path.read_text()).get("model_max_length")
            max_length = limit if isinstance(limit, int) and limit < _NO_TOKENIZER_LIMIT else None
    return SentenceTransformersFiles(pooling, normalize, max_length, bool(bert_config.get("do_lower_case")))


def _read_pooling(path: Path) -> str:
    config = json.loads(path.read_text()) if path.is_file() else {}
    mode = config.get("pooling_mode")
    if mode is None:
        legacy = [name for key, name in _ST_LEGACY_KEYS.items() if config.get(key)]
        mode = legacy if legacy else "mean"
    modes = [mode] if isinstance(mode, str) else list(mode)
    if len(modes) != 1 or modes[0] not in (*_ST_POOLING, *POOLINGS):
        raise UnsupportedModelError(
            f"{path}: pooling {modes} is not supported (supported: one of mean, cls, lasttoken)"
        )
    return _ST_POOLING.get(modes[0], modes[0])


def resolve_pooling_config(
    files: SentenceTransformersFiles | None,
    *,
    pooling: str | None,
    normalize: bool | None,
    position_limit: int,
    dimension: int,
    default_pooling: Pooling,
) -> PoolingConfig:
    """The checkpoint's sentence-transformers files first (the model was trained with them), then
    the caller's arguments, then the defaults. An argument the files contradict is logged and
    ignored."""
    if pooling is not None and pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    chosen_pooling = pooling or default_pooling
    chosen_normalize = True if normalize is None else normalize
    max_length = position_limit
    if files is not None:
        if files.pooling is not None:
            if pooling is not None and pooling != files.pooling:
                logger.warning("pooling=%r ignored: the checkpoint's sentence-transformers files say %r",
                               pooling, files.pooling)
            chosen_pooling = files.pooling
        if normalize is not None and normalize != files.normalize:
            logger.warning("normalize=%r ignored: the checkpoint's sentence-transformers files say %r",
                           normalize, files.normalize)
        chosen_normalize = files.normalize
        if files.max_length is not None:
            max_length = min(files.max_length, position_limit)
    return PoolingConfig(chosen_pooling, chosen_normalize, max_length, dimension)  # type: ignore[arg-type]


def pool(hidden: torch.Tensor, lengths: tuple[int, ...], config: PoolingConfig) -> torch.Tensor:
    """One float32 vector per packed sequence ([len(lengths), hidden]) from the hidden states of
    the sequences laid end to end."""
    lengths_t = torch.tensor(lengths, dtype=torch.long)
    ends = torch.cumsum(lengths_t, 0)
    starts = ends - lengths_t
    if config.pooling == "cls":
        vectors = hidden.index_select(0, starts).float()
    elif config.pooling == "last":
        vectors = hidden.index_select(0, ends - 1).float()
    else:
        owner = torch.repeat_interleave(torch.arange(len(lengths)), lengths_t)
        sums = torch.zeros(len(lengths), hidden.shape[1], dtype=torch.float32)
        sums.index_add_(0, owner, hidden.float())
        vectors = sums / lengths_t.unsqueeze(1).to(torch.float32)
    return F.normalize(vectors, p=2, dim=1) if config.normalize else vectors
