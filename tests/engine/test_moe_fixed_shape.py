"""The MoE block's fixed-shape forward (engine/models/moe_fixed_shape.py): what a GPU records as a
CUDA graph. Here on the CPU, through `decode_graphs=True` (the fixed-shape path, uncaptured): the
experts stored once as stacked tensors, the grouped_mm forward equal to the eager grouped one,
transformers' greedy tokens on every MoE family, and no read of the device from the host."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)
from torch.utils._python_dispatch import TorchDispatchMode

import bulkinfer.engine.models.sparse_moe as sparse_moe
from bulkinfer.benchmarks import moe_graphs
from bulkinfer.engine import LLM, SamplingParams, cpu_kernels
from bulkinfer.engine.attention import TorchPagedAttention
from bulkinfer.engine.checkpoints import num_parameters
from bulkinfer.engine.decode_graphs import decode_graph_mode
from bulkinfer.engine.models import load_model
from bulkinfer.engine.models.moe import MoeForCausalLM
from bulkinfer.engine.models.moe_fixed_shape import grouped_mm_records
from bulkinfer.engine.models.sparse_moe import MoeConfig, SparseMoeBlock
from tests.engine.hf_reference import (
    TEST_DEVICE,
    assert_greedy_by_teacher_forcing,
    assert_greedy_within_noise,
)
from tests.engine.test_llm_correctness import MOE_PROMPTS
from tests.engine.test_moe import BASE, random_block

MOE_FAMILIES = ["qwen3_moe", "mixtral", "qwen2_moe"]
BLOCK_CONFIGS = {
    "mixtral": ("MixtralForCausalLM", {"num_local_experts": 8, "num_experts_per_tok": 2}),
    "qwen3_moe": ("Qwen3MoeForCausalLM", {"num_experts": 8, "num_experts_per_tok": 3,
                                          "moe_intermediate_size": 16, "norm_topk_prob": False}),
    "qwen2_moe": ("Qwen2MoeForCausalLM", {"num_experts": 6, "num_experts_per_tok": 2,
                                          "moe_intermediate_size": 16, "norm_topk_prob": True,
                                          "shared_expert_intermediate_size": 40}),
}


def block_for(family: str, dtype: torch.dtype = torch.float32) -> SparseMoeBlock:
    arch, extra = BLOCK_CONFIGS[family]
    return random_block(MoeConfig.from_hf_dict(arch, {**BASE, **extra})).to(dtype)


def count_fixed_shape_calls(monkeypatch) -> list[int]:
    """Rows of every sparse block call that took the grouped_mm path."""
    calls: list[int] = []
    original = sparse_moe.fixed_shape_expert_outputs

    def counted(x, *args):  # noqa: ANN001, ANN202
        calls.append(x.shape[0])
        return original(x, *args)

    monkeypatch.setattr(sparse_moe, "fixed_shape_expert_outputs", counted)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_weights_are_stored_once_as_stacked_tensors(checkpoint_factory, dtype):
    """Each expert's Linear weight is a view into its layer's [E, 2I, H] / [E, H, I] tensors (built
    on the meta device, given memory and converted as the loader does), holding the checkpoint's
    values; the model's parameters count each weight once."""
    model_dir = checkpoint_factory(arch="mixtral")
    model = load_model(model_dir, TorchPagedAttention(), dtype=dtype)
    tensors = load_file(str(model_dir / "model.safetensors"))
    block = model.layers[2].mlp
    assert block.experts_gate_up.shape == (8, 2 * block.experts_down.shape[2], block.experts_down.shape[1])
    for index, expert in enumerate(block.experts):
        pairs = ((expert.gate_up_proj, block.experts_gate_up), (expert.down_proj, block.experts_down))
        for linear, stacked in pairs:
            assert linear.weight.dtype == dtype
            assert linear.weight.data_ptr() == stacked[index].data_ptr()
            assert linear.weight.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr()
    prefix = "model.layers.2.block_sparse_moe.experts.5."
    expected_gate_up = torch.cat([tensors[prefix + "w1.weight"], tensors[prefix + "w3.weight"]]).to(dtype)
    assert torch.equal(block.experts[5].gate_up_proj.weight, expected_gate_up)
    assert torch.equal(block.experts_down[5], tensors[prefix + "w2.weight"].to(dtype))
    assert sum(p.numel() for p in model.parameters()) == num_parameters("tiny", "mixtral")


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fixed_shape_block_equals_the_eager_block(family, dtype, monkeypatch):
    """The same experts for the same pairs in the same order and the same combine: the eager path's
    result to the GEMM library's rounding, with routing ties (a token twice) and an expert left
    without rows. Not bitwise: grouped_mm writes each expert's rows into one shared buffer, F.linear
    into a buffer of its own, and the CPU's BLAS may round by where a buffer starts (fp32 differed in
    the last bits on a Zen 4; the batch-invariant path, which is bitwise, never takes grouped_mm)."""
    block = block_for(family, dtype)
    calls = count_fixed_shape_calls(monkeypatch)
    x = torch.randn(13, 32, generator=torch.Generator().manual_seed(2)).to(dtype)
    x[3] = x[9]
    block.step_rows.single = 13  # a decode step: every row a single-token row
    eager = block(x)
    block.step_shape.fixed = True
    fixed = block(x)
    assert calls == [13]
    assert_rounding_apart(fixed, eager)
    assert_rounding_apart(fixed[3], fixed[9])
    assert torch.equal(block(x), fixed)  # deterministic: the same call, the same bits
    one_row = block(x[:1])  # one row: most experts get none
    block.step_shape.fixed = False
    assert_rounding_apart(one_row, block(x[:1]))


