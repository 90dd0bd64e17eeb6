"""`bulkinfer run --task embed`: a file's rows embedded here, no servers; Parquet out holds a
fixed-size float32 column that reads straight into numpy, OpenAI batch out holds embeddings bodies."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bulkinfer.engine.embedder import Embedder
from bulkinfer.worker.hosts.embed_host import truncated
from tests.fixtures.encoder_checkpoints import build_sentence_transformer
from tests.worker.test_run_file import _run, _write_jsonl

TEXTS = ["the cat", "a dog and the cat", "of the", "the cat"]


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_sentence_transformer(tmp_path_factory.mktemp("bert"), seed=9)


def test_run_embeds_a_parquet_file_into_a_numpy_ready_column(bert: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"doc": TEXTS, "n": [1, 2, 3, 4]}), source)
    out = tmp_path / "vectors.parquet"
    code, stdout, stderr = _run(capsys, source, "-o", out, "--model", bert, "--task", "embed",
                                "--prompt-column", "doc", "--passthrough", "n", "--dimensions", "16",
                                "--dtype", "float32")
    assert code == 0, stderr
    assert "rows: 4" in stdout
    table = pq.read_table(out)
    assert table.column_names == ["id", "embedding", "prompt_tokens", "error_code", "error", "n"]
    matrix = np.stack(table.column("embedding").to_numpy(zero_copy_only=False))
    assert matrix.shape == (4, 16) and matrix.dtype == np.float32
    full = np.array([output.embedding for output in Embedder.load(bert, dtype="float32").embed(TEXTS)])
    short = full[:, :16] / np.linalg.norm(full[:, :16], axis=1, keepdims=True)
    cosines = (matrix * short).sum(axis=1) / np.linalg.norm(matrix, axis=1)
    assert cosines.min() >= 0.99999


def test_run_answers_embeddings_lines_with_openai_bodies_and_refuses_a_generation_line(
        bert: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = _write_jsonl(tmp_path / "batch.jsonl", [
        {"custom_id": "a", "method": "POST", "url": "/v1/embeddings",
         "body": {"model": "text-embedding-3-small", "input": ["the cat", "of the"]}},
        {"custom_id": "b", "method": "POST", "url": "/v1/embeddings",
         "body": {"model": "x", "input": "the cat", "encoding_format": "base64"}},
        {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "x", "messages": [{"role": "user", "content": "hi"}]}},
    ])
    out = tmp_path / "results.jsonl"
    code, _, stderr = _run(capsys, source, "-o", out, "--model", bert, "--task", "embed",
                           "--dtype", "float32")
    assert code == 0, stderr
    a, b, c = (json.loads(line) for line in out.read_text().splitlines())
    body = a["response"]["body"]
    assert body["object"] == "list" and [item["index"] for item in body["data"]] == [0, 1]
    decoded = np.frombuffer(base64.b64decode(b["response"]["body"]["data"][0]["embedding"]), "<f4")
    np.testing.assert_array_equal(decoded, np.array(body["data"][0]["embedding"], np.float32))
    assert c["error"]["code"] == "unsupported_url" and "this job embeds" in c["error"]["message"]


def test_run_embeds_with_a_decoder_checkpoint_pooled_as_the_flags_say(
        tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = _write_jsonl(tmp_path / "rows.jsonl", [{"q": "def f(x): return x"}, {"q": "import os"}])
    out = tmp_path / "o.jsonl"
    code, _, stderr = _run(capsys, source, "-o", out, "--model", tiny_checkpoint, "--task", "embed",
                           "--prompt-column", "q", "--pooling", "mean", "--no-normalize",
                           "--dtype", "float32")
    assert code == 0, stderr
    got = np.array([json.loads(line)["embedding"] for line in out.read_text().splitlines()])
    reference = Embedder.load(tiny_checkpoint, dtype="float32", pooling="mean", normalize=False)
    want = np.array([output.embedding for output in reference.embed(["def f(x): return x", "import os"])])
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert abs(np.linalg.norm(got[0]) - 1) > 0.01  # not normalized, as asked
    # --max-length caps each input's tokens (a decoder's positions run long), cut with --truncate
    capped = tmp_path / "capped.jsonl"
    code, _, stderr = _run(capsys, source, "-o", capped, "--model", tiny_checkpoint, "--task", "embed",
                           "--prompt-column", "q", "--max-length", "3", "--truncate", "--dtype", "float32")
    assert code == 0, stderr
    rows = [json.loads(line) for line in capped.read_text().splitlines()]
    reference = Embedder.load(tiny_checkpoint, dtype="float32")
    specials = set(reference.tokenizer.all_special_ids)
    cut = [truncated(reference.tokenize(text), 3, specials) for text in ("def f(x): return x", "import os")]
    want = np.array([output.embedding for output in reference.embed_token_ids(cut)])
    np.testing.assert_allclose(np.array([row["embedding"] for row in rows]), want, atol=1e-5)
    assert [row["usage"]["prompt_tokens"] for row in rows] == [3, len(cut[1])] and len(cut[1]) <= 3


def test_the_catalog_embedding_model_by_name_matches_sentence_transformers(
        real_embedding_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from sentence_transformers import SentenceTransformer

    texts = ["A man is eating food.", "Embedding a corpus is the most common batch job there is.", "ok"]
    source = _write_jsonl(tmp_path / "docs.jsonl", [{"text": text} for text in texts])
    out = tmp_path / "vectors.jsonl"
    code, _, stderr = _run(capsys, source, "-o", out, "--model", "all-minilm-l6-v2", "--task", "embed",
                           "--prompt-column", "text", "--dtype", "float32")
    assert code == 0, stderr
    got = np.array([json.loads(line)["embedding"] for line in out.read_text().splitlines()], np.float32)
    want = SentenceTransformer(str(real_embedding_model), device="cpu").encode(texts)
    assert got.shape == (3, 384)
    assert ((got * want).sum(axis=1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)).min() \
        >= 0.99999


def _embeddings_line(custom_id: str, text: str) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings",
            "body": {"model": "text-embedding-3-small", "input": text}}


def test_embeddings_lines_run_as_embeddings_without_task_as_vllm_run_batch_does(
        real_embedding_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = _write_jsonl(tmp_path / "batch.jsonl", [_embeddings_line("a", "the cat"),
                                                      _embeddings_line("b", "a dog and the cat")])
    out = tmp_path / "results.jsonl"
    code, _, stderr = _run(capsys, source, "-o", out, "--model", "all-minilm-l6-v2", "--dtype", "float32")
    assert code == 0, stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["custom_id"] for line in lines] == ["a", "b"]
    for line in lines:
        [item] = line["response"]["body"]["data"]
        assert item["object"] == "embedding" and len(item["embedding"]) == 384


def test_a_file_mixing_embeddings_and_generation_lines_is_refused_naming_lines(
        bert: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    chat = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "x", "messages": [{"role": "user", "content": "hi"}]}}
    source = _write_jsonl(tmp_path / "batch.jsonl", [_embeddings_line("a", "the cat"),
                                                      _embeddings_line("b", "of the"), chat])
    out = tmp_path / "results.jsonl"
    code, _, stderr = _run(capsys, source, "-o", out, "--model", bert)
    assert code == 2
    assert ("the file mixes /v1/embeddings lines (2: lines 1, 2) with text generation lines (1: line 3); a "
            "job runs one task") in stderr and "--task" in stderr
    assert not out.exists()
