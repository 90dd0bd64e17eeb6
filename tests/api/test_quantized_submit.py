"""POST /jobs reads a served model's config.json itself: a checkpoint quantized in a scheme the engine
does not run is refused at submit, naming the scheme, before any worker has tried to load it (the API
never imports the engine: bulkinfer/quant_scheme.py is torch-free); one it runs is accepted."""

from __future__ import annotations

import json

import pytest

from bulkinfer.api.client import ApiError
from bulkinfer.jobs.settings import Settings
from tests.api.conftest import serve

FP8 = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
    "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
    "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}}
W4A16 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
    "targets": ["Linear"],
    "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}}}


def test_a_scheme_the_engine_does_not_run_is_refused_at_submit_and_one_it_runs_is_accepted(redis_url,
                                                                                           tmp_path) -> None:
    folders = {}
    for name, quant in (("fp8", FP8), ("w4a16", W4A16), ("awq", {"quant_method": "awq", "bits": 4})):
        folder = folders[name] = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                        "quantization_config": quant}))
    settings = Settings(broker_url=redis_url, store_uri=str(tmp_path / "store"),
                        models=json.dumps({name: str(folder) for name, folder in folders.items()}))
    with serve(settings) as api:
        uri = api.put_input("rows.jsonl", b'{"q": "hello"}\n')

        def submit(model: str) -> str:
            return api.client.jobs.create({"input_uri": uri, "model": model, "prompt_column": "q"}).job_id

        for model, named in (("fp8", "compressed-tensors W8A8 float8"), ("awq", "awq 4-bit")):
            with pytest.raises(ApiError) as refused:
                submit(model)
            assert refused.value.status_code == 400
            assert f"model '{model}' cannot run here: its checkpoint is quantized" in refused.value.message
            assert named in refused.value.message
        assert submit("w4a16")  # a scheme the engine runs