def assert_rounding_apart(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal but for the last bits of the dtype (a wrong expert, weight or pair order is far off)."""
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 1e-2}[actual.dtype]
    torch.testing.assert_close(actual, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fixed_shape_block_agrees_with_the_engine_cpu_kernels(dtype):
    """With the engine's CPU kernels the eager experts run the row kernel (its own summation
    order), so the two paths agree to rounding: within 1e-5 relative in fp32, 2% in bf16."""
    kernels = cpu_kernels.load()
    block = block_for("mixtral", dtype)
    for module in block.modules():
        if isinstance(module, sparse_moe.Linear):
            module.use_row_gemm(kernels, block.expert_rows)
    x = torch.randn(24, 32, generator=torch.Generator().manual_seed(4)).to(dtype)
    block.step_rows.single = 24
    eager = block(x)
    block.step_shape.fixed = True
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(block(x), eager, **tolerance)


def test_fixed_shape_block_reads_nothing_from_the_device():
    """Under FakeTensorMode tensors have shapes but no values: any host read of a value (.tolist(),
    .item()) or a shape that depends on values (bincount) raises. The eager grouped path does both;
    the fixed-shape path runs through."""
    block = block_for("qwen2_moe", torch.bfloat16)  # with the shared expert
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.randn(24, 32, dtype=torch.bfloat16)
        block.step_shape.fixed = True
        assert block(x).shape == (24, 32)
        block.step_shape.fixed = False
        with pytest.raises((DataDependentOutputException, DynamicOutputShapeException)):
            block(x)


class RecordOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


# Ops whose result is a host value or a shape read from the device: a CUDA graph cannot record them.
HOST_READS = ("_local_scalar_dense", "bincount", "nonzero", "unique")


def test_a_fixed_shape_moe_decode_step_reads_nothing_from_the_device(checkpoint_factory):
    """A whole padded decode step of a Mixtral model on the fixed-shape path: every op it dispatches,
    none a host read (the eager MoE step reads each expert's row count)."""
    llm = LLM(model=str(checkpoint_factory(arch="mixtral")), dtype="float32", num_kv_blocks=64,
              decode_graphs=True)
    llm.generate([MOE_PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=2))
    graphs = llm.engine.runner._decode_graphs()
    with RecordOps() as fixed:
        graphs._forward(8, 4)
    assert "_grouped_mm" in {op.split(".")[0] for op in fixed.ops}
    assert not [op for op in fixed.ops if op.split(".")[0] in HOST_READS]
    llm.engine.model.step_shape.fixed = False  # what the eager decode path runs: host reads
    block = llm.engine.model.sparse_blocks()[0]
    with RecordOps() as eager:
        block(torch.randn(8, block.experts_down.shape[1]))
    assert [op for op in eager.ops if op.split(".")[0] in HOST_READS]


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_moe_decode_steps_on_the_fixed_shape_path_match_transformers(checkpoint_factory, family, dtype,
                                                                     monkeypatch):
    """Padded decode steps through grouped_mm (with prefill steps eager beside them): transformers'
    greedy tokens in fp32, agreement within bf16 noise in bf16."""
    model_dir = str(checkpoint_factory(arch=family))
    llm = LLM(model=model_dir, device=TEST_DEVICE, dtype=dtype, num_kv_blocks=128, decode_graphs=True)
    graphs = llm.engine.runner._decode_graphs()
    # Captured on a GPU where grouped_mm records (benchmarks/gpu_check.sh); uncaptured on a CPU.
    assert graphs is not None
    assert graphs.capture == (TEST_DEVICE == "cuda" and llm.engine.model.graph_capturable)
    padded: list[int] = []
    forward = graphs._forward
    monkeypatch.setattr(graphs, "_forward", lambda rows, width: padded.append(rows) or forward(rows, width))
    calls = count_fixed_shape_calls(monkeypatch)
    prompts = MOE_PROMPTS[:5]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8))
    assert padded and max(padded) > len(prompts)  # padded batches ran
    assert calls and set(calls) <= set(padded)  # grouped_mm ran on the padded decode steps only
    assert not graphs.broken and not graphs.failed
    pairs = [(prompt, output.token_ids) for prompt, output in zip(prompts, outputs, strict=True)]
    if dtype == "float32":
        assert_greedy_by_teacher_forcing(pairs, model_dir, llm.engine.model)
    else:
        assert_greedy_within_noise(pairs, model_dir, llm.engine.model, torch.bfloat16)


