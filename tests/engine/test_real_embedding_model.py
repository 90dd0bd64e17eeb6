"""all-MiniLM-L6-v2 (the catalog's embedding model) against sentence-transformers' own ``encode``:
fp32 everywhere, bf16 where the CPU multiplies bf16 natively (the dtype ``auto`` then chooses)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from bulkinfer.benchmarks.embed_corpus import mixed_length_texts
from bulkinfer.engine.dtype_choice import resolve_dtype
from bulkinfer.engine.embedder import Embedder

HAND_WRITTEN = [
    "A man is eating food.",
    "a",
    "",
    "The new movie is awesome!!!",
    "def embed(texts): return [model(t) for t in texts]  # code, too",
    "Ünïcödé, emoji 🙂 and 日本語のテキスト",
    "   leading and trailing spaces   ",
    "numbers: 3.14159, 2026-12-05, #42, $1,000,000",
    "word " * 400,  # longer than the model's 256 tokens: truncated when asked
]


@pytest.fixture(scope="module")
def texts(real_embedding_model: Path) -> list[str]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(real_embedding_model))
    return HAND_WRITTEN + mixed_length_texts(tokenizer, 40, min_tokens=5, max_tokens=250, seed=7)


def _reference(folder: Path, texts: list[str], dtype: torch.dtype) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu", model_kwargs={"dtype": dtype})
    return model.encode(texts, batch_size=16, convert_to_numpy=True).astype(np.float64)


def _cosines(ours: list[list[float]], reference: np.ndarray) -> np.ndarray:
    a = np.asarray(ours, dtype=np.float64)
    return (a * reference).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(reference, axis=1)


def test_the_catalog_model_is_read_from_its_sentence_transformers_files(real_embedding_model: Path) -> None:
    embedder = Embedder.load(real_embedding_model, dtype="float32")
    config = embedder.config
    assert (config.pooling, config.normalize, config.max_length, config.dimension) == ("mean", True, 256, 384)
    with pytest.raises(ValueError, match="more than the model's maximum of 256"):
        embedder.embed(HAND_WRITTEN)


def test_fp32_matches_sentence_transformers(real_embedding_model: Path, texts: list[str]) -> None:
    embedder = Embedder.load(real_embedding_model, dtype="float32")
    outputs = embedder.embed(texts, truncate=True)
    assert outputs[8].prompt_tokens == 256  # the long text, cut to the model's maximum
    cosines = _cosines([o.embedding for o in outputs], _reference(real_embedding_model, texts, torch.float32))
    assert cosines.min() >= 0.99999, cosines.argmin()
    norms = np.linalg.norm(np.asarray([o.embedding for o in outputs]), axis=1)
    np.testing.assert_allclose(norms, 1.0, atol=1e-5)


def test_bf16_matches_sentence_transformers_where_the_cpu_has_native_bf16(
        real_embedding_model: Path, texts: list[str]) -> None:
    auto = Embedder.load(real_embedding_model)  # dtype "auto": what a worker runs
    # auto's rule on this CPU (its flags, or the verdict this test session measured for it)
    if resolve_dtype("auto", "cpu", None).dtype == "float32":
        assert auto.dtype == torch.float32
        return
    assert auto.dtype == torch.bfloat16
    vectors = [o.embedding for o in auto.embed(texts, truncate=True)]
    same_dtype = _cosines(vectors, _reference(real_embedding_model, texts, torch.bfloat16))
    assert same_dtype.min() >= 0.999, same_dtype.argmin()
    full_precision = _cosines(vectors, _reference(real_embedding_model, texts, torch.float32))
    assert full_precision.min() >= 0.999, full_precision.argmin()
