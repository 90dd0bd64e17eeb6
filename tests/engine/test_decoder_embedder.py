"""Decoder models as embedders (Qwen3-Embedding style): our packed causal forward, pooled, against
transformers' AutoModel hidden states pooled the same way, one unpadded sequence at a time."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from bulkinfer.engine.embedder import Embedder, is_embedding_model

TEXTS = ["def f(x): return x", "import os", "class A: pass", "a", "for i in range(10): print(i) # loop",
         "import re", "x = [1, 2, 3]"]


def _reference(model_dir: Path, sequences: list[list[int]], pooling: str) -> np.ndarray:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    vectors = []
    with torch.inference_mode():
        for ids in sequences:
            hidden = model(torch.tensor([ids])).last_hidden_state[0]  # after the final norm
            vector = hidden[-1] if pooling == "last" else hidden.mean(0)
            vectors.append(torch.nn.functional.normalize(vector, dim=0).numpy())
    return np.asarray(vectors, dtype=np.float64)


@pytest.mark.parametrize("arch,pooling", [("llama", "last"), ("qwen3", "last"), ("qwen2", "mean"),
                                          ("mistral", "mean"), ("gemma3", "last"), ("phi3", "mean"),
                                          ("qwen3_moe", "last"), ("mixtral", "mean")])
def test_decoder_embeddings_match_transformers(checkpoint_factory, arch: str, pooling: str) -> None:
    model_dir = checkpoint_factory(arch=arch)
    assert not is_embedding_model(model_dir)  # a generator; it embeds when asked to
    embedder = Embedder.load(model_dir, dtype="float32", pooling=pooling)
    assert embedder.config.pooling == pooling and embedder.config.normalize
    embedder.batch_tokens = 24  # several packed passes
    outputs = embedder.embed(TEXTS)
    reference = _reference(model_dir, [embedder.tokenize(t) for t in TEXTS], pooling)
    ours = np.asarray([o.embedding for o in outputs], dtype=np.float64)
    cosines = (ours * reference).sum(1)
    assert cosines.min() >= 0.99999, cosines
    np.testing.assert_allclose(ours, reference, atol=2e-5)


def test_a_decoder_defaults_to_last_token_pooling(tiny_checkpoint: Path) -> None:
    embedder = Embedder.load(tiny_checkpoint, dtype="float32")
    assert embedder.config.pooling == "last"
    assert embedder.config.max_length == 2048 and embedder.config.dimension > 0
