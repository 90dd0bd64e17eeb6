"""compressed-tensors checkpoints (W8A16, W4A16, W8A8 int8) load and run with their weights kept
quantized, against transformers in fp32 on the same dequantized weights (tests/support/
quantized_checkpoints.py writes both with compressed-tensors' own functions)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from bulkinfer.benchmarks.quant_checkpoints import (
    activation_args,
    calibrate_input_scales,
    fake_quantize_inputs,
    write_quantized_checkpoint,
)
from bulkinfer.engine import LLM, SamplingParams, cpu_kernels
from bulkinfer.engine.attention import TorchPagedAttention
from bulkinfer.engine.models import load_model
from bulkinfer.engine.models.llama_config import UnsupportedModelError
from bulkinfer.engine.models.loader import CheckpointError
from bulkinfer.engine.quant.linear import QuantizedLinear
from tests.engine.hf_reference import assert_same_greedy, engine_last_logits, hf_greedy, hf_model

PROMPTS = [[1, 17, 254, 1021, 33, 7, 400], [5, 900, 12, 12, 77], [300, 301, 302, 1800, 4, 9, 61, 2000, 150]]
NEW_TOKENS = 8

WEIGHT_ONLY = {
    "W8A16 channel": dict(bits=8),
    # groups of 8: compressed-tensors needs the group to divide the inputs (the tiny model's MLP has 344)
    "W4A16 group 8": dict(bits=4, group_size=8),
    "W4A16 group 8 asymmetric": dict(bits=4, group_size=8, symmetric=False),
    "W8A16 group 8 asymmetric, packed": dict(bits=8, group_size=8, symmetric=False, packed=True),
}


@pytest.fixture(scope="module")
def quantized_dirs(tmp_path_factory: pytest.TempPathFactory, checkpoint_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quantized")
    source = checkpoint_factory()
    folders = {name: write_quantized_checkpoint(source, root / re.sub(r"\W+", "_", name), **options)
               for name, options in WEIGHT_ONLY.items()}
    folders["W8A8 dynamic token"] = write_quantized_checkpoint(
        source, root / "w8a8", activations=activation_args(static=False, symmetric=True))
    scales = calibrate_input_scales(source, PROMPTS)
    folders["W8A8 static tensor"] = write_quantized_checkpoint(
        source, root / "w8a8_static", activations=activation_args(static=True, symmetric=True),
        input_scales=scales)
    folders["static scales"] = scales  # type: ignore[assignment]
    # groups of 32 (the small preset's widths divide by them): bf16 rows take AVX512-BF16's kernel
    folders["W4A16 group 32 asymmetric, small"] = write_quantized_checkpoint(
        checkpoint_factory(preset="small"), root / "w4a16_g32", bits=4, group_size=32, symmetric=False)
    return folders


@pytest.mark.parametrize("scheme", list(WEIGHT_ONLY))
def test_weight_only_schemes_give_transformers_greedy_tokens(quantized_dirs: dict[str, Path],
                                                             scheme: str) -> None:
    folder = quantized_dirs[scheme]
    twin = folder.with_name(folder.name + "-float")
    llm = LLM(model=str(folder), num_kv_blocks=64, dtype="float32")
    outputs = llm.generate(PROMPTS,
                           SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    model = load_model(folder, TorchPagedAttention(kernels=cpu_kernels.load()))
    model.use_cpu_kernels(cpu_kernels.load())
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        reference = hf_greedy(twin, prompt, NEW_TOKENS)
        assert_same_greedy(list(output.outputs[0].token_ids), reference, prompt, twin, model)
    assert llm.engine.quantization is not None and llm.engine.quantization.startswith("compressed-tensors W")
    projections = [m for m in llm.engine.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(projections) == 4 * 4  # qkv, o, gate_up, down in each of the tiny model's 4 layers
    bits = WEIGHT_ONLY[scheme]["bits"]
    for projection in projections:  # the weights stay integers, packed: 4-bit in half the bytes
        stored = sum(t.numel() * t.element_size() for t in (projection.weight, projection._packed)
                     if t is not None)
        assert stored <= projection.out_features * (projection.in_features + 32) * bits / 8


@pytest.mark.parametrize("scheme", ["W8A8 dynamic token", "W8A8 static tensor"])
def test_w8a8_logits_match_transformers_with_the_same_activation_rounding(quantized_dirs,
                                                                         scheme: str) -> None:
    folder = quantized_dirs[scheme]
    twin = folder.with_name(folder.name + "-float")
    static = scheme.endswith("static tensor")
    reference = hf_model(str(twin))
    quantized_reference = type(reference).from_pretrained(str(twin), dtype=torch.float32).eval()
    fake_quantize_inputs(quantized_reference, activation_args(static, True),
                         quantized_dirs["static scales"] if static else None)  # type: ignore[arg-type]
    kernels = cpu_kernels.load()
    model = load_model(folder, TorchPagedAttention(kernels=kernels))
    model.use_cpu_kernels(kernels)
    agree = 0
    for prompt in PROMPTS:
        ours = engine_last_logits(model, prompt)
        with torch.inference_mode():
            theirs = quantized_reference(torch.tensor([prompt])).logits[0, -1]
            unquantized = reference(torch.tensor([prompt])).logits[0, -1]
        # The same activation rounding on both sides: what is left is float summation order, and
        # the rare input that lands on the other side of a rounding boundary (one level of 255).
        assert (ours - theirs).abs().max() <= 2e-3 * theirs.abs().max() + 1e-4
        # Against unquantized activations the error is the int8 rounding's own: no more than the
        # reference's with the same rounding (measured on this model: 5.7% of the largest logit).
        rounding_error = float((theirs - unquantized).abs().max())
        assert float((ours - unquantized).abs().max()) <= 1.1 * rounding_error + 1e-3
        agree += int(ours.argmax() == unquantized.argmax())
    assert agree >= len(PROMPTS) - 1


def test_int8_rows_are_batch_invariant_and_match_the_pytorch_path(quantized_dirs) -> None:
    kernels = cpu_kernels.load()
    model = load_model(quantized_dirs["W8A8 dynamic token"], TorchPagedAttention(kernels=kernels))
    model.use_cpu_kernels(kernels)
    projection = model.layers[0].mlp.gate_up_proj
    assert isinstance(projection, QuantizedLinear)
    torch.manual_seed(0)
    rows = torch.randn(64, projection.in_features)
    batched = projection(rows)
    alone = torch.cat([projection(rows[i:i + 1]) for i in range(rows.shape[0])])
    assert torch.equal(batched, alone)  # integer sums: the same bits at 1 row and at 64
    projection.use_kernels(None, None)
    in_torch = projection(rows)
    assert torch.allclose(batched, in_torch, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("static", [False, True])
def test_asymmetric_activations_match_the_pytorch_path(quantized_dirs, tmp_path: Path, static: bool) -> None:
    """Per-token zero points at run time, or the checkpoint's static scale and zero point."""
    source = quantized_dirs["W8A8 dynamic token"]
    folder = write_quantized_checkpoint(source.with_name(source.name + "-float"), tmp_path / "asym",
                                        activations=activation_args(static=static, symmetric=False),
                                        input_scales=quantized_dirs["static scales"] if static else None,
                                        input_zero_point=-9)
    _assert_kernels_match_pytorch(folder)


