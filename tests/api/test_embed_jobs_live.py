"""Embed jobs end to end on a live deployment (Redis, moto S3, the API over real HTTP, a real worker
serving a tiny BERT sentence-transformers checkpoint built from a seed): a Parquet job through our SDK
and an OpenAI batch of `/v1/embeddings` lines through the official `openai` package, every vector
checked against `Embedder.embed` in this process (fp32, cosine ≥ 0.99999)."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from openai.types import CreateEmbeddingResponse

from bulkinfer.api.client import ApiError
from bulkinfer.engine.embedder import Embedder
from bulkinfer.jobs.state.status import JobState
from tests.api.live_stack import LiveStack, live_stack
from tests.fixtures.encoder_checkpoints import build_sentence_transformer
from tests.fixtures.services import REPO_ROOT, RedisServer, S3Server

pytestmark = pytest.mark.timeout(300)

KEY = "acme-key"
MODEL = "minilm"
JOB_TIMEOUT_S = 120
TEXTS = ["the cat sat", "a dog and the cat", "of the", "the cat sat", "z" * 3]
TOO_LONG = "the " * 80  # past the checkpoint's 48 tokens


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_sentence_transformer(tmp_path_factory.mktemp("bert"), seed=11)


@pytest.fixture(scope="module")
def reference(bert: Path) -> Embedder:
    return Embedder.load(bert, dtype="float32")


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer, s3_server: S3Server, tiny_checkpoint: Path, bert: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    settings = {"api_keys": f"acme={KEY}", "model_aliases": {"text-embedding-3-small": MODEL}}
    with live_stack(redis_server, s3_server, tiny_checkpoint, tmp_path_factory.mktemp("model-cache"),
                    models={MODEL: str(bert)}, engine_options={"dtype": "float32"},
                    client_options={"timeout": 30, "backoff": 0.05, "api_key": KEY},
                    settings_fields=settings, worker_served=(MODEL,)) as live:
        yield live


def cosines(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    return (got * want).sum(axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))


def test_a_parquet_embed_job_writes_vectors_that_read_straight_into_numpy(stack: LiveStack,
                                                                          reference: Embedder) -> None:
    rows = pa.table({"text": [*TEXTS, TOO_LONG], "doc": list(range(len(TEXTS) + 1))})
    job = stack.client.jobs.create(input=rows, model=MODEL, task="embed", prompt_column="text",
                                   passthrough_columns=["doc"], shard_size=3)
    done = stack.client.jobs.wait(job, poll_interval=0.1, timeout=JOB_TIMEOUT_S)
    assert done.state == JobState.SUCCEEDED, done.error
    assert (done.rows.succeeded, done.rows.failed) == (len(TEXTS), 1)
    want = reference.embed(TEXTS)
    # Usage counts what was computed: the repeated text ran once (a deduplicated row).
    computed = sum(len(reference.tokenize(text)) for text in set(TEXTS))
    assert (done.usage.prompt, done.usage.completion, done.rows.deduplicated) == (computed, 0, 1)

    table = stack.client.jobs.results(job).to_arrow()
    assert table.column("doc").to_pylist() == list(range(len(TEXTS) + 1))
    column_type = table.schema.field("embedding").type
    assert pa.types.is_fixed_size_list(column_type) and column_type.list_size == 32
    matrix = np.stack(table.column("embedding").to_numpy(zero_copy_only=False)[:len(TEXTS)])
    assert matrix.dtype == np.float32
    assert cosines(matrix, np.array([output.embedding for output in want])).min() >= 0.99999
    assert table.column("error_code").to_pylist()[-1] == "prompt_too_long"

    estimate = stack.client.jobs.estimate(input=rows, model=MODEL, task="embed", prompt_column="text")
    assert estimate.max_output_tokens == 0 and estimate.rows_deduplicated == 1
    assert estimate.prompt_tokens == sum(len(reference.tokenize(text)) for text in {*TEXTS, TOO_LONG})


def test_an_openai_batch_of_embeddings_lines_runs_through_the_openai_sdk(stack: LiveStack,
                                                                         reference: Embedder) -> None:
    sdk = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=KEY, max_retries=0)
    ids = reference.tokenize("a dog and the cat")
    bodies = {
        "one": {"input": "the cat sat"},
        "many": {"input": ["of the", "the cat sat"], "dimensions": 8},
        "ids": {"input": ids, "encoding_format": "base64"},
        "id-lists": {"input": [ids, reference.tokenize("of the")]},
        "empty": {"input": ""},
    }
    lines = [{"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings",
              "body": {"model": "text-embedding-3-small", **body}} for custom_id, body in bodies.items()]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    upload = sdk.files.create(file=("embed.jsonl", data), purpose="batch")
    batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h")
    assert batch.model == MODEL
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while (batch := sdk.batches.retrieve(batch.id)).status not in ("completed", "failed", "expired"):
        assert time.monotonic() < deadline, batch.status
        time.sleep(0.2)
    assert batch.status == "completed" and batch.request_counts.completed == 4

    results = {line["custom_id"]: line for line in map(json.loads, sdk.files.content(
        str(batch.output_file_id)).read().splitlines())}
    vectors: dict[str, list[np.ndarray]] = {}
    for custom_id in ("one", "many", "id-lists"):
        body = CreateEmbeddingResponse.model_validate(results[custom_id]["response"]["body"])
        assert body.object == "list" and body.model == MODEL
        assert body.usage.total_tokens == body.usage.prompt_tokens > 0
        vectors[custom_id] = [np.array(item.embedding, np.float32) for item in body.data]
    raw = results["ids"]["response"]["body"]["data"][0]["embedding"]
    vectors["ids"] = [np.frombuffer(base64.b64decode(raw), "<f4")]  # as the SDK decodes it
    full = {text: np.array(output.embedding, np.float32) for text, output in
            zip(["the cat sat", "of the", "a dog and the cat"],
                reference.embed(["the cat sat", "of the", "a dog and the cat"]), strict=True)}

    def short(text: str) -> np.ndarray:
        return full[text][:8] / np.linalg.norm(full[text][:8])

    pairs = [(vectors["one"][0], full["the cat sat"]), (vectors["many"][0], short("of the")),
             (vectors["many"][1], short("the cat sat")), (vectors["ids"][0], full["a dog and the cat"]),
             (vectors["id-lists"][0], full["a dog and the cat"]), (vectors["id-lists"][1], full["of the"])]
    assert min(cosines(got[None], want[None])[0] for got, want in pairs) >= 0.99999
    assert len(vectors["many"][0]) == 8 and len(vectors["one"][0]) == 32
    errors = [json.loads(line) for line in sdk.files.content(str(batch.error_file_id)).read().splitlines()]
    assert [line["custom_id"] for line in errors] == ["empty"]
    assert "nothing to embed" in errors[0]["error"]["message"]


def test_a_generate_job_on_an_embedding_model_fails_saying_why(stack: LiveStack) -> None:
    job = stack.client.jobs.create(input=[{"q": "hi"}], model=MODEL, prompt_column="q")
    done = stack.client.jobs.wait(job, poll_interval=0.1, timeout=JOB_TIMEOUT_S)
    assert done.state == JobState.FAILED
    assert f"model {MODEL!r} is an embedding model and cannot generate text" in done.error


def test_an_embed_job_with_chat_or_sampling_is_refused_at_submit(stack: LiveStack) -> None:
    with pytest.raises(ApiError) as refused:
        stack.client.jobs.create(input=[{"q": "hi"}], model=MODEL, task="embed", prompt_column="q",
                                 sampling={"temperature": 0.2})
    assert refused.value.status_code == 422
    said = " ".join([refused.value.message, *refused.value.messages])
    assert "sampling: an embed job samples nothing" in said


def test_bulkinfer_submit_task_embed_with_dimensions_and_truncate(stack: LiveStack, tmp_path: Path,
                                                                   reference: Embedder) -> None:
    source = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": ["the cat", TOO_LONG]}), source)
    submitted = subprocess.run(
        [sys.executable, "-m", "bulkinfer.api.cli", "submit", str(source), "--model", MODEL, "--task",
         "embed",
         "--prompt-column", "text", "--dimensions", "8", "--truncate", "--pooling", "mean", "--no-normalize",
         "--wait", "--poll-interval", "0.2",
         "--json", "--no-progress"],
        cwd=REPO_ROOT, env=stack.cli_env(BULKINFER_API_URL=stack.url, BULKINFER_API_KEY=KEY),
        capture_output=True, text=True, timeout=180)
    assert submitted.returncode == 0, submitted.stderr
    job_id = json.loads(submitted.stdout)["job_id"]
    spec = stack.client.jobs.spec(job_id)
    assert (spec.task, spec.dimensions, spec.truncate, spec.pooling, spec.normalize) == ("embed", 8, True,
                                                                                       "mean", False)
    table = stack.client.jobs.results(job_id).to_arrow()
    assert table.column("error").to_pylist() == [None, None]  # the long text was cut, not failed
    assert table.schema.field("embedding").type.list_size == 8
    assert table.column("prompt_tokens").to_pylist()[1] == 48
    # normalize: false: the first 8 values as the model pooled them, not renormalised.
    raw = reference.embed_token_ids([reference.tokenize("the cat")], normalize=False)[0].embedding
    np.testing.assert_allclose(table.column("embedding").to_pylist()[0], raw[:8], atol=1e-5)


def test_an_embed_job_asking_for_a_pooling_the_checkpoint_fixes_otherwise_fails_saying_why(
        stack: LiveStack) -> None:
    job = stack.client.jobs.create(input=[{"q": "hi"}], model=MODEL, task="embed", prompt_column="q",
                                   pooling="cls")
    done = stack.client.jobs.wait(job, poll_interval=0.1, timeout=JOB_TIMEOUT_S)
    assert done.state == JobState.FAILED
    assert f"pooling 'cls': model {MODEL!r} was trained with 'mean' pooling" in done.error