def test_moe_decode_steps_record_where_grouped_mm_keeps_its_offsets_on_the_device(monkeypatch):
    """CUDA graphs by default for MoE models in bf16 on a Hopper-class GPU; eager decode steps where
    grouped_mm would copy its offsets to the host (fp32 or fp16 on CUDA, older GPUs) or cannot
    take the widths (a share of an expert that is not whole 16-byte rows)."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert grouped_mm_records(cuda, torch.bfloat16)
    assert not grouped_mm_records(cuda, torch.float32) and not grouped_mm_records(cuda, torch.float16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert not grouped_mm_records(cuda, torch.bfloat16)
    assert grouped_mm_records(torch.device("cpu"), torch.float32)

    arch, extra = BLOCK_CONFIGS["mixtral"]
    config = MoeConfig.from_hf_dict(arch, {**BASE, **extra})
    model = MoeForCausalLM(config, TorchPagedAttention())
    assert model.graph_capturable
    assert decode_graph_mode("cuda", None, model.graph_capturable) == (True, True)
    odd = dataclasses.replace(config, moe_intermediate_size=6)  # 24 bytes a row in fp32
    assert not MoeForCausalLM(odd, TorchPagedAttention()).graph_capturable
    assert decode_graph_mode("cuda", None, capturable=False) == (False, False)
    assert decode_graph_mode("cuda", True, capturable=False) == (True, False)


def test_a_block_grouped_mm_cannot_take_runs_the_eager_path_on_the_fixed_shape_path(monkeypatch):
    arch, extra = BLOCK_CONFIGS["qwen3_moe"]
    block = random_block(MoeConfig.from_hf_dict(arch, {**BASE, **extra, "moe_intermediate_size": 6}))
    calls = count_fixed_shape_calls(monkeypatch)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(5))
    eager = block(x)
    block.step_shape.fixed = True
    assert torch.equal(block(x), eager) and not calls


def test_the_gpu_checks_moe_step_runs_here_on_a_cpu(capsys):
    """benchmarks/gpu_check.sh's MoE step: the script parses, and its benchmark runs (uncaptured on a
    CPU), printing both speeds and the same tokens on both paths in fp32."""
    assert subprocess.run(["bash", "-n", "benchmarks/gpu_check.sh"], check=False).returncode == 0
    assert "bulkinfer.benchmarks.moe_graphs" in Path("benchmarks/gpu_check.sh").read_text()
    code = moe_graphs.main(["--device", "cpu", "--preset", "tiny", "--dtype", "float32", "--requests", "4",
                            "--max-tokens", "4", "--num-kv-blocks", "32"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "fixed-shape, uncaptured" in out and "tokens equal in 4/4 rows, 100.0% of each row" in out