@pytest.mark.parametrize("symmetric", [True, False])
def test_activations_quantized_per_call_match_the_pytorch_path(quantized_dirs, tmp_path: Path,
                                                               symmetric: bool) -> None:
    """dynamic per-tensor activations: one scale over the call's rows (no batch invariance there)."""
    folder = quantized_dirs["W8A8 dynamic token"]
    quant = json.loads((folder / "config.json").read_text())["quantization_config"]
    quant["config_groups"]["group_0"]["input_activations"].update(strategy="tensor", symmetric=symmetric)
    _assert_kernels_match_pytorch(_with_quantization(folder, tmp_path, quant))


def _assert_kernels_match_pytorch(folder: Path) -> None:
    kernels = cpu_kernels.load()
    model = load_model(folder, TorchPagedAttention(kernels=kernels))
    model.use_cpu_kernels(kernels)
    projection = model.layers[1].self_attn.qkv_proj
    rows = torch.randn(5, projection.in_features) + 0.7  # off-centre: the zero point matters
    with_kernels = projection(rows)
    projection.use_kernels(None, None)
    assert torch.allclose(with_kernels, projection(rows), rtol=1e-4, atol=1e-4)


def _with_quantization(folder: Path, tmp_path: Path, quant: dict) -> Path:
    import shutil

    target = tmp_path / "edited"
    shutil.copytree(folder, target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    return target


@pytest.mark.parametrize("change, named", [
    (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=2), "int2 weights"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(type="float"), "float8 weights"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="block"), "block weight strategy"),
    (lambda q: q.update(kv_cache_scheme={"num_bits": 8}), "kv cache scheme is not supported"),
])
def test_schemes_it_does_not_run_are_refused_by_name(quantized_dirs, tmp_path: Path, change,
                                                     named: str) -> None:
    folder = quantized_dirs["W8A16 channel"]
    quant = json.loads((folder / "config.json").read_text())["quantization_config"]
    change(quant)
    with pytest.raises(UnsupportedModelError, match=named):
        LLM(model=str(_with_quantization(folder, tmp_path, quant)), num_kv_blocks=16)


