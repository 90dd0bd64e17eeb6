"""Checkpoints load from views of the mapped files, so a model is not held twice while it loads, and a
model whose oneDNN copy would not fit in memory runs on its plain weights instead of failing to start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from bulkinfer.engine.attention import TorchPagedAttention
from bulkinfer.engine.models import loader
from bulkinfer.engine.models.layers import Linear
from bulkinfer.engine.models.mapped_safetensors import mapped_tensors


def rss_anon_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    pytest.skip("no RssAnon in /proc/self/status on this platform")


def test_mapped_tensors_equal_safetensors_own_reads_in_every_dtype_and_shape(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(3, 5, generator=gen), "bf16": torch.randn(7, generator=gen).bfloat16(),
        "f16": torch.randn(2, 2, 2, generator=gen).half(), "i8": torch.arange(-5, 6, dtype=torch.int8),
        "u8": torch.arange(9, dtype=torch.uint8).view(3, 3), "i32": torch.tensor([1 << 30, -7]),
        "i64": torch.tensor([1 << 40]), "flags": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    file = tmp_path / "model.safetensors"
    mapped, reference = mapped_tensors(file), load_file(file)
    assert mapped.keys() == reference.keys()
    for name, tensor in reference.items():
        assert mapped[name].dtype == tensor.dtype and mapped[name].shape == tensor.shape, name
        assert torch.equal(mapped[name], tensor), name


def test_a_mapped_checkpoint_is_read_from_the_page_cache_not_copied(tmp_path: Path) -> None:
    big = torch.randn(64 << 18)  # 64 MiB of fp32
    save_file({"w": big}, str(tmp_path / "model.safetensors"))
    before = rss_anon_bytes()
    [tensor] = loader.read_safetensors(tmp_path, torch.float32).values()
    assert float(tensor.sum()) == pytest.approx(float(big.sum()), rel=1e-4)  # every page touched
    assert rss_anon_bytes() - before < 16 << 20
    converted = loader.read_safetensors(tmp_path, torch.bfloat16)["w"]  # another dtype: a copy
    assert converted.dtype == torch.bfloat16 and torch.equal(converted, big.bfloat16())


def test_sharded_checkpoints_refuse_a_tensor_in_two_shards(tmp_path: Path) -> None:
    save_file({"a": torch.ones(2)}, str(tmp_path / "one.safetensors"))
    save_file({"a": torch.zeros(2)}, str(tmp_path / "two.safetensors"))
    (tmp_path / loader.INDEX_FILE).write_text(json.dumps({"weight_map": {"a": "one.safetensors",
                                                                         "b": "two.safetensors"}}))
    with pytest.raises(loader.CheckpointError, match="tensor 'a' appears in more than one shard"):
        loader.read_safetensors(tmp_path, torch.float32)


def test_a_model_whose_packed_copy_would_not_fit_runs_on_its_plain_weights(
        tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    if not loader.onednn_linear_available(torch.device("cpu"), torch.float32):
        pytest.skip("this build of torch packs no weights for oneDNN")  # nothing to choose
    packed = loader.load_model(tiny_checkpoint, TorchPagedAttention(), torch.float32)
    monkeypatch.setattr(loader, "available_memory_bytes", lambda: 1 << 10)
    plain = loader.load_model(tiny_checkpoint, TorchPagedAttention(), torch.float32)
    assert "not packing weights for oneDNN" in caplog.text
    pairs = zip(packed.modules(), plain.modules(), strict=True)
    linears = [(a, b) for a, b in pairs if isinstance(a, Linear)]
    assert all(a.packed_weight is not None and b.packed_weight is None for a, b in linears)
    x = torch.randn(5, linears[0][0].in_features)
    torch.testing.assert_close(plain.layers[0].self_attn.qkv_proj(x), packed.layers[0].self_attn.qkv_proj(x),
                               rtol=1e-5, atol=1e-5)
