"""The embed host takes the highest-priority waiting inputs first for each pass (the engine's
convention: a lower value runs sooner), longest first and then in arrival order within a priority,
as the LLM engine's priority scheduling does for generate jobs; an embed run passes its job's
priority to every input."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from bulkinfer.jobs.embedding import EmbedRequest
from bulkinfer.jobs.formats.rows import Row
from bulkinfer.jobs.sampling import JobSampling
from bulkinfer.worker.hosts.embed_host import EmbedHost, EmbedInputRequest
from bulkinfer.worker.hosts.embed_rows import EmbedRun


class GatedEmbedder:
    """Embeds one 4-token text per pass (`batch_tokens`), recording each pass; the first pass waits
    on `gate`, so that everything submitted meanwhile is waiting together when it ends."""

    dtype_choice = SimpleNamespace(dtype="float32")
    config = SimpleNamespace(dimension=2, max_length=64)
    tokenizer = SimpleNamespace(all_special_ids=[])
    batch_tokens = 4

    def __init__(self) -> None:
        self.passes: list[list[str]] = []
        self.entered = threading.Event()
        self.gate = threading.Event()

    def tokenize(self, text: str) -> list[int]:
        return [ord(character) for character in text]

    def embed_token_ids(self, batch):  # noqa: ANN001, ANN201
        self.entered.set()
        assert self.gate.wait(10)
        self.passes.append(["".join(map(chr, ids)) for ids in batch])
        return [SimpleNamespace(embedding=[1.0, 0.0]) for _ in batch]


def test_each_pass_takes_the_highest_priority_inputs_first_in_arrival_order_within_one_length() -> None:
    embedder = GatedEmbedder()
    host = EmbedHost(lambda: embedder, name="gated").start()
    try:
        first = host.submit([EmbedInputRequest("aaaa", priority=5)])
        assert embedder.entered.wait(10)  # the first pass is running: the rest wait together
        waiting = [("bbbb", 9), ("cccc", 1), ("dddd", 5), ("eeee", 1), ("ffff", 0)]
        later = host.submit([EmbedInputRequest(text, priority=priority) for text, priority in waiting])
        embedder.gate.set()
        assert first.wait(10) and later.wait(10)
        assert [result.error for result in later.results()] == [None] * 5
    finally:
        host.stop()
    assert embedder.passes == [["aaaa"], ["ffff"], ["cccc"], ["eeee"], ["dddd"], ["bbbb"]]


def test_an_embed_run_gives_its_priority_to_every_input() -> None:
    submitted: list[EmbedInputRequest] = []

    def submit(requests):  # noqa: ANN001, ANN202
        submitted.extend(requests)

    hosted = SimpleNamespace(name="m", host=SimpleNamespace(submit=submit))
    rows = [Row(index, str(index), None, None, JobSampling(), None, embed=EmbedRequest(("a", "b")))
            for index in range(2)]
    EmbedRun(hosted, rows, priority=3, deduplicate=False)
    assert [request.priority for request in submitted] == [3, 3, 3, 3]