def test_a_quantized_lm_head_is_refused(quantized_dirs, tmp_path: Path) -> None:
    folder = quantized_dirs["W8A16 channel"]
    float_twin = folder.with_name(folder.name + "-float")
    target = write_quantized_checkpoint(float_twin, tmp_path / "head", ignore=())
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(target / "model.safetensors"))
    head = tensors["lm_head.weight"] if "lm_head.weight" in tensors else tensors["model.embed_tokens.weight"]
    scale = head.abs().amax(1, keepdim=True) / 127
    tensors["lm_head.weight"] = torch.round(head / scale).clamp(-128, 127).to(torch.int8)
    tensors["lm_head.weight_scale"] = scale
    save_file(tensors, str(target / "model.safetensors"))
    with pytest.raises(CheckpointError, match="lm_head is quantized"):
        load_model(target, TorchPagedAttention())


@pytest.mark.parametrize("options, named", [
    (dict(enable_lora=True), "LoRA adapters run over unquantized base models only"),
    (dict(tensor_parallel_size=2), "tensor parallel runs unquantized checkpoints only"),
])
def test_what_quantized_weights_do_not_run_with_yet_is_refused(quantized_dirs, options: dict,
                                                                named: str) -> None:
    with pytest.raises(ValueError, match=named):
        LLM(model=str(quantized_dirs["W4A16 group 8"]), num_kv_blocks=16, **options)


EXPERTS = ("lm_head", "re:.*experts.*", "re:.*shared_expert.*")


@pytest.mark.parametrize("arch", ["qwen2", "phi3", "gemma3", "mistral", "qwen2_moe"])
def test_every_dense_family_runs_quantized(checkpoint_factory, tmp_path: Path, arch: str) -> None:
    """Qwen2's q/k/v biases, Phi-3's own fused projections, Gemma 3's extra norms, Mistral's window;
    an MoE model with its attention quantized and its experts in the ignore list."""
    folder = write_quantized_checkpoint(checkpoint_factory(arch=arch), tmp_path / arch, bits=4, group_size=8,
                                        ignore=EXPERTS if arch == "qwen2_moe" else ("lm_head",))
    twin = folder.with_name(folder.name + "-float")
    llm = LLM(model=str(folder), num_kv_blocks=64, dtype="float32")
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    kernels = cpu_kernels.load()
    model = load_model(folder, TorchPagedAttention(kernels=kernels))
    model.use_cpu_kernels(kernels)
    for prompt, output in zip(PROMPTS[:2], llm.generate(PROMPTS[:2], params), strict=True):
        reference = hf_greedy(twin, prompt, NEW_TOKENS)
        assert_same_greedy(list(output.outputs[0].token_ids), reference, prompt, twin, model)
    assert any(isinstance(m, QuantizedLinear) for m in llm.engine.model.modules())


def test_quantized_moe_experts_are_refused_by_name(checkpoint_factory, tmp_path: Path) -> None:
    folder = write_quantized_checkpoint(checkpoint_factory(arch="qwen2_moe"), tmp_path / "moe", bits=8)
    with pytest.raises(CheckpointError, match="quantized MoE experts are not supported yet"):
        load_model(folder, TorchPagedAttention())


# each scheme once, each dtype twice (bf16 is emulated, slowly, on CPUs without it)
NATIVE_CASES = [("W8A8 dynamic token", "float32"), ("W8A8 static tensor", "bfloat16"),
                ("W4A16 group 8 asymmetric", "float32"), ("W8A16 channel", "bfloat16"),
                ("W4A16 group 32 asymmetric, small", "bfloat16")]


@pytest.mark.parametrize("scheme, dtype", NATIVE_CASES)
def test_native_decode_steps_give_the_python_paths_tokens_and_logprobs(quantized_dirs, monkeypatch,
                                                                      scheme: str, dtype: str) -> None:
    from tests.engine.test_native_decode import native_runs

    folder = str(quantized_dirs[scheme])
    native = LLM(model=folder, dtype=dtype, num_kv_blocks=64)
    assert native.engine.model.native_decode is not None  # the quantized kernels run from C
    python = LLM(model=folder, dtype=dtype, num_kv_blocks=64)
    python.engine.model.native_decode = None
    counts = native_runs(native, monkeypatch)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
    for ours, theirs in zip(native.generate(PROMPTS, params), python.generate(PROMPTS, params), strict=True):
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
        assert ours.outputs[0].logprobs == theirs.outputs[0].logprobs  # the same bits
    assert counts["steps"] >= NEW_TOKENS - 1
