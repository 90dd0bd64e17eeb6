"""Embedder on tiny BERT / XLM-RoBERTa sentence-transformers checkpoints, against
sentence-transformers' own ``encode`` (fp32)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from bulkinfer.engine.embedder import Embedder, is_embedding_model
from bulkinfer.engine.models.llama_config import UnsupportedModelError
from tests.fixtures.encoder_checkpoints import build_sentence_transformer

TEXTS = [
    "the cat sat on the mat",
    "a",
    "embedding the corpus: search and dedup",
    "hello world",
    "hello there",  # same token count as the one above: one attention call for both
    "x" * 40,
    "numbers 1234 and punctuation!?",
    "",
]


def _reference(folder: Path, texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu")
    return model.encode(texts, batch_size=3, convert_to_numpy=True)


def _cosines(ours: list[list[float]], reference: np.ndarray) -> np.ndarray:
    a = np.asarray(ours, dtype=np.float64)
    b = reference.astype(np.float64)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_sentence_transformer(tmp_path_factory.mktemp("bert"), family="bert")


@pytest.mark.parametrize("family,pooling,normalize", [
    ("bert", "mean", True), ("bert", "cls", False), ("xlm-roberta", "mean", True),
    ("bert", "lasttoken", True),
])
def test_matches_sentence_transformers_fp32(tmp_path: Path, family: str, pooling: str,
                                            normalize: bool) -> None:
    folder = build_sentence_transformer(tmp_path, family=family, pooling=pooling, normalize=normalize, seed=3)
    embedder = Embedder.load(folder, dtype="float32")
    assert embedder.config.pooling == {"lasttoken": "last"}.get(pooling, pooling)
    assert embedder.config.normalize is normalize
    assert embedder.config.dimension == 32 and embedder.config.max_length == 48
    outputs = embedder.embed(TEXTS)
    reference = _reference(folder, TEXTS)
    vectors = [o.embedding for o in outputs]
    assert _cosines(vectors, reference).min() >= 0.99999
    # Not only the direction: the vectors themselves (norms too, where not normalized).
    np.testing.assert_allclose(np.asarray(vectors), reference, rtol=1e-4, atol=1e-5)
    assert [o.prompt_tokens for o in outputs] == [len(embedder.tokenize(t)) for t in TEXTS]
    assert all(isinstance(x, float) for x in outputs[0].embedding)


def test_batch_composition_does_not_change_a_vector(bert_dir: Path) -> None:
    embedder = Embedder.load(bert_dir, dtype="float32")
    alone = [embedder.embed([t])[0].embedding for t in TEXTS]
    embedder.batch_tokens = 16  # several forward passes, sequences split across them
    together = [o.embedding for o in embedder.embed(TEXTS)]
    np.testing.assert_allclose(np.asarray(together), np.asarray(alone), atol=1e-6)


def test_too_long_input_is_an_error_unless_truncated(bert_dir: Path) -> None:
    embedder = Embedder.load(bert_dir, dtype="float32")
    long_text = "word " * 60
    assert len(embedder.tokenize(long_text)) > 48  # tokenize never truncates
    with pytest.raises(ValueError, match="input 1 has .* tokens, more than the model's maximum of 48"):
        embedder.embed(["short", long_text])
    truncated = embedder.embed(["short", long_text], truncate=True)
    assert truncated[1].prompt_tokens == 48
    reference = _reference(bert_dir, [long_text])  # sentence-transformers truncates to max_seq_length
    assert _cosines([truncated[1].embedding], reference).min() >= 0.99999


def test_bad_token_ids_are_named(bert_dir: Path) -> None:
    embedder = Embedder.load(bert_dir, dtype="float32")
    with pytest.raises(ValueError, match="input 1 is empty"):
        embedder.embed_token_ids([[2, 3], []])
    with pytest.raises(ValueError, match="input 0 holds token id 9999, outside the vocabulary"):
        embedder.embed_token_ids([[2, 9999, 3]])
    ids = embedder.tokenize("the cat")
    assert embedder.embed_token_ids([ids])[0].embedding == embedder.embed(["the cat"])[0].embedding


def test_load_arguments_apply_without_sentence_transformers_files(bert_dir: Path, tmp_path: Path) -> None:
    bare = bert_dir.parent / "encoder"  # the plain transformers folder the st folder was made from
    assert is_embedding_model(bare) and is_embedding_model(bert_dir)
    default = Embedder.load(bare, dtype="float32")
    assert (default.config.pooling, default.config.normalize, default.config.max_length) == ("mean", True, 64)
    cls_raw = Embedder.load(bare, dtype="float32", pooling="cls", normalize=False)
    assert (cls_raw.config.pooling, cls_raw.config.normalize) == ("cls", False)
    vector = np.asarray(cls_raw.embed(["the cat"])[0].embedding)
    assert abs(np.linalg.norm(vector) - 1.0) > 1e-3  # not normalized
    # The sentence-transformers files win over the arguments (the model was trained that way).
    st = Embedder.load(bert_dir, dtype="float32", pooling="cls", normalize=False)
    assert (st.config.pooling, st.config.normalize) == ("mean", True)


def test_unsupported_checkpoints_are_refused_with_a_reason(bert_dir: Path, tmp_path: Path,
                                                           tiny_checkpoint: Path) -> None:
    assert not is_embedding_model(tiny_checkpoint)
    dense = tmp_path / "dense"
    dense.mkdir()
    for f in bert_dir.iterdir():
        if f.is_file():
            (dense / f.name).write_bytes(f.read_bytes())
    modules = json.loads((bert_dir / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (dense / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(UnsupportedModelError,
                       match="module 'sentence_transformers.models.Dense' is not supported"):
        Embedder.load(dense, dtype="float32")
    (dense / "modules.json").write_text(json.dumps(modules[:-1]))
    tensors = load_file(str(dense / "model.safetensors"))
    del tensors["encoder.layer.1.output.dense.bias"]
    save_file(tensors, str(dense / "model.safetensors"))
    with pytest.raises(ValueError, match="missing tensor.*encoder.layer.1.output.dense.bias"):
        Embedder.load(dense, dtype="float32")


def test_outputs_are_float32_in_bf16(bert_dir: Path) -> None:
    embedder = Embedder.load(bert_dir, dtype="bfloat16")
    assert embedder.dtype == torch.bfloat16
    outputs = embedder.embed(TEXTS[:3])
    reference = _reference(bert_dir, TEXTS[:3])
    assert _cosines([o.embedding for o in outputs], reference).min() >= 0.99


def test_llm_embed_is_the_offline_api_for_an_embedding_model(bert_dir: Path, tiny_checkpoint: Path) -> None:
    from bulkinfer.engine import LLM, SamplingParams

    llm = LLM(model=str(bert_dir), dtype="float32")
    assert llm.task == "embed" and llm.dtype_choice.dtype == "float32"
    ids = llm.tokenizer("the cat")["input_ids"]
    outputs = llm.embed(["the cat", ids, "x" * 80], truncate=True)  # texts and token ids, in order
    reference = _reference(bert_dir, ["the cat", "the cat", "x" * 80])
    assert _cosines([o.embedding for o in outputs], reference).min() >= 0.99999
    assert [o.prompt_tokens for o in outputs] == [len(ids), len(ids), 48]
    assert len(llm.embed("one text")) == 1
    with pytest.raises(ValueError, match="more than the model's maximum of 48"):
        llm.embed(["x" * 80])
    with pytest.raises(TypeError, match="use embed\\(\\), not generate\\(\\)"):
        llm.generate(["hello"], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="do not apply to an embedding model"):
        LLM(model=str(bert_dir), max_num_seqs=4)
    decoder = LLM(model=str(tiny_checkpoint), task="embed", dtype="float32", pooling="mean")
    assert decoder.embedder is not None and decoder.embedder.config.pooling == "mean"
    assert len(decoder.embed(["def f(): pass"])[0].embedding) == decoder.embedder.config.dimension
    generator = LLM(model=str(tiny_checkpoint), dtype="float32", max_model_len=256)
    with pytest.raises(TypeError, match="task='embed'"):
        generator.embed(["hello"])
