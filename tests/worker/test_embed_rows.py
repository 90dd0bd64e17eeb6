"""Embed rows through a worker's hosted embedder (a tiny BERT sentence-transformers checkpoint built
from a seed): the vectors are `Embedder.embed`'s, identical rows run once, too-long inputs fail or
are truncated, `dimensions` shortens, and a model that cannot do the job's task is named."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from bulkinfer.engine.embedder import Embedder
from bulkinfer.jobs.embedding import EmbedRequest
from bulkinfer.jobs.formats.rows import Row, RowBuilder
from bulkinfer.jobs.model_registry import ModelRegistry
from bulkinfer.jobs.sampling import JobSampling
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.worker.hosts.embed_host import EmbedHost, EmbedInputRequest, EmbedResult, truncated
from bulkinfer.worker.hosts.embed_rows import embedded_row
from bulkinfer.worker.hosts.engine_host import EngineUnavailable
from bulkinfer.worker.hosts.model_hosts import HostedModel, ModelHosts, task_problem
from bulkinfer.worker.hosts.row_window import WindowStats, run_rows
from tests.fixtures.encoder_checkpoints import build_sentence_transformer

MAX_TOKENS = 48  # the checkpoint's max_seq_length


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_sentence_transformer(tmp_path_factory.mktemp("bert"), seed=5, max_seq_length=MAX_TOKENS)


@pytest.fixture(scope="module")
def reference(bert: Path) -> Embedder:
    return Embedder.load(bert, dtype="float32")


@pytest.fixture(scope="module")
def hosted(bert: Path) -> HostedModel:
    hosts = ModelHosts(ModelRegistry({"bert": str(bert)}), {"dtype": "float32"})
    try:
        yield hosts.get("bert")
    finally:
        hosts.stop()


def spec(**fields) -> JobSpec:
    return JobSpec.model_validate({"input_uri": "/in/rows.parquet", "input_format": "parquet",
                                   "model": "bert", "task": "embed", "prompt_column": "text", **fields})


def rows(job: JobSpec, texts: list[str]) -> list[Row]:
    builder = RowBuilder(job)
    return [builder.build(index, {"text": text}) for index, text in enumerate(texts)]


def cosine(a, b) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def test_an_embedding_model_is_hosted_as_an_embedder_and_its_vectors_are_embed_s(hosted, reference) -> None:
    assert hosted.is_embedding
    texts = ["the cat sat", "a much longer sentence about the cat, and of the dog", "x", "the cat sat"]
    stats = WindowStats()
    outputs = run_rows(hosted, rows(spec(), texts), window_rows=2, stats=stats)
    expected = reference.embed(texts)
    assert [output.row_id for output in outputs] == ["0", "1", "2", "3"]
    for output, want in zip(outputs, expected, strict=True):
        assert output.error_code is None
        assert len(output.embeddings) == 1 and output.embeddings[0].typecode == "f"
        assert cosine(output.embeddings[0], want.embedding) >= 0.99999
        usage = (output.prompt_tokens, output.cached_tokens, output.completion_tokens)
        assert usage == (want.prompt_tokens, 0, 0)
    # Row 3 repeats row 0 in a later window: it takes row 0's vector instead of running again.
    assert [output.deduplicated for output in outputs] == [False, False, False, True]
    assert list(outputs[3].embeddings[0]) == list(outputs[0].embeddings[0])
    assert stats.peak_rows_held <= 4


def test_a_too_long_input_fails_its_row_unless_the_job_truncates(hosted, reference) -> None:
    long_text = "the " * 100
    failed, fine = run_rows(hosted, rows(spec(), [long_text, "short"]))
    assert failed.error_code == "prompt_too_long"
    assert "more than the model's maximum of 48" in failed.error_message
    assert fine.error_code is None
    [cut] = run_rows(hosted, rows(spec(truncate=True), [long_text]))
    assert cut.prompt_tokens == MAX_TOKENS
    [want] = reference.embed([long_text], truncate=True)  # the tokenizer's own truncation
    assert cosine(cut.embeddings[0], want.embedding) >= 0.99999


def test_a_jobs_max_length_limits_inputs_within_the_models_maximum(hosted, reference) -> None:
    """A job may hold inputs to fewer tokens than the model takes (cost, or a checkpoint without
    sentence-transformers files whose positions run long): longer inputs fail or are cut there; a
    limit past the model's maximum is the job's error, naming both."""
    text = "the cat sat on the mat and looked at the dog for a while"
    [whole] = run_rows(hosted, rows(spec(), [text]))
    assert whole.error_code is None and whole.prompt_tokens > 8
    [failed] = run_rows(hosted, rows(spec(max_length=8), [text]))
    assert failed.error_code == "prompt_too_long"
    assert "more than the job's max_length of 8" in failed.error_message
    [cut] = run_rows(hosted, rows(spec(max_length=8, truncate=True), [text]))
    assert cut.prompt_tokens == 8
    [want] = reference.embed_token_ids([truncated(reference.tokenize(text), 8,
                                                  set(reference.tokenizer.all_special_ids))])
    assert cosine(cut.embeddings[0], want.embedding) >= 0.99999
    # The same text under another limit is another result: not deduplicated against the first.
    first, second = run_rows(hosted, rows(spec(max_length=8, truncate=True), [text])
                             + rows(spec(max_length=12, truncate=True), [text]))
    assert (first.prompt_tokens, second.prompt_tokens) == (8, 12) and not second.deduplicated
    assert task_problem(spec(max_length=MAX_TOKENS), hosted) is None
    assert task_problem(spec(max_length=MAX_TOKENS + 1), hosted) == (
        f"max_length {MAX_TOKENS + 1} is more than model 'bert''s maximum of {MAX_TOKENS} tokens per input")


def test_dimensions_shortens_and_renormalises_and_past_the_size_is_the_rows_error(hosted, reference) -> None:
    [short] = run_rows(hosted, rows(spec(dimensions=8), ["the cat"]))
    full = reference.embed(["the cat"])[0].embedding
    assert len(short.embeddings[0]) == 8
    assert math.isclose(math.fsum(value * value for value in short.embeddings[0]), 1.0, rel_tol=1e-5)
    assert cosine(short.embeddings[0], full[:8]) >= 0.99999
    row = Row(0, "wide", None, None, JobSampling(), None, embed=EmbedRequest(("the cat",), 64))
    [wide] = run_rows(hosted, [row])
    assert wide.error_code == "invalid_row"
    assert "dimensions 64 is more than the model's 32" in wide.error_message


def test_token_id_inputs_and_several_inputs_in_one_row(hosted, reference) -> None:
    ids = reference.tokenize("the dog")
    row = Row(0, "many", None, None, JobSampling(), None,
              embed=EmbedRequest(("the cat", tuple(ids), "the cat"), None, "base64"))
    [output] = run_rows(hosted, [row])
    want = reference.embed(["the cat", "the dog"])
    assert len(output.embeddings) == 3 and output.encoding_format == "base64"
    assert cosine(output.embeddings[1], want[1].embedding) >= 0.99999
    assert list(output.embeddings[0]) == list(output.embeddings[2])
    assert output.prompt_tokens == 2 * want[0].prompt_tokens + want[1].prompt_tokens
    outside = Row(1, "bad-id", None, None, JobSampling(), None, embed=EmbedRequest(((2, 10_000, 3),)))
    [bad] = run_rows(hosted, [outside, row])[:1]
    assert bad.error_code == "invalid_row"
    assert bad.error_message.startswith("the input holds token id 10000, outside the vocabulary")


def test_a_stopped_run_aborts_and_the_host_serves_the_next_one(hosted) -> None:
    assert run_rows(hosted, rows(spec(), ["a b c"] * 3), should_stop=lambda: True, poll_s=0.0) is None
    [again] = run_rows(hosted, rows(spec(), ["a b c"]))
    assert again.error_code is None


def test_a_generate_row_on_an_embedder_and_an_embed_job_on_a_generator_are_named(hosted,
                                                                                 tiny_checkpoint) -> None:
    generate = JobSpec.model_validate({"input_uri": "/in/rows.parquet", "model": "bert",
                                       "prompt_column": "t"})
    assert "is an embedding model and cannot generate text" in task_problem(generate, hosted)
    assert task_problem(spec(), hosted) is None
    assert task_problem(spec(dimensions=33), hosted) == "dimensions 33 is more than model 'bert''s 32"
    hosts = ModelHosts(ModelRegistry({"tiny": str(tiny_checkpoint)}),
                       {"max_model_len": 64, "num_kv_blocks": 8})
    try:
        llm = hosts.get("tiny")
        assert not llm.is_embedding
        problem = task_problem(spec(), llm)
        assert "is hosted to generate text, not to embed" in problem
        assert hosts.get("tiny", embed=True).is_embedding  # an embed job gets it as an embedder
    finally:
        hosts.stop()


def test_truncation_keeps_the_closing_special_token() -> None:
    assert truncated([101, 5, 6, 7, 102], 4, {101, 102}) == [101, 5, 6, 102]
    assert truncated([1, 5, 6, 7], 3, {1}) == [1, 5, 6]
    assert truncated([1, 5], 3, set()) == [1, 5]


def test_the_heartbeat_reads_the_embedders_throughput_figures(hosted) -> None:
    from bulkinfer.worker.process.engine_metrics import engine_figures

    before = engine_figures(hosted)
    [output] = run_rows(hosted, rows(spec(), ["figures for the heartbeat, once"]), deduplicate=False)
    after = engine_figures(hosted)
    computed = after["prefill_tokens_computed"] - before["prefill_tokens_computed"]
    assert computed == output.prompt_tokens and after["busy_time_s"] > before["busy_time_s"]
    assert after["generation_tokens"] == 0 and after["num_waiting"] == 0


def test_rows_past_the_jobs_deadline_come_back_expired(hosted) -> None:
    assert {output.error_code for output in run_rows(hosted, rows(spec(), ["a", "b"]), expires_in_s=0)} == \
        {"expired"}
    [row] = rows(spec(), ["a"])
    aborted = [EmbedResult(None, 0, aborted=True)]
    assert embedded_row(row, aborted, expired=True).error_code == "expired"
    assert embedded_row(row, aborted).error_message == "aborted by the worker"


def test_a_windows_size_counts_every_input_of_an_embed_row() -> None:
    from bulkinfer.worker.hosts.row_window import _prompt_bytes

    row = Row(0, "many", None, None, JobSampling(), None, embed=EmbedRequest(("abc", (1, 2), "de")))
    assert _prompt_bytes(row) == 3 + 8 + 2


class CrashingEmbedder:
    """A stand-in whose forward pass fails as a broken device would (not a refusal of the input)."""

    dtype_choice = SimpleNamespace(dtype="float32")
    config = SimpleNamespace(dimension=4, max_length=16)
    tokenizer = SimpleNamespace(all_special_ids=[])

    def tokenize(self, text: str) -> list[int]:
        return [1] * len(text)

    def embed_token_ids(self, batch):  # noqa: ANN001, ANN201
        raise RuntimeError("device lost")


def test_an_embedder_failure_ends_the_host_instead_of_failing_rows() -> None:
    host = EmbedHost(CrashingEmbedder, name="crashing").start()
    try:
        submission = host.submit([EmbedInputRequest("ab"), EmbedInputRequest("abc")])
        assert submission.wait(10)
        with pytest.raises(EngineUnavailable, match="device lost"):
            submission.results()
        assert isinstance(host.failure, RuntimeError)  # ModelHosts builds a fresh host next time
    finally:
        host.stop()
