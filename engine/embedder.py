"""Text -> one vector per text, for embedding models (BERT family) and decoders used as embedders.

```python
embedder = Embedder.load("path/to/all-minilm-l6-v2")
vectors = [out.embedding for out in embedder.embed(["a sentence", "another one"])]
```

Batches are packed: sequences laid end to end with no padding, longest first, attention per
sequence (engine/models/bert.py). Pooling, normalisation and the maximum length come from the
checkpoint (engine/pooling.py); one call may pool and normalize otherwise
(``embed_token_ids(batch, pooling=..., normalize=...)``) where the checkpoint leaves it free, so one
loaded model serves jobs that ask differently. The compute dtype is chosen as the LLMEngine chooses it
(engine/dtype_choice.py); vectors are always float32.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import torch

from bulkinfer.engine.cpu_kernels import load as load_cpu_kernels
from bulkinfer.engine.dtype_choice import DtypeChoice, checkpoint_dtype, resolve_dtype
from bulkinfer.engine.models.bert import encoder_family, load_bert
from bulkinfer.engine.models.llama import LlamaForCausalLM
from bulkinfer.engine.models.llama_config import UnsupportedModelError
from bulkinfer.engine.models.loader import SUPPORTED_ARCHITECTURES, load_model
from bulkinfer.engine.packed_attention import PackedBatch, PackedCausalBackend
from bulkinfer.engine.pooling import (
    POOLINGS,
    Pooling,
    PoolingConfig,
    SentenceTransformersFiles,
    pool,
    read_sentence_transformers,
    resolve_pooling_config,
)

__all__ = ["EmbeddingOutput", "Embedder", "PoolingConfig", "is_embedding_model"]

logger = logging.getLogger(__name__)

# Tokens per forward pass: few enough that a layer's activations stay in cache between its GEMMs,
# enough that per-call costs vanish. With attention in one native call per pass (no per-length SDPA
# calls any more), on all-MiniLM-L6-v2 on a 2-core AMX machine 4k-token passes ran 1.26x (bf16) and
# 1.12x (fp32) faster than 16k, and oneDNN's bf16 GEMMs of MiniLM's shapes ran ~2x faster at 4k rows
# than at 16k; 2k was no faster than 4k.
DEFAULT_BATCH_TOKENS = 4096


@dataclass(frozen=True)
class EmbeddingOutput:
    embedding: list[float]  # float32 values; normalized when the config says so
    prompt_tokens: int


class PackedModel(Protocol):
    def __call__(self, batch: PackedBatch) -> torch.Tensor: ...


def _read_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: a model folder needs config.json")
    return json.loads(path.read_text())


def is_embedding_model(model_dir: str | Path) -> bool:
    """Whether the folder holds an embedding model: a BERT-family encoder, or any checkpoint with
    sentence-transformers files (``modules.json``)."""
    folder = Path(model_dir)
    if (folder / "modules.json").is_file():
        return True
    try:
        return encoder_family(_read_config(folder)) is not None
    except (OSError, ValueError):
        return False


class Embedder:
    """A loaded embedding model: ``embed(texts)`` or ``embed_token_ids(batch)``."""

    batch_tokens: int = DEFAULT_BATCH_TOKENS

    def __init__(self, model: PackedModel, tokenizer: Any, config: PoolingConfig, dtype_choice: DtypeChoice,
                 vocab_size: int, lower_case: bool = False, fixed_pooling: str | None = None) -> None:
        """``fixed_pooling``: the pooling the checkpoint's sentence-transformers files fix (the model
        was trained with it), which no call may change; None when they say none."""
        self.model = model
        self.fixed_pooling = fixed_pooling
        self.tokenizer = tokenizer
        self.config = config
        self.dtype_choice = dtype_choice
        self.dtype: torch.dtype = dtype_choice.torch_dtype
        self.vocab_size = vocab_size
        self.lower_case = lower_case

    @classmethod
    def load(cls, model_dir: str | Path, *, dtype: str = "auto", device: str = "cpu",
             pooling: str | None = None, normalize: bool | None = None, dtype_verdicts: str | None = None,
             remeasure_dtype: bool = False) -> Embedder:
        """Load ``model_dir`` (a Hugging Face folder). ``pooling`` ("mean" | "cls" | "last") and
        ``normalize`` apply where the checkpoint's sentence-transformers files do not say.
        ``dtype_verdicts``, ``remeasure_dtype``: as `EngineConfig`'s, for ``dtype="auto"``."""
        from transformers import AutoTokenizer  # tokenizer only; the model is our own

        folder = Path(model_dir)
        hf_config = _read_config(folder)
        st_files = read_sentence_transformers(folder)
        dtype_choice = resolve_dtype(dtype, device, checkpoint_dtype(folder), verdicts=dtype_verdicts,
                                     remeasure=remeasure_dtype)
        logger.info("embedder dtype %s (%s)", dtype_choice.dtype, dtype_choice.reason)
        model: PackedModel
        default_pooling: Pooling
        if encoder_family(hf_config) is not None:
            encoder = load_bert(folder, hf_config, dtype_choice.torch_dtype, device,
                                batch_hint=cls.batch_tokens)
            model, default_pooling = encoder, "mean"
            sizes = (encoder.config.max_tokens, encoder.config.hidden_size, encoder.config.vocab_size)
        elif any(a in SUPPORTED_ARCHITECTURES for a in hf_config.get("architectures") or []):
            kernels = load_cpu_kernels() if torch.device(device).type == "cpu" else None
            decoder = PackedDecoder(load_model(folder, PackedCausalBackend(kernels), dtype_choice.torch_dtype,
                                               device, batch_hint=cls.batch_tokens))
            # Causal attention: only the last token has seen the whole text (Qwen3-Embedding's pooling).
            model, default_pooling = decoder, "last"
            c = decoder.model.config
            sizes = (c.max_position_embeddings, c.hidden_size, c.vocab_size)
        else:
            raise UnsupportedModelError(
                f"{folder}: architectures {hf_config.get('architectures')} cannot embed (supported: BERT, "
                f"RoBERTa and XLM-RoBERTa encoders, and the decoders {sorted(SUPPORTED_ARCHITECTURES)})"
            )
        position_limit, dimension, vocab_size = sizes
        config = resolve_pooling_config(
            st_files, pooling=pooling, normalize=normalize, position_limit=position_limit,
            dimension=dimension, default_pooling=default_pooling,
        )
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        fixed_pooling = st_files.pooling if st_files is not None else None
        return cls(model, tokenizer, config, dtype_choice, vocab_size, _lower_case(st_files), fixed_pooling)

    def tokenize(self, text: str) -> list[int]:
        """The text's token ids with the model's special tokens, not truncated."""
        return list(self.tokenizer(self._prepare(text), add_special_tokens=True)["input_ids"])

    def embed(self, texts: Sequence[str], *, truncate: bool = False) -> list[EmbeddingOutput]:
        """One output per text, in order. A text longer than ``config.max_length`` tokens raises
        ValueError, unless ``truncate``: then its first tokens are kept (special tokens included)."""
        if isinstance(texts, str):
            raise TypeError("embed takes a sequence of texts, not one string")
        return self.embed_token_ids(self.tokenize_batch(texts, truncate=truncate)) if texts else []

    def tokenize_batch(self, texts: Sequence[str], *, truncate: bool = False) -> list[list[int]]:
        """``tokenize`` of many texts at once; ``truncate``: each cut to ``config.max_length``
        tokens (special tokens kept)."""
        limit: dict[str, Any] = {"truncation": True, "max_length": self.config.max_length} if truncate else {}
        prepared = [self._prepare(t) for t in texts]
        return [list(ids) for ids in self.tokenizer(prepared, add_special_tokens=True, **limit)["input_ids"]]

    def pooling_config(self, pooling: str | None = None, normalize: bool | None = None) -> PoolingConfig:
        """``config`` with this call's ``pooling`` and ``normalize`` (None: the loaded one's). A pooling
        other than the one the checkpoint fixes (``fixed_pooling``) raises ValueError: the vectors
        would not be the model's. ``normalize`` always applies: it is a step after pooling, as in
        sentence-transformers' ``encode(normalize_embeddings=...)``."""
        if pooling is not None and pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
        if pooling is not None and self.fixed_pooling is not None and pooling != self.fixed_pooling:
            raise ValueError(f"pooling {pooling!r} differs from the model's: its sentence-transformers files "
                             f"fix {self.fixed_pooling!r} pooling, which it was trained with")
        changes: dict[str, Any] = {}
        if pooling is not None:
            changes["pooling"] = pooling
        if normalize is not None:
            changes["normalize"] = normalize
        return replace(self.config, **changes) if changes else self.config

    def embed_token_ids(self, batch: Sequence[Sequence[int]], *, pooling: str | None = None,
                        normalize: bool | None = None) -> list[EmbeddingOutput]:
        """One output per token-id sequence, in order, pooled and normalized as ``pooling_config``
        says for ``pooling`` and ``normalize``. Raises ValueError for a pooling the checkpoint does
        not allow, or naming the first sequence that is empty, longer than ``config.max_length`` or
        holds an id outside the vocabulary."""
        config = self.pooling_config(pooling, normalize)
        sequences = [list(s) for s in batch]
        for index, ids in enumerate(sequences):
            self._check(index, ids)
        order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
        vectors: list[torch.Tensor | None] = [None] * len(sequences)
        with torch.inference_mode():
            for chunk in self._chunks(order, sequences):
                packed = PackedBatch.build([sequences[i] for i in chunk])
                pooled = pool(self.model(packed), packed.lengths, config)
                for row, index in enumerate(chunk):
                    vectors[index] = pooled[row]
        return [EmbeddingOutput(v.tolist(), len(s)) for v, s in zip(vectors, sequences, strict=True)]  # type: ignore[union-attr]

    def _chunks(self, order: list[int], sequences: list[list[int]]) -> list[list[int]]:
        """Consecutive runs of ``order`` (longest first) of at most ``batch_tokens`` tokens each
        (a sequence longer than that alone)."""
        chunks: list[list[int]] = []
        current: list[int] = []
        tokens = 0
        for index in order:
            n = len(sequences[index])
            if current and tokens + n > self.batch_tokens:
                chunks.append(current)
                current, tokens = [], 0
            current.append(index)
            tokens += n
        if current:
            chunks.append(current)
        return chunks

    def _check(self, index: int, ids: list[int]) -> None:
        if not ids:
            raise ValueError(f"input {index} is empty: nothing to embed")
        if len(ids) > self.config.max_length:
            raise ValueError(f"input {index} has {len(ids)} tokens, "
                             f"more than the model's maximum of {self.config.max_length}")
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"input {index} holds token id {bad!r}, "
                             f"outside the vocabulary [0, {self.vocab_size})")

    def _prepare(self, text: str) -> str:
        return text.lower() if self.lower_case else text


class PackedDecoder:
    """A decoder model (engine/models/llama.py) run over a packed batch: causal attention per
    sequence, no KV cache; returns the final hidden states (after the final norm)."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        self.no_cache = [torch.empty(2, 0)] * model.config.num_layers

    def __call__(self, batch: PackedBatch) -> torch.Tensor:
        return self.model(batch.input_ids, batch.positions, batch, self.no_cache)  # type: ignore[arg-type]


def _lower_case(files: SentenceTransformersFiles | None) -> bool:
    return files is not None and files.do_lower_case
