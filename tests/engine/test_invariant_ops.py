"""The fixed-shape ops of batch invariance without native kernels (engine/invariant/): a row's bits
are the same alone and at any position among other rows, in bf16 and fp32; attention's are the same
however the prompt was chunked and whatever rows share a decode call. On the PyTorch path only (no
native kernels), on the CPU and, where there is one, a GPU."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from bulkinfer.engine.invariant import INVARIANT_BLOCK_ROWS, in_row_blocks
from bulkinfer.engine.invariant.cuda_settings import WORKSPACE_ENV, use_invariant_cuda_settings
from bulkinfer.engine.invariant.tiled_attention import KEY_TILE, decode_tiled, prefill_tiled
from bulkinfer.engine.models.layers import MLP, Linear, RMSNorm, onednn_linear_available

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
NO_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=NO_GPU)])
# Batch sizes around the block's edges and oneDNN's bf16 kernel switch (33-600 rows), and where
# the row under test sits among them.
ROW_COUNTS = [1, 2, 33, INVARIANT_BLOCK_ROWS - 1, INVARIANT_BLOCK_ROWS, INVARIANT_BLOCK_ROWS + 1, 200]
HIDDEN, WIDTH = 576, 1536  # SmolLM2-135M's sizes


def _a_row_among_others(op, row: torch.Tensor, rows: int, seed: int) -> list[torch.Tensor]:
    """``op``'s result for ``row`` at the first, a middle and the last position of ``rows`` rows."""
    generator = torch.Generator().manual_seed(seed)
    results = []
    for position in sorted({0, rows // 2, rows - 1}):
        batch = torch.randn((rows, *row.shape), generator=generator).to(row.dtype).to(row.device)
        batch[position] = row
        results.append(op(batch)[position])
    return results


def _assert_row_invariant(op, row: torch.Tensor) -> None:
    alone = op(row[None])[0]
    for rows in ROW_COUNTS:
        for seed, result in enumerate(_a_row_among_others(op, row, rows, rows)):
            assert torch.equal(result, alone), f"{rows} rows, draw {seed}"


def _linear(dtype: torch.dtype, device: str, packed: bool, out_features: int = WIDTH) -> Linear:
    torch.manual_seed(1)
    linear = Linear(HIDDEN, out_features, bias=False).to(dtype).to(device).requires_grad_(False)
    if packed:
        linear.pack_for_onednn(64)
    linear.fixed_row_blocks = True
    return linear


@DEVICES
@DTYPES
@pytest.mark.parametrize("packed", [False, True], ids=["F.linear", "oneDNN"])
def test_a_projection_rows_bits_do_not_depend_on_the_other_rows(dtype, device: str, packed: bool) -> None:
    if packed and not onednn_linear_available(torch.device(device), dtype):
        pytest.skip("oneDNN's packed weights are a CPU path")  # the F.linear case covers the device
    linear = _linear(dtype, device, packed)
    with torch.inference_mode():
        _assert_row_invariant(linear, torch.randn(HIDDEN).to(dtype).to(device))


@DEVICES
@DTYPES
def test_the_lm_heads_fp32_logits_of_a_row_do_not_depend_on_the_other_rows(dtype, device: str) -> None:
    head = _linear(dtype, device, packed=False, out_features=4000)
    with torch.inference_mode():
        _assert_row_invariant(head.forward_fp32, torch.randn(HIDDEN).to(dtype).to(device))


@DEVICES
@DTYPES
def test_norms_and_the_mlp_activation_of_a_row_do_not_depend_on_the_other_rows(dtype, device: str) -> None:
    torch.manual_seed(2)
    norm = RMSNorm(HIDDEN, 1e-5).to(dtype).to(device)
    norm.weight.copy_(torch.randn(HIDDEN))
    norm.fixed_row_blocks = True
    q_norm = RMSNorm(64, 1e-5).to(dtype).to(device)  # a q/k norm: [tokens, heads, head_dim]
    q_norm.fixed_row_blocks = True
    mlp = MLP.__new__(MLP)
    mlp.intermediate_size = 1000  # fp32 SiLU's scalar tail and thread split fall inside rows
    with torch.inference_mode():
        _assert_row_invariant(norm, torch.randn(HIDDEN).to(dtype).to(device))
        _assert_row_invariant(q_norm, torch.randn(9, 64).to(dtype).to(device))
        row = torch.randn(2000).mul(4).to(dtype).to(device)
        _assert_row_invariant(lambda x: in_row_blocks(mlp.activation, x), row)


@DEVICES
@pytest.mark.parametrize("op", [
    lambda x: torch.softmax(x, dim=-1), lambda x: torch.log_softmax(x, dim=-1),
    lambda x: torch.softmax(x, dim=-1).cumsum(dim=-1)], ids=["softmax", "log_softmax", "cumsum"])
def test_the_samplers_per_row_reductions_do_not_depend_on_the_row_count(device: str, op) -> None:
    """Sampling, logprobs and the MoE router reduce each row whole in one thread (torch's last-dim
    softmax and scan kernels split work by rows only, CPU and CUDA), so they are used as they are."""
    _assert_row_invariant(op, torch.randn(49_152, device=device) * 3)


def test_row_blocks_pad_the_last_block_and_call_the_op_with_one_shape() -> None:
    shapes = []

    def op(block: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(block.shape))
        return block * 2

    x = torch.arange(150 * 3, dtype=torch.float32).view(150, 3)
    assert torch.equal(in_row_blocks(op, x), x * 2)
    assert shapes == [(INVARIANT_BLOCK_ROWS, 3)] * 3


# ---- attention -------------------------------------------------------------------------------------

BLOCK_SIZE, KV_HEADS, HEADS, HEAD_DIM = 16, 2, 6, 32


def _cache(dtype: torch.dtype, device: str, tokens: int, seed: int) -> tuple[torch.Tensor, ...]:
    """K and V caches holding one sequence of `tokens` in shuffled blocks, and its block table."""
    generator = torch.Generator().manual_seed(seed)
    num_blocks = -(-tokens // BLOCK_SIZE) + 8
    shape = (num_blocks, KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    k_cache, v_cache = (torch.randn(shape, generator=generator).to(dtype).to(device) for _ in range(2))
    table = (torch.randperm(num_blocks - 1, generator=generator)[: -(-tokens // BLOCK_SIZE)] + 1).to(device)
    return k_cache, v_cache, table


@DEVICES
@DTYPES
@pytest.mark.parametrize("window", [None, 100])
def test_a_prompts_attention_is_the_same_however_it_was_chunked(dtype, device: str, window) -> None:
    tokens = KEY_TILE + 77
    k_cache, v_cache, table = _cache(dtype, device, tokens, 3)
    query = torch.randn(tokens, HEADS, HEAD_DIM).to(dtype).to(device)
    whole = prefill_tiled(query, k_cache, v_cache, table, tokens, window)
    for cuts in ([17, 300], [1, 65, tokens - 1], [KEY_TILE]):
        bounds = [0, *cuts, tokens]
        pieces = [prefill_tiled(query[a:b], k_cache, v_cache, table, b, window)
                  for a, b in zip(bounds, bounds[1:], strict=False)]
        assert torch.equal(torch.cat(pieces), whole), cuts
    # and it is attention: close to SDPA's
    keys, values = (cache[table].transpose(1, 2).reshape(-1, KV_HEADS, HEAD_DIM)[:tokens]
                    for cache in (k_cache, v_cache))
    positions = torch.arange(tokens, device=device)
    visible = positions[None, :] <= positions[:, None]
    if window is not None:
        visible &= positions[None, :] > positions[:, None] - window
    reference = F.scaled_dot_product_attention(query.float().transpose(0, 1), keys.float().transpose(0, 1),
                                               values.float().transpose(0, 1), attn_mask=visible,
                                               enable_gqa=True).transpose(0, 1)
    torch.testing.assert_close(whole.float(), reference, atol=2e-2 if dtype == torch.bfloat16 else 1e-5,
                               rtol=1e-2 if dtype == torch.bfloat16 else 1e-5)


@DEVICES
@DTYPES
@pytest.mark.parametrize("window", [None, 100])
def test_a_decode_rows_attention_is_the_same_alone_and_beside_longer_rows(dtype, device: str, window) -> None:
    k_cache, v_cache, _ = _cache(dtype, device, 16, 4)
    generator = torch.Generator().manual_seed(5)
    lengths = [40, 3 * KEY_TILE + 5, 1, 600, *torch.randint(1, 900, (70,), generator=generator).tolist()]
    width = -(-max(lengths) // BLOCK_SIZE)
    tables = torch.randint(1, k_cache.shape[0], (len(lengths), width), generator=generator).to(device)
    seq_lens = torch.tensor(lengths)
    query = torch.randn(len(lengths), HEADS, HEAD_DIM, generator=generator).to(dtype).to(device)
    together = decode_tiled(query, k_cache, v_cache, tables, seq_lens, window)
    fixed_tiles = decode_tiled(query, k_cache, v_cache, tables, seq_lens.to(device), window,
                               num_tiles=-(-width * BLOCK_SIZE // KEY_TILE))  # a CUDA graph's call
    assert torch.equal(fixed_tiles, together)
    for row in (0, 1, 2, 3, 71):
        own_blocks = tables[row:row + 1, : -(-lengths[row] // BLOCK_SIZE)]
        alone = decode_tiled(query[row:row + 1], k_cache, v_cache, own_blocks, seq_lens[row:row + 1], window)
        assert torch.equal(alone[0], together[row]), row


def test_the_cuda_settings_turn_off_reduced_precision_split_k_and_tf32(monkeypatch) -> None:
    matmul = torch.backends.cuda.matmul
    reductions = [f"allow_{kind}_reduced_precision_reduction{part}" for kind in ("bf16", "fp16")
                  for part in ("", "_split_k")]
    saved = {name: getattr(matmul, name) for name in ["allow_tf32", *reductions]}
    monkeypatch.delenv(WORKSPACE_ENV, raising=False)
    try:
        use_invariant_cuda_settings()
        assert os.environ[WORKSPACE_ENV] == ":4096:8"
        assert not any(getattr(matmul, name) for name in saved)
    finally:
        matmul.allow_tf32 = saved["allow_tf32"]
        for kind in ("bf16", "fp16"):
            setattr(matmul, f"allow_{kind}_reduced_precision_reduction",
                    (saved[f"allow_{kind}_reduced_precision_reduction"],
                     saved[f"allow_{kind}_reduced_precision_reduction_split_k"]))
