"""An adapter's KV blocks are keyed by its files' content: replaced under the same name, id and folder
it never reads blocks computed with the old files (prefix cache or KV store), while the same files
under another name or folder share them."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from bulkinfer.engine import LLM, LoRARequest, SamplingParams
from bulkinfer.engine.kv_connector.blob_store import LocalFolderBlobStore
from tests.engine.lora_adapters import make_adapter

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SHARED = [random.Random(7).randrange(5, 2048) for _ in range(48)]  # three full blocks
PROMPTS = [SHARED + [600 + row, 700 + row] for row in range(4)]


@pytest.fixture(scope="module")
def base_dir(checkpoint_factory) -> str:
    return str(checkpoint_factory(arch="llama"))


@pytest.fixture(scope="module")
def versions(base_dir) -> list[Path]:
    """Three adapters of one config (only their weights differ)."""
    return [make_adapter(base_dir, seed)[0] for seed in (31, 32, 33)]


def lora_llm(base_dir: str, dtype: str = "float32", **options) -> LLM:
    return LLM(model=base_dir, dtype=dtype, num_kv_blocks=128, enable_lora=True, max_loras=1,
               max_cpu_loras=1, kv_populate_seconds=0, **options)


def replace_files(folder: Path, source: Path) -> None:
    for file in source.iterdir():
        shutil.copy(file, folder / file.name)


def test_the_digest_follows_the_files_not_the_name_or_folder(base_dir, versions, tmp_path):
    engine = lora_llm(base_dir).engine
    copy = tmp_path / "copy"
    shutil.copytree(versions[0], copy)
    rslora = tmp_path / "rslora"
    shutil.copytree(versions[0], rslora)
    config = json.loads((rslora / "adapter_config.json").read_text())
    (rslora / "adapter_config.json").write_text(json.dumps({**config, "use_rslora": True}))
    digests = [engine.load_lora(LoRARequest(name, i + 1, str(folder))).digest
               for i, (name, folder) in enumerate([("v0", versions[0]), ("copy", copy), ("v1", versions[1]),
                                                   ("rslora", rslora)])]
    assert digests[0] == digests[1]  # the same files elsewhere, under another name
    assert len({digests[0], digests[2], digests[3]}) == 3  # other weights; the same weights scaled anew


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_adapter_replaced_in_place_never_reads_the_old_ones_blocks(base_dir, versions, tmp_path, dtype):
    folder = tmp_path / "adapter"
    shutil.copytree(versions[0], folder)
    lora = LoRARequest("a", 1, str(folder))  # the same name, id and folder throughout
    llm = lora_llm(base_dir, dtype)

    def run(request: LoRARequest):
        [output] = llm.generate([SHARED], GREEDY, lora_request=request)
        return output

    old = run(lora)
    assert run(lora).num_cached_tokens >= 32  # its own blocks are reused while its files stay
    llm.engine.load_lora(LoRARequest("other", 2, str(versions[2])))  # evicts "a" from host memory
    replace_files(folder, versions[1])
    replaced = run(lora)  # read again from its folder: the new files
    assert replaced.num_cached_tokens == 0
    new_files = LoRARequest("b", 3, str(versions[1]))
    assert run(new_files).num_cached_tokens >= 32  # the same files under another name share blocks
    assert llm.engine.scheduler.reset_prefix_cache()
    computed = run(new_files)
    assert computed.num_cached_tokens == 0
    assert replaced.token_ids == computed.token_ids != old.token_ids


def test_a_kv_store_never_serves_a_replaced_adapters_old_blocks(base_dir, versions, tmp_path):
    store = LocalFolderBlobStore(tmp_path / "store")
    folder = tmp_path / "adapter"
    shutil.copytree(versions[0], folder)
    lora = LoRARequest("a", 1, str(folder))

    def run() -> tuple[list[list[int]], LLM]:
        """A new engine (another worker) on the store."""
        llm = lora_llm(base_dir, kv_store=store, kv_store_min_tokens=0)
        outputs = [output.token_ids for output in llm.generate(PROMPTS, GREEDY, lora_request=lora)]
        llm.engine.kv_connector.wait_saved()
        return outputs, llm

    old, _ = run()
    _, same = run()
    assert same.engine.kv_store_stats()["hits_blocks"] == len(SHARED) // 16  # unchanged files: loaded
    replace_files(folder, versions[1])
    new, reader = run()
    assert reader.engine.kv_store_stats()["hits_blocks"] == 0
    assert new != old
