"""A job's `pooling` and `normalize` through a worker's hosted embedder: a plain decoder checkpoint
(no sentence-transformers files) embeds for an embed job, each row pooled as its job asks by one
loaded model, checked against a hand computation from transformers' hidden states of the same
weights; a checkpoint whose sentence-transformers files fix the pooling keeps it, and says so."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from bulkinfer.engine.embedder import Embedder
from bulkinfer.jobs.formats.rows import Row, RowBuilder
from bulkinfer.jobs.model_registry import ModelRegistry
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.worker.hosts.embed_host import EmbedInputRequest
from bulkinfer.worker.hosts.embed_rows import row_digest
from bulkinfer.worker.hosts.model_hosts import HostedModel, ModelHosts, task_problem
from bulkinfer.worker.hosts.row_window import run_rows
from tests.fixtures.encoder_checkpoints import build_sentence_transformer
from tests.fixtures.hosted_models import hosted_model

TEXT = "def f(x): return x"


def spec(model: str, **fields) -> JobSpec:
    return JobSpec.model_validate({"input_uri": "/in/rows.parquet", "input_format": "parquet",
                                   "model": model, "task": "embed", "prompt_column": "text", **fields})


def row(job: JobSpec, text: str, index: int = 0) -> Row:
    return RowBuilder(job).build(index, {"text": text})


@pytest.fixture(scope="module")
def decoder_hosts(tiny_checkpoint: Path) -> Iterator[ModelHosts]:
    hosts = ModelHosts(ModelRegistry({"tiny": str(tiny_checkpoint)}),
                       {"dtype": "float32", "max_model_len": 64, "num_kv_blocks": 8})
    try:
        yield hosts
    finally:
        hosts.stop()


def hidden_states(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """transformers' final hidden states (after the final norm) of one unpadded sequence."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([ids])).last_hidden_state[0]


def unit(vector: torch.Tensor) -> np.ndarray:
    return (vector / vector.norm()).numpy()


def test_a_decoder_checkpoint_embeds_each_row_pooled_as_its_job_asks(decoder_hosts: ModelHosts,
                                                                      tiny_checkpoint: Path) -> None:
    generator = decoder_hosts.get("tiny")
    embedder = decoder_hosts.get("tiny", embed=True)
    assert not generator.is_embedding and embedder.is_embedding
    assert decoder_hosts.get("tiny", embed=True) is embedder  # loaded once, kept for every embed job
    assert decoder_hosts.hosted() == [generator]  # heartbeats and metrics report the model once
    embedder.host.wait_ready(120)
    assert task_problem(spec("tiny", pooling="mean"), embedder) is None
    assert embedder.host.fixed_pooling is None
    jobs = [spec("tiny"), spec("tiny", pooling="mean"), spec("tiny", pooling="mean", normalize=False),
            spec("tiny", pooling="last", normalize=False)]
    # The same text four ways, in one run: one pass of the host pools it four ways.
    outputs = run_rows(embedder, [row(job, TEXT, index) for index, job in enumerate(jobs)])
    assert [output.error_code for output in outputs] == [None] * 4
    assert [output.deduplicated for output in outputs] == [False] * 4
    ids = embedder.host.call(lambda model: model.tokenize(TEXT))
    hidden = hidden_states(tiny_checkpoint, ids)
    expected = [unit(hidden[-1]), unit(hidden.mean(0)), hidden.mean(0).numpy(), hidden[-1].numpy()]
    for output, want in zip(outputs, expected, strict=True):
        assert output.prompt_tokens == len(ids)
        np.testing.assert_allclose(np.asarray(output.embeddings[0]), want, atol=2e-5)
    assert abs(np.linalg.norm(expected[2]) - 1) > 0.01  # the raw mean is not unit length: a real test
    assert len({row_digest(row(job, TEXT)) for job in jobs}) == 4


@pytest.fixture(scope="module")
def bert_hosted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostedModel]:
    folder = build_sentence_transformer(tmp_path_factory.mktemp("bert"), seed=7, pooling="mean")
    with hosted_model("bert", folder, {"dtype": "float32"}) as hosted:
        yield hosted


def test_a_pooling_the_checkpoint_fixes_cannot_change_but_normalize_can(bert_hosted: HostedModel) -> None:
    assert bert_hosted.host.fixed_pooling == "mean"
    assert task_problem(spec("bert", pooling="mean"), bert_hosted) is None
    assert task_problem(spec("bert", pooling="cls"), bert_hosted) == (
        "pooling 'cls': model 'bert' was trained with 'mean' pooling (its sentence-transformers files "
        "fix it); omit pooling or ask for 'mean'")
    # Should a row reach the host anyway, it is that row's error, not a stuck or failed pass.
    submission = bert_hosted.host.submit([EmbedInputRequest("the cat", pooling="cls"),
                                          EmbedInputRequest("the cat")])
    assert submission.wait(30)
    refused, plain = submission.results()
    assert refused.embedding is None and "fix 'mean' pooling" in refused.error
    assert plain.error is None and abs(np.linalg.norm(plain.embedding) - 1) < 1e-5
    # normalize: false is honoured (a step after pooling, as sentence-transformers' encode allows).
    [raw] = run_rows(bert_hosted, [row(spec("bert", normalize=False), "the cat")])
    want = bert_hosted.host.call(lambda model: model.embed_token_ids([model.tokenize("the cat")],
                                                                     normalize=False)[0].embedding)
    np.testing.assert_allclose(np.asarray(raw.embeddings[0]), want, atol=1e-6)
    assert abs(np.linalg.norm(want) - 1) > 0.01
    direction = np.asarray(raw.embeddings[0]) / np.linalg.norm(want)
    np.testing.assert_allclose(direction, plain.embedding, atol=1e-5)


def test_embedder_pooling_config_per_call(bert_hosted: HostedModel) -> None:
    def configs(model: Embedder) -> tuple:
        with pytest.raises(ValueError, match="pooling 'last' differs from the model's"):
            model.pooling_config("last")
        with pytest.raises(ValueError, match="pooling must be one of mean, cls, last"):
            model.pooling_config("max")
        return model.config, model.pooling_config(None, False), model.pooling_config("mean", None)

    loaded, raw, same = bert_hosted.host.call(configs)
    assert (loaded.pooling, loaded.normalize) == ("mean", True)
    assert (raw.pooling, raw.normalize) == ("mean", False) and same == loaded
