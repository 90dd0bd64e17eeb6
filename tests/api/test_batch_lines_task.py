"""`POST /jobs` with OpenAI batch input and no `task`: the lines' `url` decides it, as `bulkinfer run`
and `vllm run-batch` do (`/v1/embeddings` lines make an embed job); a task given wins, and a file
whose first lines mix the two kinds is refused naming them. No worker: the stored spec says it all.
"""

from __future__ import annotations

import json

from tests.api.conftest import RunningApi, refused


def _line(custom_id: str, url: str) -> dict:
    body = ({"model": "text-embedding-3-small", "input": "the cat"} if url == "/v1/embeddings"
            else {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]})
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def _jsonl(*lines: dict) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


EMBEDDINGS = _jsonl(_line("a", "/v1/embeddings"), _line("b", "/v1/embeddings"))
CHAT = _jsonl(_line("a", "/v1/chat/completions"))


def test_embeddings_lines_make_an_embed_job_without_a_task(api: RunningApi) -> None:
    jobs = api.client.jobs
    by_uri = jobs.create(input=api.put_input("embed.jsonl", EMBEDDINGS), model="tiny")
    uploaded = jobs.create(input=[_line("a", "/v1/embeddings")], model="tiny")
    chat = jobs.create(input=api.put_input("chat.jsonl", CHAT), model="tiny")
    assert [jobs.spec(job).task for job in (by_uri, uploaded, chat)] == ["embed", "embed", "generate"]


def test_a_task_given_wins_over_the_lines(api: RunningApi) -> None:
    uri = api.put_input("embed.jsonl", EMBEDDINGS)
    job = api.client.jobs.create(input=uri, model="tiny", task="generate")
    assert api.client.jobs.spec(job).task == "generate"  # its embeddings lines fail, each with its reason


def test_a_file_mixing_embeddings_and_generation_lines_is_refused_naming_them(api: RunningApi) -> None:
    mixed = _jsonl(_line("a", "/v1/embeddings"), _line("b", "/v1/chat/completions"),
                   _line("c", "/v1/embeddings"))
    error = refused(lambda: api.client.jobs.create(input=api.put_input("mixed.jsonl", mixed), model="tiny"))
    assert error.status_code == 400
    assert error.message.startswith("the file mixes /v1/embeddings lines (2: lines 1, 3) with text "
                                    "generation lines (1: line 2); a job runs one task")
