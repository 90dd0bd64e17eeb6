"""A worker's rows on LoRA adapters: names resolved against the registry, adapters fetched once per
process (from S3 into the model cache), rows of several adapters and the base in one run, and an
adapter that cannot be used as that row's error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from bulkinfer.engine import LLM, LoRARequest, SamplingParams
from bulkinfer.jobs.formats.rows import Row, RowErrorCode
from bulkinfer.jobs.lora_adapters import AdapterRegistry
from bulkinfer.jobs.model_registry import ModelRegistry
from bulkinfer.jobs.object_store.s3 import S3ObjectStore
from bulkinfer.jobs.sampling import JobSampling
from bulkinfer.worker.hosts.lora_requests import AdapterRefused, AdapterRequests
from bulkinfer.worker.hosts.model_hosts import ModelHosts
from bulkinfer.worker.hosts.row_window import run_rows
from tests.engine.lora_adapters import ATTENTION_ONLY, make_adapter

OPTIONS = {"max_model_len": 128, "num_kv_blocks": 64, "dtype": "float32", "enable_lora": True,
           "max_loras": 2, "max_lora_rank": 8}
GREEDY = JobSampling(temperature=0.0, max_tokens=5)
PROMPTS = ["def add(a, b):", "The capital of France is", "for i in range(10):"]


@pytest.fixture(scope="module")
def adapters(checkpoint_factory) -> dict[str, Path]:
    base = checkpoint_factory()
    return {"sql": make_adapter(base, seed=11)[0],
            "fr": make_adapter(base, seed=12, targets=ATTENTION_ONLY)[0]}


def row(index: int, prompt: str, lora: str | None, required: bool = True) -> Row:
    return Row(index, str(index), prompt, None, GREEDY, None, lora=lora, lora_required=required)


def test_rows_of_two_adapters_and_the_base_run_together_as_the_engine_runs_each_adapter(
        tiny_checkpoint, adapters, tmp_path) -> None:
    registered = json.dumps({name: str(folder) for name, folder in adapters.items()})
    registry = ModelRegistry({"tiny": str(tiny_checkpoint)}, adapters=AdapterRegistry.parse(registered))
    hosts = ModelHosts(registry, OPTIONS, cache_dir=tmp_path / "cache")
    try:
        hosted = hosts.get("tiny")
        choices = [None, "sql", "fr"]
        items = [row(i * 3 + j, prompt, lora)
                 for i, prompt in enumerate(PROMPTS) for j, lora in enumerate(choices)]
        items.append(row(99, PROMPTS[0], "nope"))
        outputs = run_rows(hosted, items, deduplicate=True)
    finally:
        hosts.stop()
    llm = LLM(model=str(tiny_checkpoint), **OPTIONS)
    params = SamplingParams(temperature=0.0, max_tokens=5)
    for lora_id, lora in enumerate(choices):
        request = None if lora is None else LoRARequest(lora, lora_id, str(adapters[lora]))
        expected = [out.text for out in llm.generate(PROMPTS, params, lora_request=request)]
        got = [outputs[i * 3 + lora_id] for i in range(len(PROMPTS))]
        assert [out.text for out in got] == expected, lora
        assert all(out.lora == lora for out in got)
    texts = {lora: outputs[lora_id].text for lora_id, lora in enumerate(choices)}
    assert len(set(texts.values())) == 3  # the same prompt differs per adapter: no row copied another's
    unknown = outputs[-1]
    assert unknown.error_code == RowErrorCode.UNKNOWN_LORA
    assert "'nope' is neither model 'tiny' nor a LoRA adapter registered on it (registered: fr, sql)" in \
        unknown.error_message


def test_an_s3_adapter_is_fetched_once_per_process_and_a_bad_one_is_its_rows_error(adapters, s3,
                                                                                    tmp_path) -> None:
    s3.client().create_bucket(Bucket="adapters")
    store = S3ObjectStore("adapters", endpoint_url=s3.endpoint_url)
    for file in adapters["sql"].iterdir():
        store.put_bytes(f"sql/{file.name}", file.read_bytes())
    store.put_bytes("broken/adapter_config.json", b'{"peft_type": "PREFIX_TUNING"}')
    weights = (adapters["sql"] / "adapter_model.safetensors").read_bytes()
    store.put_bytes("broken/adapter_model.safetensors", weights)
    registry = ModelRegistry({"tiny": "/models/tiny"}, adapters=AdapterRegistry.parse(json.dumps(
        {"sql": "s3://adapters/sql", "broken": "s3://adapters/broken", "gone": "s3://adapters/gone"})))
    requests = AdapterRequests("tiny", registry, tmp_path / "cache", endpoint_url=s3.endpoint_url)
    first = requests.for_row(row(0, "x", "sql"))
    assert Path(first.lora_path).parent == tmp_path / "cache" / "loras"  # beside the models
    assert (Path(first.lora_path) / "adapter_model.safetensors").read_bytes() == weights
    for key in [info.key for info in store.list("sql/")]:
        store.delete(key)  # a second job on it never reads the store again
    assert requests.for_row(row(1, "y", "sql")) == first
    assert requests.fetches == 1
    # Another process on the machine finds the download in the cache.
    again = AdapterRequests("tiny", registry, tmp_path / "cache", endpoint_url=s3.endpoint_url)
    assert again.for_row(row(2, "z", "sql")).lora_path == first.lora_path
    for name, problem in [("broken", "LoRA adapter 'broken': .* peft_type 'PREFIX_TUNING' is not supported"),
                          ("gone", "LoRA adapter 'gone': no LoRA adapter at s3://adapters/gone: 0 object")]:
        with pytest.raises(AdapterRefused, match=problem) as refused:
            requests.for_row(row(3, "w", name))
        assert refused.value.code == RowErrorCode.INVALID_LORA
    # An OpenAI line's model that is not an adapter runs on the base; a column's is an error.
    assert requests.for_row(row(4, "v", "gpt-4o-mini", required=False)) is None
    with pytest.raises(AdapterRefused) as unknown:
        requests.for_row(row(5, "v", "gpt-4o-mini"))
    assert unknown.value.code == RowErrorCode.UNKNOWN_LORA


def test_an_adapter_the_engine_refuses_fails_its_rows_and_not_the_run(tiny_checkpoint, adapters,
                                                                       tmp_path) -> None:
    too_big = tmp_path / "rank16"
    shutil.copytree(make_adapter(tiny_checkpoint, seed=13, rank=16)[0], too_big)
    registry = ModelRegistry({"tiny": str(tiny_checkpoint)}, adapters=AdapterRegistry.parse(json.dumps(
        {"big": str(too_big), "sql": str(adapters["sql"])})))
    hosts = ModelHosts(registry, OPTIONS, cache_dir=tmp_path / "cache")
    try:
        outputs = run_rows(hosts.get("tiny"), [row(0, PROMPTS[0], "big"), row(1, PROMPTS[0], "sql"),
                                               row(2, PROMPTS[1], None)])
    finally:
        hosts.stop()
    assert outputs[0].error_code == RowErrorCode.INVALID_LORA and "max_lora_rank" in outputs[0].error_message
    assert outputs[1].error_code is None and outputs[1].lora == "sql"
    assert outputs[2].error_code is None and outputs[2].lora is None


def test_malformed_adapters_fail_their_rows_and_not_the_run(tiny_checkpoint, adapters, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    zero_dim, rslora_string = tmp_path / "zero-dim", tmp_path / "rslora-string"
    for folder in (zero_dim, rslora_string):
        shutil.copytree(adapters["sql"], folder)
    weights = zero_dim / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"] = torch.tensor(1.0)
    save_file(tensors, str(weights))
    config = json.loads((rslora_string / "adapter_config.json").read_text())
    (rslora_string / "adapter_config.json").write_text(json.dumps({**config, "use_rslora": "false"}))
    registry = ModelRegistry({"tiny": str(tiny_checkpoint)}, adapters=AdapterRegistry.parse(json.dumps(
        {"zero": str(zero_dim), "rs": str(rslora_string), "sql": str(adapters["sql"])})))
    hosts = ModelHosts(registry, OPTIONS, cache_dir=tmp_path / "cache")
    try:
        outputs = run_rows(hosts.get("tiny"), [row(0, PROMPTS[0], "zero"), row(1, PROMPTS[0], "sql"),
                                               row(2, PROMPTS[1], "rs"), row(3, PROMPTS[1], None),
                                               row(4, PROMPTS[2], "zero")])
    finally:
        hosts.stop()
    for refused, problem in [(outputs[0], "must be a matrix"), (outputs[4], "must be a matrix"),
                             (outputs[2], 'use_rslora must be true or false, got the string "false"')]:
        assert refused.error_code == RowErrorCode.INVALID_LORA and problem in refused.error_message
    assert outputs[1].error_code is None and outputs[1].lora == "sql"
    assert outputs[3].error_code is None and outputs[3].lora is None
