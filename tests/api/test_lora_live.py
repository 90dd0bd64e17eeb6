"""Multi-LoRA end to end: a live deployment (Redis, moto S3, the API over HTTP, a Celery worker on the
tiny model) with two adapters registered from S3 (random, seeded, built by `peft`). Rows over both
adapters and the base in one job give what the engine gives for each adapter directly; an unknown
row adapter is that row's error and an unknown job-level one a 400; OpenAI batch lines choose an
adapter by `model`; a worker fetches an adapter once; each tenant runs its own adapter by location."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from bulkinfer.api.client import ApiError, Client
from bulkinfer.engine import LLM, LoRARequest, SamplingParams
from bulkinfer.jobs.object_store.s3 import S3ObjectStore
from tests.api.live_stack import ENGINE_OPTIONS, INPUTS_BUCKET, LiveStack, live_stack
from tests.engine.lora_adapters import ATTENTION_ONLY, make_adapter
from tests.fixtures.services import RedisServer, S3Server

ADAPTERS_BUCKET = "lora-adapters"
LORA_OPTIONS = {**ENGINE_OPTIONS, "dtype": "float32", "enable_lora": True, "max_loras": 2, "max_lora_rank": 8}
KEYS = "acme=acme-key,globex=globex-key"
TENANT_PREFIXES = {"acme": [f"s3://{INPUTS_BUCKET}/acme/"], "globex": [f"s3://{INPUTS_BUCKET}/globex/"]}
PROMPTS = ["def add(a, b):", "The capital of France is", "for i in range(10):"]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def adapters(tiny_checkpoint: Path) -> dict[str, Path]:
    """sql and fr (registered), acme's and globex's own (given by location)."""
    return {"sql": make_adapter(tiny_checkpoint, seed=21)[0],
            "fr": make_adapter(tiny_checkpoint, seed=22, targets=ATTENTION_ONLY)[0],
            "acme": make_adapter(tiny_checkpoint, seed=23)[0],
            "globex": make_adapter(tiny_checkpoint, seed=24, rank=4)[0]}


def upload(s3: S3Server, folder: Path, bucket: str, prefix: str) -> None:
    store = S3ObjectStore(bucket, endpoint_url=s3.endpoint_url)
    for file in folder.iterdir():
        store.put_bytes(f"{prefix}/{file.name}", file.read_bytes())


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer, s3_server: S3Server, tiny_checkpoint: Path, adapters: dict[str, Path],
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    # Registered on tiny: the stack serves other models too, and a batch line names an adapter alone.
    registered = {name: {"location": f"s3://{ADAPTERS_BUCKET}/{name}", "model": "tiny"}
                  for name in ("sql", "fr")}
    settings = {"api_keys": KEYS, "tenant_prefixes": json.dumps(TENANT_PREFIXES),
                "lora_adapters": json.dumps(registered)}
    with live_stack(redis_server, s3_server, tiny_checkpoint, tmp_path_factory.mktemp("model-cache"),
                    engine_options=LORA_OPTIONS, settings_fields=settings) as live:
        s3_server.client().create_bucket(Bucket=ADAPTERS_BUCKET)
        for name in ("sql", "fr"):
            upload(s3_server, adapters[name], ADAPTERS_BUCKET, name)
        for tenant in ("acme", "globex"):
            upload(s3_server, adapters[tenant], INPUTS_BUCKET, f"{tenant}/adapters/own")
        yield live


@pytest.fixture(scope="module")
def expected(tiny_checkpoint: Path, adapters: dict[str, Path]) -> dict[str | None, list[str]]:
    """What the engine gives for each adapter (and the base) directly, per prompt."""
    llm = LLM(model=str(tiny_checkpoint), **LORA_OPTIONS)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    texts: dict[str | None, list[str]] = {None: [out.text for out in llm.generate(PROMPTS, params)]}
    for lora_id, name in enumerate(adapters, start=1):
        request = LoRARequest(name, lora_id, str(adapters[name]))
        texts[name] = [out.text for out in llm.generate(PROMPTS, params, lora_request=request)]
    return texts


def acme(stack: LiveStack) -> Client:
    return Client(stack.url, api_key="acme-key", timeout=30)


def rows_job(stack: LiveStack, name: str, rows: list[dict], **fields) -> dict:  # noqa: ANN003
    body = b"".join(json.dumps(row).encode() + b"\n" for row in rows)
    # Raw prompts, as the engine's expected outputs are generated.
    return {"input_uri": stack.put_input(f"acme/{name}", body), "model": "tiny", "prompt_column": "q",
            "apply_chat_template": False, "sampling": {"temperature": 0, "max_tokens": MAX_TOKENS}, **fields}


def test_rows_over_two_adapters_and_the_base_give_the_engines_outputs_and_unknown_adapters_fail(
        stack, expected) -> None:
    rows = [{"id": f"{lora}-{n}", "q": prompt, "adapter": lora}
            for n, prompt in enumerate(PROMPTS) for lora in ("sql", None, "fr")]
    rows.append({"id": "nope-0", "q": PROMPTS[0], "adapter": "nope"})
    with acme(stack) as client:
        unknown = pytest.raises(ApiError, client.jobs.create, rows_job(stack, "bad.jsonl", rows, lora="nope"))
        assert unknown.value.status_code == 400 and "registered: fr, sql" in unknown.value.message
        job = client.jobs.create(rows_job(stack, "mixed.jsonl", rows, lora_column="adapter", id_column="id"))
        done = client.jobs.wait(job, timeout=120, progress=False, poll_interval=0.2)
        assert (done.state, done.rows.succeeded, done.rows.failed) == ("succeeded", 9, 1)
        outputs = {row["id"]: row for row in client.jobs.results(job)}
        usage_by_lora = client.jobs.result_parts(job).usage_by_lora
    for n in range(len(PROMPTS)):
        for lora in ("sql", None, "fr"):
            row = outputs[f"{lora}-{n}"]
            assert row["text"] == expected[lora][n], (lora, n)
            assert row["usage"].get("lora") == lora
    assert len({expected[lora][0] for lora in ("sql", None, "fr")}) == 3  # the adapters change the text
    failed = outputs["nope-0"]["error"]
    assert failed["code"] == "unknown_lora" and "registered: fr, sql" in failed["message"]
    assert sorted(usage_by_lora) == ["fr", "sql"]
    assert usage_by_lora["sql"].completion == sum(outputs[f"sql-{n}"]["usage"]["completion_tokens"]
                                                  for n in range(len(PROMPTS)))


def test_openai_batch_lines_choose_an_adapter_by_model(stack, expected) -> None:
    sdk = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="acme-key", max_retries=0)
    models = ["sql", "tiny", "fr"]
    lines = [{"custom_id": f"{model}-{n}", "method": "POST", "url": "/v1/completions",
              "body": {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}}
             for n, prompt in enumerate(PROMPTS) for model in models]
    file = sdk.files.create(file=("lines.jsonl", io.BytesIO(b"".join(json.dumps(line).encode() + b"\n"
                                                                     for line in lines))), purpose="batch")
    batch = sdk.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h")
    deadline = time.monotonic() + 120
    while (batch := sdk.batches.retrieve(batch.id)).status not in ("completed", "failed", "expired"):
        assert time.monotonic() < deadline, batch.status
        time.sleep(0.2)
    assert batch.status == "completed" and batch.request_counts.completed == len(lines)
    answers = [json.loads(line) for line in sdk.files.content(batch.output_file_id).text.splitlines()]
    for answer in answers:
        model, n = answer["custom_id"].rsplit("-", 1)
        body = answer["response"]["body"]
        assert body["model"] == model
        assert body["choices"][0]["text"] == expected[None if model == "tiny" else model][int(n)]


def test_a_worker_fetches_an_adapter_once(stack, s3_server, adapters, expected) -> None:
    rows = [{"q": PROMPTS[1]}]
    with acme(stack) as client:
        first = client.jobs.create(rows_job(stack, "once-1.jsonl", rows, lora="fr"))
        assert client.jobs.wait(first, timeout=120, progress=False, poll_interval=0.2).state == "succeeded"
        store = S3ObjectStore(ADAPTERS_BUCKET, endpoint_url=s3_server.endpoint_url)
        for info in list(store.list("fr/")):
            store.delete(info.key)
        try:  # the adapter is gone from the store: only the worker's fetched copy can serve it now
            second = client.jobs.create(rows_job(stack, "once-2.jsonl", rows, lora="fr"))
            done = client.jobs.wait(second, timeout=120, progress=False, poll_interval=0.2)
            assert done.state == "succeeded"
            [row] = list(client.jobs.results(second))
        finally:
            upload(s3_server, adapters["fr"], ADAPTERS_BUCKET, "fr")
    assert row["error"] is None and row["text"] == expected["fr"][1]


def test_two_tenants_each_run_their_own_adapter_and_neither_reaches_the_others(stack, expected) -> None:
    own = {tenant: f"s3://{INPUTS_BUCKET}/{tenant}/adapters/own" for tenant in ("acme", "globex")}
    jobs = {}
    with acme(stack) as acme_client, Client(stack.url, api_key="globex-key", timeout=30) as globex:
        clients = {"acme": acme_client, "globex": globex}
        for tenant, client in clients.items():
            body = b"".join(json.dumps({"q": prompt}).encode() + b"\n" for prompt in PROMPTS)
            uri = stack.put_input(f"{tenant}/rows.jsonl", body)
            jobs[tenant] = client.jobs.create({"input_uri": uri, "model": "tiny", "prompt_column": "q",
                                               "lora": own[tenant], "apply_chat_template": False,
                                               "sampling": {"temperature": 0, "max_tokens": MAX_TOKENS}})
        theirs = {"input_uri": stack.put_input("globex/more.jsonl", b'{"q": "x"}\n'), "model": "tiny",
                  "prompt_column": "q", "lora": own["acme"]}
        refused = pytest.raises(ApiError, globex.jobs.create, theirs)
        assert refused.value.status_code == 403
        for tenant, client in clients.items():
            assert client.jobs.wait(jobs[tenant], timeout=120, progress=False, poll_interval=0.2).state == \
                "succeeded"
            texts = [row["text"] for row in client.jobs.results(jobs[tenant])]
            assert texts == expected[tenant], tenant
        with pytest.raises(ApiError) as hidden:
            globex.jobs.get(jobs["acme"].job_id)
        assert hidden.value.status_code == 404
