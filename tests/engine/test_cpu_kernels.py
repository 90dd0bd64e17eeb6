"""The native CPU kernels against PyTorch, built for this CPU (-march=native: AVX-512 here or not)
and for plain AVX2 (the 8-lane path, what AVX2-only machines run): paged decode attention over
random block tables (every supported head size, GQA groups across the 8-query chunk, sliding-window
starts, continuing a shared prefix's partial result), and the bf16 layer ops (residual + RMSNorm,
rotary, SiLU x up) against the PyTorch formulas they replace. The bf16 shared-prefix attention is
built where the CPU has AMX or AVX512-BF16 (the native build here when it does; never the AVX2
build), and then checked against the fp32 formula: on an AMX CPU both its AMX build and its
AVX512-BF16 build (the same flags without AMX, what AMD Zen 4/5 run), so each machine kind tests
every path it can run."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from bulkinfer.engine import cpu_kernels
from bulkinfer.engine.cpu_kernels import (
    CAUSAL_HEAD_DIMS,
    HEAD_DIMS,
    PREFIX_HEAD_DIMS,
    CpuKernels,
    build_and_open,
)
from bulkinfer.engine.dtype_choice import cpu_flags
from bulkinfer.engine.models.layers import RMSNorm, apply_rope

# "native": what the engine builds here (-march=native, under BULKINFER_CPU_ISA's cap when one is set)
BUILDS = {"native": cpu_kernels.native_flags(),
          "avx2": ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-fPIC", "-shared"]}
HAS_AMX = {"amx_bf16", "amx_tile"} <= cpu_flags()
HAS_PREFIX_KERNEL = HAS_AMX or "avx512_bf16" in cpu_flags()
# the prefix kernel's builds this CPU runs: the native one, and on AMX CPUs the dot-product one too
PREFIX_BUILDS = {"native": cpu_kernels.native_flags()}
if HAS_AMX:
    PREFIX_BUILDS["avx512_bf16"] = [*cpu_kernels.FLAGS, "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]
# the row kernel's builds: every build above (bf16 on AMX or on AVX512-BF16's dot product, by CPU)
ROW_BUILDS = {**BUILDS, **PREFIX_BUILDS}


@pytest.fixture(scope="module", params=list(BUILDS))
def kernels(request, build) -> CpuKernels:
    return build(request.param)


@pytest.fixture(scope="module", params=list(ROW_BUILDS))
def row_kernels(request, build) -> CpuKernels:
    return build(request.param)


@pytest.fixture(scope="module")
def build() -> Callable[[str], CpuKernels]:
    """Builds by name, each opened once for the module (the fixtures above share their flags). They
    are built by the engine's own build into its cache (cpu_kernels.cache_dir(), keyed by sources,
    flags, compiler and CPU, as cpu_kernels.load() builds): a build takes ~8 s on 2 cores, and the
    native one is the library the engine's tests load, built once for them all."""
    built: dict[str, CpuKernels] = {}

    def named(name: str) -> CpuKernels:
        if name not in built:
            built[name] = _build(name)
        return built[name]

    return named


def _build(name: str) -> CpuKernels:
    if name == "avx2" and not {"avx2", "fma"} <= cpu_flags():
        pytest.fail("this CPU has no AVX2: the suite's CPUs all do")
    built = build_and_open(cpu_kernels._compiler(), cpu_kernels.cache_dir(), ROW_BUILDS[name])
    assert built is not None, "the kernels did not build (see the log)"
    if name == "avx2":
        assert built.vector_lanes == 8
    return built


def reference_attention(q, k_cache, v_cache, table, first, count):
    """q [kvh, Q, D] over the row's tokens [first, count) read through its table: (out, lse) in fp32."""
    kv_heads, block, dim = k_cache.shape[1:]
    keys = k_cache[table].transpose(0, 1).reshape(kv_heads, -1, dim)[:, first:count].float()
    values = v_cache[table].transpose(0, 1).reshape(kv_heads, -1, dim)[:, first:count].float()
    scores = q.float() @ keys.transpose(-1, -2) * dim ** -0.5
    return torch.softmax(scores, dim=-1) @ values, torch.logsumexp(scores, dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("queries", [1, 3, 8, 9, 20])
def test_decode_attention_matches_pytorch(kernels: CpuKernels, dtype, head_dim: int, queries: int) -> None:
    generator = torch.Generator().manual_seed(head_dim * 100 + queries)
    blocks, kv_heads, block_size, rows, width = 64, 2, 16, 7, 5
    k_cache = torch.randn(blocks, kv_heads, block_size, head_dim, generator=generator).to(dtype)
    v_cache = torch.randn(blocks, kv_heads, block_size, head_dim, generator=generator).to(dtype)
    tables = torch.randint(1, blocks, (rows, width), generator=generator)
    counts = torch.tensor([1, 15, 16, 17, 40, 77, 80])
    first = torch.tensor([0, 3, 0, 16, 25, 0, 79])  # a sliding window starts inside or at a block edge
    q = torch.randn(rows, kv_heads, queries, head_dim, generator=generator).to(dtype)
    out, lse = kernels.decode_attention(q, k_cache, v_cache, tables, counts, first)
    assert out.dtype == dtype and lse.dtype == torch.float32
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding
    for r in range(rows):
        expected, expected_lse = reference_attention(q[r], k_cache, v_cache, tables[r], int(first[r]),
                                                     int(counts[r]))
        torch.testing.assert_close(out[r].float(), expected, atol=tolerance, rtol=tolerance)
        torch.testing.assert_close(lse[r], expected_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("kv_heads", [3, 5])
def test_decode_attention_of_many_rows_gives_each_row_its_bits_alone(
        kernels: CpuKernels, dtype, head_dim: int, kv_heads: int) -> None:
    """A big decode batch reads all of a row's kv heads in one pass (up to four at a time: with 5,
    a group of four and one alone), a small one a head at a time: a row's output and log-sum-exp
    are the same bits either way, and match PyTorch."""
    generator = torch.Generator().manual_seed(head_dim + kv_heads)
    rows, blocks, block_size, width, queries = 8 * torch.get_num_threads() + 5, 200, 16, 6, 3
    k_cache = torch.randn(blocks, kv_heads, block_size, head_dim, generator=generator).to(dtype)
    v_cache = torch.randn(blocks, kv_heads, block_size, head_dim, generator=generator).to(dtype)
    tables = torch.randint(1, blocks, (rows, width), generator=generator)
    counts = torch.randint(1, width * block_size + 1, (rows,), generator=generator)
    first = (torch.rand(rows, generator=generator) * counts * 0.5).long()  # some sliding-window starts
    q = torch.randn(rows, kv_heads, queries, head_dim, generator=generator).to(dtype)
    out, lse = kernels.decode_attention(q, k_cache, v_cache, tables, counts, first)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    for r in range(rows):
        alone_out, alone_lse = kernels.decode_attention(q[r: r + 1], k_cache, v_cache, tables[r: r + 1],
                                                        counts[r: r + 1], first[r: r + 1])
        assert torch.equal(out[r: r + 1], alone_out) and torch.equal(lse[r: r + 1], alone_lse), f"row {r}"
        expected, expected_lse = reference_attention(q[r], k_cache, v_cache, tables[r], int(first[r]),
                                                     int(counts[r]))
        torch.testing.assert_close(out[r].float(), expected, atol=tolerance, rtol=tolerance)
        torch.testing.assert_close(lse[r], expected_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_rescales_as_the_running_max_grows(kernels: CpuKernels, dtype) -> None:
    """The kernel's softmax runs in one pass: a query whose scores keep rising along its context
    (a new max at every block, from -100 to +100: far past what exp takes unshifted) matches the
    two-pass formula, and so does one whose largest score comes first."""
    blocks, block_size, dim = 16, 16, 64
    keys = torch.linspace(-100, 100, blocks * block_size)[:, None] * torch.ones(dim) / dim ** 0.5 * 8
    k_cache = keys.view(blocks, 1, block_size, dim).to(dtype)
    v_cache = torch.randn(blocks, 1, block_size, dim, generator=torch.Generator().manual_seed(3)).to(dtype)
    rising = torch.arange(blocks)[None, :]
    tables = torch.cat([rising, rising.flip(1)])  # max last, then max first
    counts = torch.full((2,), blocks * block_size)
    q = (torch.ones(2, 1, 3, dim) / 8 * torch.tensor([1.0, 0.5, 0.1])[:, None]).to(dtype)
    out, lse = kernels.decode_attention(q, k_cache, v_cache, tables, counts, torch.zeros(2, dtype=torch.long))
    # scores near 100 carry ~5e-5 of fp32 rounding from their 64-term sums, whichever order sums them
    tolerance = 2e-4 if dtype == torch.float32 else 1e-2
    for r in range(2):
        expected, expected_lse = reference_attention(q[r], k_cache, v_cache, tables[r], 0, int(counts[r]))
        assert torch.isfinite(out[r].float()).all()
        torch.testing.assert_close(out[r].float(), expected, atol=tolerance, rtol=tolerance)
        torch.testing.assert_close(lse[r], expected_lse, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_continues_a_prefix_partial_result_exactly(kernels: CpuKernels, dtype) -> None:
    """Attending blocks A then B from A's (output, lse) equals attending A + B at once."""
    generator = torch.Generator().manual_seed(7)
    k_cache = torch.randn(20, 3, 16, 64, generator=generator).to(dtype)
    v_cache = torch.randn(20, 3, 16, 64, generator=generator).to(dtype)
    q = torch.randn(4, 3, 3, 64, generator=generator).to(dtype)
    whole = torch.tensor([[1, 2, 3, 4, 5]] * 4)
    counts = torch.tensor([70, 65, 49, 80])
    prefix_out, prefix_lse = kernels.decode_attention(q, k_cache, v_cache, whole[:, :3], torch.full((4,), 48),
                                                      torch.zeros(4, dtype=torch.long))
    prefix_lse[2] = float("-inf")  # row 2 has no prefix part: it reads its whole context itself
    own = torch.where(torch.arange(4)[:, None] == 2, whole, torch.cat([whole[:, 3:], whole[:, :3]], 1))
    own_counts = torch.where(torch.arange(4) == 2, counts, counts - 48)
    zeros = torch.zeros(4, dtype=torch.long)
    out, lse = kernels.decode_attention(q, k_cache, v_cache, own, own_counts, zeros, (prefix_out, prefix_lse))
    reference, reference_lse = kernels.decode_attention(q, k_cache, v_cache, whole, counts,
                                                        torch.zeros(4, dtype=torch.long))
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), reference.float(), atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(lse, reference_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("queries", [1, 3, 9])
def test_rows_reading_the_same_blocks_get_the_bits_each_gets_alone(kernels: CpuKernels, dtype,
                                                                   queries: int) -> None:
    """A verification's positions (one table, one more token each, crossing into a new block), a
    window's later starts, and rows continuing prefix partials are read together in one run; each
    row's output and lse are bitwise what the row gets alone, and a row of another table between
    them ends the run without changing anything."""
    generator = torch.Generator().manual_seed(queries)
    k_cache = torch.randn(40, 2, 16, 64, generator=generator).to(dtype)
    v_cache = torch.randn(40, 2, 16, 64, generator=generator).to(dtype)
    verify = [3, 7, 9, 11, 30]  # counts 46..50 cross from block 3 (ends at 48) into block 4
    other = [5, 6, 8, 0, 0]
    tables = torch.tensor([verify] * 5 + [other] + [verify[:3] + [0, 0]] * 2)
    counts = torch.tensor([46, 47, 48, 49, 50, 33, 20, 21])
    first = torch.tensor([0, 0, 5, 17, 33, 0, 0, 2])  # a sliding window's starts, one past a block edge
    q = torch.randn(8, 2, queries, 64, generator=generator).to(dtype)
    init_out = torch.randn(8, 2, queries, 64, generator=generator).to(dtype)
    init_lse = torch.randn(8, 2, queries, generator=generator)
    init_lse[1] = float("-inf")  # this row starts afresh
    for initial in (None, (init_out, init_lse)):
        together = kernels.decode_attention(q, k_cache, v_cache, tables, counts, first, initial)
        for row in range(8):
            alone_initial = None if initial is None else (init_out[row:row + 1], init_lse[row:row + 1])
            alone = kernels.decode_attention(q[row:row + 1], k_cache, v_cache, tables[row:row + 1],
                                             counts[row:row + 1], first[row:row + 1], alone_initial)
            assert torch.equal(together[0][row], alone[0][0]), row
            assert torch.equal(together[1][row], alone[1][0]), row


def test_decode_attention_refuses_what_it_does_not_support(kernels: CpuKernels) -> None:
    q = torch.zeros(1, 1, 1, 24)
    cache = torch.zeros(4, 1, 16, 24)
    one = torch.ones(1, dtype=torch.long)
    assert not kernels.supports(torch.float32, 24, 16) and not kernels.supports(torch.float16, 64, 16)
    with pytest.raises(ValueError, match="unsupported or inconsistent"):
        kernels.decode_attention(q, cache, cache, torch.ones(1, 1, dtype=torch.long), one, one * 0)


def test_prefix_attention_exists_exactly_where_the_cpu_has_amx_or_avx512_bf16(kernels: CpuKernels,
                                                                              request) -> None:
    native = request.node.callspec.params["kernels"] == "native"
    assert kernels.supports_prefix_attention(torch.bfloat16, 64, 16) == (HAS_PREFIX_KERNEL and native)
    assert kernels.prefix_kind == (None if not (HAS_PREFIX_KERNEL and native)
                                   else "amx" if HAS_AMX else "avx512_bf16")
    assert not kernels.supports_prefix_attention(torch.float32, 64, 16)  # bf16 tiles only
    assert not kernels.supports_prefix_attention(torch.bfloat16, 80, 16)  # whole 32-dim tiles
    assert not kernels.supports_prefix_attention(torch.bfloat16, 64, 8)  # 16-key tiles


@pytest.mark.parametrize("head_dim", CAUSAL_HEAD_DIMS)
@pytest.mark.parametrize(("context", "length", "queries", "block_size"), [
    (0, 130, 3, 16),  # a whole prompt (SmolLM2's 3 queries per kv head), past two 64-key score blocks
    (0, 44, 3, 16),  # its last score block three key vectors (AVX-512) or two (AVX2) of four
    (37, 45, 3, 16),  # a chunk after 37 cached tokens, neither on a block boundary
    (200, 5, 8, 32),  # a short tail after a long context
    (3, 9, 1, 8),  # small blocks, one query per kv head
    (0, 1, 2, 16),  # one token
])
def test_causal_attention_matches_the_formula_in_fp32(kernels: CpuKernels, head_dim: int, context: int,
                                                      length: int, queries: int, block_size: int) -> None:
    """fp32 causal prefill from the cache: token i sees the first context + i + 1 keys of the chunk's
    blocks (in table order, stale slots past the chunk never), as close to the exact result as SDPA."""
    if not kernels.supports_causal_attention(torch.float32, head_dim):
        assert head_dim % kernels.vector_lanes != 0
        return
    generator = torch.Generator().manual_seed(context * 7 + length + head_dim)
    kv_heads, blocks = 2, 64
    k_cache = torch.randn(blocks, kv_heads, block_size, head_dim, generator=generator)
    v_cache = torch.randn(blocks, kv_heads, block_size, head_dim, generator=generator)
    seq_len = context + length
    table = torch.randperm(blocks - 1, generator=generator)[: -(-seq_len // block_size)] + 1
    q = torch.randn(length, kv_heads, queries, head_dim, generator=generator) * 2
    out = kernels.causal_attention(q, k_cache, v_cache, table, context)
    assert out.shape == q.shape and out.dtype == torch.float32
    for i in range(length):
        expected, _ = reference_attention(q[i], k_cache, v_cache, table, 0, context + i + 1)
        torch.testing.assert_close(out[i], expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(("rows", "shared_blocks"), [(16, 13), (5, 4), (40, 1)])
def test_causal_kernel_attends_a_decode_groups_shared_prefix_for_the_decode_kernel_to_continue(
        kernels: CpuKernels, rows: int, shared_blocks: int) -> None:
    """fp32 decode groups: every query of the group over all the shared keys (out and log-sum-exp),
    then each row's own part through the decode kernel continuing it: the attention over the whole
    context, within fp32 rounding."""
    if not kernels.supports_causal_attention(torch.float32, 64):
        return
    generator = torch.Generator().manual_seed(rows)
    k_cache = torch.randn(100, 3, 16, 64, generator=generator)
    v_cache = torch.randn(100, 3, 16, 64, generator=generator)
    shared = torch.arange(1, 1 + shared_blocks)
    own = torch.arange(20, 20 + 2 * rows).view(rows, 2)
    own_counts = torch.randint(1, 33, (rows,), generator=generator)
    q = torch.randn(rows, 3, 3, 64, generator=generator)
    keys = shared_blocks * 16
    out, lse = kernels.causal_attention(q, k_cache, v_cache, shared, keys, keys=keys, with_lse=True)
    for r in range(rows):
        expected, expected_lse = reference_attention(q[r], k_cache, v_cache, shared, 0, keys)
        torch.testing.assert_close(out[r], expected, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(lse[r], expected_lse, atol=1e-5, rtol=1e-5)
    whole, _ = kernels.decode_attention(q, k_cache, v_cache, torch.cat([shared.expand(rows, -1), own], 1),
                                        own_counts + keys, torch.zeros(rows, dtype=torch.long))
    zeros = torch.zeros(rows, dtype=torch.long)
    merged, _ = kernels.decode_attention(q, k_cache, v_cache, own, own_counts, zeros, (out, lse))
    torch.testing.assert_close(merged, whole, atol=2e-5, rtol=1e-5)


def test_causal_attention_reads_queries_in_place_and_writes_into_out(kernels: CpuKernels) -> None:
    """The engine hands the kernel its queries as a view of the QKV projection (rows further apart
    than one token's heads) and a slice of the step's output: the same result as from copies."""
    if not kernels.supports_causal_attention(torch.float32, 64):
        return
    generator = torch.Generator().manual_seed(8)
    k_cache = torch.randn(20, 2, 16, 64, generator=generator)
    v_cache = torch.randn(20, 2, 16, 64, generator=generator)
    table = torch.arange(3, 9)
    qkv = torch.randn(40, 10 * 64, generator=generator)  # 6 query heads, then K and V of 2 kv heads
    q = qkv[:, : 6 * 64].view(40, 2, 3, 64)
    step_out = torch.zeros(50, 6, 64)
    kernels.causal_attention(q, k_cache, v_cache, table, 50, out=step_out[10:].view(40, 2, 3, 64))
    expected = kernels.causal_attention(q.contiguous(), k_cache, v_cache, table, 50)
    assert torch.equal(step_out[10:].view(40, 2, 3, 64), expected) and not step_out[:10].any()


def test_causal_attention_refuses_what_it_does_not_support(kernels: CpuKernels) -> None:
    cache = torch.zeros(4, 1, 16, 64)
    q, table = torch.zeros(2, 1, 1, 64), torch.ones(1, dtype=torch.long)
    assert not kernels.supports_causal_attention(torch.bfloat16, 64)  # bf16: the prefix kernel's
    assert not kernels.supports_causal_attention(torch.float32, 80)
    with pytest.raises(ValueError, match="causal_attention"):
        kernels.causal_attention(q.bfloat16(), cache.bfloat16(), cache.bfloat16(), table, 0)
    with pytest.raises(ValueError, match="causal_attention"):
        kernels.causal_attention(q, cache, cache, table, 15)  # 17 keys, one 16-key block


def packed_qkv(lengths: list[int], kv_heads: int, groups: int, head_dim: int, dtype: torch.dtype,
               seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed sequences' (starts, q, k, v) as an embedding pass has them: q and v views of one fused
    projection (rows apart), k a tensor of its own (as after rotary): every stride differs."""
    generator = torch.Generator().manual_seed(seed)
    tokens, q_size, kv_size = sum(lengths), kv_heads * groups * head_dim, kv_heads * head_dim
    fused = (torch.randn(tokens, q_size + 2 * kv_size, generator=generator) * 2).to(dtype)
    q = fused[:, :q_size].view(tokens, kv_heads, groups, head_dim)
    k = fused[:, q_size:q_size + kv_size].reshape(tokens, kv_heads, head_dim).clone()
    v = fused[:, q_size + kv_size:].view(tokens, kv_heads, head_dim)
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    return starts, q, k, v


def packed_reference(starts: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     causal: bool) -> torch.Tensor:
    """Each sequence over itself in fp32, sequence by sequence: [tokens, kv_heads, groups, dim]."""
    tokens, kv_heads, groups, dim = q.shape
    out = torch.empty(tokens, kv_heads, groups, dim)
    for first, end in zip(starts[:-1].tolist(), starts[1:].tolist(), strict=True):
        queries = q[first:end].float().permute(1, 2, 0, 3)  # [kv_heads, groups, n, dim]
        keys, values = (t[first:end].float().transpose(0, 1)[:, None] for t in (k, v))
        scores = queries @ keys.transpose(-1, -2) * dim ** -0.5
        if causal:
            n = end - first
            scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out[first:end] = (torch.softmax(scores, dim=-1) @ values).permute(2, 0, 1, 3)
    return out


# Lengths around the kernels' tiles (16 keys, 32 queries, 24-query fp32 items), longest first.
PACKED_LENGTHS = [250, 130, 33, 32, 17, 16, 5, 1]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("head_dim", "kv_heads", "groups"), [(32, 12, 1), (64, 2, 3)])
def test_packed_attention_attends_each_sequence_over_itself_in_fp32(kernels: CpuKernels, causal: bool,
                                                                    head_dim: int, kv_heads: int,
                                                                    groups: int) -> None:
    """An embedding pass's attention (BERT: bidirectional, 12 heads of 32; a decoder embedder:
    causal, grouped-query): every sequence sees its own tokens only, as the formula says."""
    starts, q, k, v = packed_qkv(PACKED_LENGTHS, kv_heads, groups, head_dim, torch.float32, seed=head_dim)
    out = torch.empty(q.shape)
    kernels.packed_attention(q, k, v, starts, causal, out)
    torch.testing.assert_close(out, packed_reference(starts, q, k, v, causal), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("head_dim", "kv_heads", "groups"), [(32, 12, 1), (64, 2, 3), (128, 1, 2)])
def test_packed_attention_attends_each_sequence_over_itself_in_bf16(prefix_kernels: CpuKernels, causal: bool,
                                                                    head_dim: int, kv_heads: int,
                                                                    groups: int) -> None:
    starts, q, k, v = packed_qkv(PACKED_LENGTHS, kv_heads, groups, head_dim, torch.bfloat16, seed=head_dim)
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    prefix_kernels.packed_attention(q, k, v, starts, causal, out)
    # bf16: the probabilities and the output are rounded to bf16
    torch.testing.assert_close(out.float(), packed_reference(starts, q, k, v, causal), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_sequence_gets_the_same_bits_whatever_else_is_in_the_batch(build, dtype) -> None:
    """A text's vector must not depend on the texts it was batched with (re-runs, dedup and retries
    compare them): its attention output alone equals, bit for bit, its output among others."""
    if dtype == torch.bfloat16 and not HAS_PREFIX_KERNEL:
        pytest.skip("no bf16 packed kernel on this CPU (neither AMX nor AVX512-BF16)")
    kernels = build("native")
    starts, q, k, v = packed_qkv(PACKED_LENGTHS, 4, 1, 32, dtype, seed=7)
    out = torch.empty(q.shape, dtype=dtype)
    kernels.packed_attention(q, k, v, starts, False, out)
    for first, end in zip(starts[:-1].tolist(), starts[1:].tolist(), strict=True):
        alone = torch.empty(q[first:end].shape, dtype=dtype)
        kernels.packed_attention(q[first:end], k[first:end], v[first:end], torch.tensor([0, end - first]),
                                 False, alone)
        assert torch.equal(alone, out[first:end])


def test_packed_attention_refuses_what_it_does_not_support(kernels: CpuKernels) -> None:
    starts, q, k, v = packed_qkv([5, 3], 2, 1, 32, torch.float32, seed=1)
    out = torch.empty(q.shape)
    for bad_starts in ([0, 5, 9], [1, 5, 8], [0, 5, 5, 8]):  # past the tokens, not from 0, an empty sequence
        with pytest.raises(ValueError, match="packed_attention"):
            kernels.packed_attention(q, k, v, torch.tensor(bad_starts), False, out)
    with pytest.raises(ValueError, match="packed_attention"):  # a head size the kernel is not built for
        narrow = out[..., :16].contiguous()
        kernels.packed_attention(q[..., :16], k[..., :16], v[..., :16], starts, False, narrow)


@pytest.fixture(scope="module", params=list(PREFIX_BUILDS))
def prefix_kernels(request, build) -> CpuKernels:
    """A build of the prefix kernel, on a CPU with AMX or AVX512-BF16 (elsewhere it does not exist:
    the test above); named for the unit it first ran on."""
    if not HAS_PREFIX_KERNEL:
        pytest.skip("this CPU has neither AMX nor AVX512-BF16: the engine keeps SDPA's kernel in bf16")
    built = build(request.param)
    assert built.supports_prefix_attention(torch.bfloat16, 64, 16)
    assert built.prefix_kind == ("amx" if HAS_AMX and request.param == "native" else "avx512_bf16")
    return built


@pytest.mark.parametrize("head_dim", PREFIX_HEAD_DIMS)
@pytest.mark.parametrize(("queries", "rows_per_group", "groups", "shared_blocks", "block_size"), [
    (3, 64, 4, 25, 16),  # SmolLM2's decode step: 4 instructions of 400 tokens, 9 heads over 3
    (1, 7, 1, 1, 16),  # one block (16 keys: half a P x V tile), 7 queries (most of a tile padding)
    (4, 5, 2, 3, 16),  # 20 queries: a second tile of 32 mostly padding
    (8, 9, 3, 2, 32),  # larger blocks
])
def test_prefix_attention_matches_the_fp32_formula(prefix_kernels: CpuKernels, head_dim: int, queries: int,
                                                   rows_per_group: int, groups: int, shared_blocks: int,
                                                   block_size: int) -> None:
    """Rows in any order, several groups over their own blocks; rows outside every group untouched."""
    generator = torch.Generator().manual_seed(head_dim + queries)
    kv_heads, blocks = 2, 128
    k_cache = torch.randn(blocks, kv_heads, block_size, head_dim, generator=generator).to(torch.bfloat16)
    v_cache = torch.randn(blocks, kv_heads, block_size, head_dim, generator=generator).to(torch.bfloat16)
    num_rows = groups * rows_per_group + 3
    q = (torch.randn(num_rows, kv_heads, queries, head_dim, generator=generator) * 2).to(torch.bfloat16)
    rows = torch.randperm(num_rows, generator=generator)[: groups * rows_per_group]
    block_ids = torch.randint(1, blocks, (groups, shared_blocks), generator=generator)
    out = torch.zeros_like(q)
    lse = torch.full((num_rows, kv_heads, queries), float("-inf"))
    prefix_kernels.prefix_attention(q, k_cache, v_cache, rows, block_ids, out, lse)
    for group in range(groups):
        table = block_ids[group]
        count = shared_blocks * block_size
        for row in rows[group * rows_per_group: (group + 1) * rows_per_group]:
            expected, expected_lse = reference_attention(q[row], k_cache, v_cache, table, 0, count)
            # bf16: the probabilities and the output are rounded to bf16
            torch.testing.assert_close(out[row].float(), expected, atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(lse[row], expected_lse, atol=1e-4, rtol=1e-5)
    untouched = torch.ones(num_rows, dtype=torch.bool)
    untouched[rows] = False
    assert bool((out[untouched] == 0).all()) and bool(torch.isinf(lse[untouched]).all())


@pytest.mark.parametrize("head_dim", PREFIX_HEAD_DIMS)
@pytest.mark.parametrize(("context", "length", "queries", "block_size"), [
    (0, 70, 3, 16),  # a whole prompt: causal from its first token (SmolLM2's 3 queries per kv head)
    (37, 45, 3, 16),  # a chunk after 37 cached tokens, neither on a block boundary
    (160, 5, 8, 32),  # a short tail after a long context (the causal triangle mostly skipped)
    (0, 1, 1, 16),  # one token
])
def test_prefix_attention_runs_causal_prefill(prefix_kernels: CpuKernels, head_dim: int, context: int,
                                              length: int, queries: int, block_size: int) -> None:
    """Causal mode: row i of the chunk sees the first context + i + 1 keys of its blocks, the keys
    past the chunk's end (stale cache slots) never."""
    generator = torch.Generator().manual_seed(context + length + head_dim)
    kv_heads, blocks = 2, 64
    k_cache = torch.randn(blocks, kv_heads, block_size, head_dim, generator=generator).to(torch.bfloat16)
    v_cache = torch.randn(blocks, kv_heads, block_size, head_dim, generator=generator).to(torch.bfloat16)
    seq_len = context + length
    table = torch.randperm(blocks - 1, generator=generator)[: -(-seq_len // block_size)] + 1
    q = (torch.randn(length, kv_heads, queries, head_dim, generator=generator) * 2).to(torch.bfloat16)
    out, lse = torch.zeros_like(q), torch.empty(length, kv_heads, queries)
    prefix_kernels.prefix_attention(q, k_cache, v_cache, torch.arange(length), table[None], out, lse,
                         causal_base=context)
    for i in range(length):
        expected, expected_lse = reference_attention(q[i], k_cache, v_cache, table, 0, context + i + 1)
        torch.testing.assert_close(out[i].float(), expected, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse[i], expected_lse, atol=1e-4, rtol=1e-5)


def test_prefix_attention_reads_queries_in_place(prefix_kernels: CpuKernels) -> None:
    """Queries as a view of the QKV projection (rows apart by more than their heads), causal and
    not: the same bits as from a contiguous copy."""
    generator = torch.Generator().manual_seed(9)
    k_cache = torch.randn(20, 2, 16, 64, generator=generator).to(torch.bfloat16)
    v_cache = torch.randn(20, 2, 16, 64, generator=generator).to(torch.bfloat16)
    qkv = torch.randn(40, 10 * 64, generator=generator).to(torch.bfloat16)
    q = qkv[:, : 6 * 64].view(40, 2, 3, 64)
    for causal_base, blocks in ((50, torch.arange(3, 9)[None]), (-1, torch.tensor([[4, 5], [6, 7]]))):
        rows = torch.arange(40)
        results = []
        for query in (q, q.contiguous()):
            out, lse = torch.zeros(40, 2, 3, 64, dtype=torch.bfloat16), torch.full((40, 2, 3), float("-inf"))
            prefix_kernels.prefix_attention(query, k_cache, v_cache, rows, blocks, out, lse, causal_base)
            results.append((out, lse))
        assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_prefix_attention_then_decode_attention_equals_one_pass(prefix_kernels: CpuKernels) -> None:
    """The cascade as the engine runs it: the prefix's (output, lse) continued by each row's own part."""
    kernels = prefix_kernels
    generator = torch.Generator().manual_seed(3)
    k_cache = torch.randn(30, 3, 16, 64, generator=generator).to(torch.bfloat16)
    v_cache = torch.randn(30, 3, 16, 64, generator=generator).to(torch.bfloat16)
    q = torch.randn(5, 3, 3, 64, generator=generator).to(torch.bfloat16)
    whole = torch.tensor([[4, 5, 6, 7, 8 + r] for r in range(5)])
    counts = torch.tensor([70, 65, 79, 80, 66])
    initial = (torch.empty_like(q), torch.full((5, 3, 3), float("-inf")))
    kernels.prefix_attention(q, k_cache, v_cache, torch.arange(5), whole[:1, :4], *initial)
    zeros = torch.zeros(5, dtype=torch.long)
    out, lse = kernels.decode_attention(q, k_cache, v_cache, whole[:, 4:], counts - 64, zeros, initial)
    reference, reference_lse = kernels.decode_attention(q, k_cache, v_cache, whole, counts, zeros)
    torch.testing.assert_close(out.float(), reference.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, reference_lse, atol=1e-4, rtol=1e-5)


def test_prefix_attention_refuses_what_it_does_not_support(prefix_kernels: CpuKernels) -> None:
    kernels = prefix_kernels
    cache = torch.zeros(4, 1, 16, 64, dtype=torch.bfloat16)
    q = torch.zeros(2, 1, 1, 64, dtype=torch.bfloat16)
    lse = torch.zeros(2, 1, 1)
    rows, blocks = torch.arange(2), torch.ones(1, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="prefix_attention"):
        kernels.prefix_attention(q, cache, cache, rows, blocks, torch.zeros(2, 1, 1, 64), lse)  # fp32 out
    with pytest.raises(ValueError, match="prefix_attention"):
        kernels.prefix_attention(q, cache, cache, rows[:1], torch.ones(2, 1, dtype=torch.long),
                                 torch.zeros_like(q), lse)  # 1 row for 2 groups


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 steps apart two bf16 tensors are, element-wise."""
    def ordered(x: torch.Tensor) -> torch.Tensor:
        bits = x.view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)
    return (ordered(a) - ordered(b)).abs()


def assert_nearly_bitwise(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Equal but for a last-place rounding flip on a few elements (fp32 intermediates that differ
    in their last bit land on the other side of a bf16 rounding boundary)."""
    apart = _ulps_apart(ours, theirs)
    assert int(apart.max()) <= 1, f"{int(apart.max())} bf16 ulps apart"
    assert float((apart > 0).float().mean()) < 0.01


def assert_matches(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """bf16: nearly bitwise (above); fp32: within a few fp32 ulps (sums in another order, our exp)."""
    if ours.dtype == torch.bfloat16:
        assert_nearly_bitwise(ours, theirs)
    else:
        torch.testing.assert_close(ours, theirs, rtol=4e-6, atol=1e-6)


LAYER_DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])


@LAYER_DTYPES
def test_add_rms_norm_matches_the_pytorch_norm_and_residual(kernels: CpuKernels, dtype) -> None:
    generator = torch.Generator().manual_seed(3)
    norm = RMSNorm(576, 1e-5)
    norm.weight.copy_(torch.randn(576, generator=generator))
    norm = norm.to(dtype)
    x = torch.randn(37, 576, generator=generator).to(dtype)
    residual = (torch.randn(37, 576, generator=generator) * 4).to(dtype)
    expected_out, expected_residual = norm(x.clone(), residual.clone())  # PyTorch: no kernels set
    plain = norm(x)
    norm.kernels = kernels
    out, new_residual = norm(x.clone(), residual.clone())
    assert torch.equal(new_residual, expected_residual)  # the residual add is one rounding either way
    assert_matches(out, expected_out)
    assert_matches(norm(x), plain)


@LAYER_DTYPES
def test_rope_matches_the_pytorch_rotary_in_place_on_strided_rows(kernels: CpuKernels, dtype) -> None:
    generator = torch.Generator().manual_seed(4)
    tokens, heads, dim = 11, 9, 64
    qkv = torch.randn(tokens, heads * dim + 2 * 3 * dim, generator=generator).to(dtype)
    positions = torch.arange(tokens) * 37.0
    freqs = positions[:, None] / 10000 ** (torch.arange(0, dim, 2) / dim)
    cos, sin = freqs.cos().to(dtype)[:, None, :], freqs.sin().to(dtype)[:, None, :]
    q = qkv[:, : heads * dim].view(tokens, heads, dim)  # rows strided by the fused qkv width
    expected = apply_rope(q.clone(), cos, sin)
    ours = apply_rope(q, cos, sin, kernels)
    assert ours.data_ptr() == q.data_ptr()  # in place
    if dtype == torch.bfloat16:
        assert torch.equal(ours, expected)
    else:  # the compiler may fuse a product and a sum into one rounding
        torch.testing.assert_close(ours, expected, rtol=2e-7, atol=1e-6)


@LAYER_DTYPES
def test_silu_and_mul_matches_pytorch(kernels: CpuKernels, dtype) -> None:
    generator = torch.Generator().manual_seed(5)
    gate_up = (torch.randn(19, 2 * 344, generator=generator) * 6).to(dtype)  # 344: a tail
    gate, up = gate_up.split(344, dim=-1)
    assert_matches(kernels.silu_and_mul(gate_up), F.silu(gate).mul_(up))


def test_bf16_silu_is_correctly_rounded_for_every_bf16_input(kernels: CpuKernels) -> None:
    """Every finite bf16 gate value (up = 1): the kernel's silu is the fp64 silu rounded to bf16,
    except where the result is too small to matter (below ~1e-36 the exps flush or clamp)."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    gate = bits.view(torch.bfloat16)
    gate = gate[torch.isfinite(gate)]
    gate_up = torch.cat([gate, torch.ones_like(gate)]).view(1, -1)
    ours = kernels.silu_and_mul(gate_up).view(-1).double()
    exact = gate.double() * torch.sigmoid(gate.double())
    expected = exact.float().to(torch.bfloat16).double()  # fp64 -> fp32 is exact enough here
    wrong = ours != expected
    assert (exact[wrong].abs() < 1e-30).all(), gate[wrong & (exact.abs() >= 1e-30)][:5]


def row_kernel_dtypes(kernels: CpuKernels) -> list[torch.dtype]:
    """The dtypes the row kernel can run in this build: its fp32 code is built everywhere (and
    tested at either vector width, even where the engine keeps oneDNN: AVX2), bf16 where AMX or
    AVX512-BF16 is."""
    return [torch.float32, *([torch.bfloat16] if torch.bfloat16 in kernels.row_gemm_dtypes else [])]


def test_row_kernel_runs_bf16_exactly_where_the_cpu_multiplies_bf16(row_kernels: CpuKernels, request) -> None:
    build = request.node.callspec.params["row_kernels"]
    expected = None if build == "avx2" or not HAS_PREFIX_KERNEL else "amx" if HAS_AMX and build == "native" \
        else "avx512_bf16"
    assert row_kernels.row_gemm_bf16_kind == expected
    assert (torch.bfloat16 in row_kernels.row_gemm_dtypes) == (expected is not None)
    assert (torch.float32 in row_kernels.row_gemm_dtypes) == (row_kernels.vector_lanes == 16)
    assert cpu_kernels.row_gemm_dtypes(16, False) == (torch.float32,)  # AVX-512 of any vendor
    assert cpu_kernels.row_gemm_dtypes(8, True) == (torch.bfloat16,)
    assert cpu_kernels.row_gemm_dtypes(8, False) == ()


@pytest.mark.parametrize(("out_features", "in_features"), [(96, 64), (50, 96), (960, 576), (33, 160)])
@pytest.mark.parametrize("bias", [False, True])
def test_row_kernel_matches_a_matmul(row_kernels: CpuKernels, monkeypatch, out_features: int,
                                     in_features: int, bias: bool) -> None:
    """Every row count through the kernel's blocks and tails (12 rows a block in fp32, 2 x 16 in
    bf16 on AMX, 8 on the dot product), columns past the last whole panel, with and without a bias."""
    monkeypatch.setattr(row_kernels, "row_gemm_dtypes", tuple(row_kernel_dtypes(row_kernels)))
    generator = torch.Generator().manual_seed(out_features + in_features)
    for dtype in row_kernel_dtypes(row_kernels):
        weight = (torch.randn(out_features, in_features, generator=generator) / 8).to(dtype)
        b = torch.randn(out_features, generator=generator).to(dtype) if bias else None
        packed = row_kernels.pack_row_gemm(weight)
        for rows in (1, 5, 12, 13, 16, 17, 31, 32, 33, 70, 128, 150):  # from 128 rows: the prefill order
            x = torch.randn(rows, in_features, generator=generator).to(dtype)
            expected = x.float() @ weight.float().T + (b.float() if b is not None else 0)
            ours = row_kernels.row_gemm(x, packed, out_features, b)
            assert ours.dtype == dtype and ours.shape == (rows, out_features)
            tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's one rounding
            torch.testing.assert_close(ours.float(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.skipif(not HAS_PREFIX_KERNEL, reason="bf16 rows need AMX or AVX512-BF16")
@pytest.mark.parametrize("name", list(PREFIX_BUILDS))
@pytest.mark.parametrize("bias", [False, True])
def test_row_kernel_gives_bf16_rows_fp32_sums_for_logits(build, name: str, bias: bool) -> None:
    """The LM head's rows in bf16: the fp32 sums as they are (within fp32 summation-order error of
    an fp32 matmul of the same bf16 values; most of them not bf16 values), whose bf16 rounding is
    exactly the kernel's bf16 output, for every row count through its blocks and tails."""
    row_kernels = build(name)
    generator = torch.Generator().manual_seed(21)
    weight = (torch.randn(1000, 576, generator=generator) / 8).bfloat16()
    b = torch.randn(1000, generator=generator).bfloat16() if bias else None
    packed = row_kernels.pack_row_gemm(weight)
    for rows in (1, 7, 16, 17, 33, 70, 140):
        x = torch.randn(rows, 576, generator=generator).bfloat16()
        logits = row_kernels.row_gemm(x, packed, 1000, b, fp32_out=True)
        expected = x.float() @ weight.float().T + (b.float() if b is not None else 0)
        assert logits.dtype == torch.float32
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-4)
        assert (logits != logits.bfloat16().float()).float().mean() > 0.9  # not rounded on the way
        assert torch.equal(logits.bfloat16(), row_kernels.row_gemm(x, packed, 1000, b))


def test_row_kernel_gives_a_row_the_same_bits_whatever_else_is_in_the_batch(row_kernels: CpuKernels,
                                                                             monkeypatch) -> None:
    """Speculative verification and decoding must agree bit for bit: a row alone, first, last or in
    the middle of 1 to 300 rows gets the same result; written into a view of a larger output too."""
    monkeypatch.setattr(row_kernels, "row_gemm_dtypes", tuple(row_kernel_dtypes(row_kernels)))
    generator = torch.Generator().manual_seed(11)
    for dtype in row_kernel_dtypes(row_kernels):
        weight = torch.randn(200, 576, generator=generator).to(dtype)
        packed = row_kernels.pack_row_gemm(weight)
        row = torch.randn(1, 576, generator=generator).to(dtype)
        alone = row_kernels.row_gemm(row, packed, 200, None)
        for rows, at in ((2, 0), (13, 12), (40, 17), (128, 0), (300, 299), (300, 140)):
            batch = torch.randn(rows, 576, generator=generator).to(dtype)
            batch[at] = row[0]
            in_batch = row_kernels.row_gemm(batch, packed, 200, None)[at]
            assert torch.equal(in_batch, alone[0]), (dtype, rows, at)
        larger = torch.full((5, 200), 7.0, dtype=dtype)
        row_kernels.row_gemm(row.expand(3, -1), packed, 200, None, out=larger[1:4])
        assert torch.equal(larger[1:4], alone.expand(3, -1)) and bool((larger[[0, 4]] == 7).all())


def test_row_kernel_refuses_what_it_does_not_support(row_kernels: CpuKernels, monkeypatch) -> None:
    monkeypatch.setattr(row_kernels, "row_gemm_dtypes", (torch.float32,))
    with pytest.raises(ValueError, match="pack_row_gemm"):
        row_kernels.pack_row_gemm(torch.zeros(16, 64, dtype=torch.float16))
    packed = row_kernels.pack_row_gemm(torch.zeros(16, 64))
    with pytest.raises(ValueError, match="row_gemm"):
        row_kernels.row_gemm(torch.zeros(3, 64), packed, 16, torch.zeros(15))  # a bias of the wrong size
    with pytest.raises(ValueError, match="row_gemm"):
        row_kernels.row_gemm(torch.zeros(3, 64), packed, 16, None, out=torch.zeros(3, 16)[:, ::2].T)
    assert not row_kernels.supports_row_gemm(torch.zeros(16, 40, dtype=torch.bfloat16))  # not whole AMX tiles


def test_a_linear_runs_single_token_rows_through_the_row_kernel_and_the_rest_through_onednn(
        row_kernels: CpuKernels, monkeypatch) -> None:
    """In a step that holds decodes (first) and a prefill chunk, the decode rows get the bits they
    get in a decode-only step, and the chunk's rows what oneDNN gives."""
    from bulkinfer.engine.models.layers import Linear
    from bulkinfer.engine.models.step_rows import StepRows

    monkeypatch.setattr(row_kernels, "row_gemm_dtypes", tuple(row_kernel_dtypes(row_kernels)))
    generator = torch.Generator().manual_seed(12)
    for dtype in row_kernel_dtypes(row_kernels):
        linear = Linear(128, 96, bias=True).to(dtype).requires_grad_(False)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(96, 128, generator=generator))
            linear.bias.copy_(torch.randn(96, generator=generator))
        linear.pack_for_onednn()
        rows = StepRows()
        assert linear.use_row_gemm(row_kernels, rows) and linear.packed_weight is not None
        x = torch.randn(40, 128, generator=generator).to(dtype)
        rows.single = 5
        mixed = linear(x)
        rows.single = 40
        decodes_only = linear(x[:5])
        assert torch.equal(mixed[:5], decodes_only)
        assert torch.equal(mixed[5:], linear._onednn(x)[5:])
        assert not linear.use_row_gemm(None, rows) and linear.row_weight is None
        torch.testing.assert_close(linear(x), mixed, rtol=1e-2, atol=1e-2)  # F.linear now


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_strided_qkv_views_where_index_copy_would(kernels: CpuKernels, dtype) -> None:
    torch.manual_seed(0)
    tokens, heads, dim = 37, 3, 64
    qkv = torch.randn(tokens, (9 + 2 * heads) * dim).to(dtype)  # key/value are views into it
    key = qkv[:, 9 * dim:(9 + heads) * dim].view(tokens, heads, dim)
    value = qkv[:, (9 + heads) * dim:].view(tokens, heads, dim)
    k_cache = torch.zeros(20, heads, 16, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    rows = torch.randperm(k_cache.numel() // dim)[: tokens * heads]
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected_k.view(-1, dim).index_copy_(0, rows, key.reshape(-1, dim))
    expected_v.view(-1, dim).index_copy_(0, rows, value.reshape(-1, dim))
    kernels.store_kv(key, value, k_cache, v_cache, rows)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    with pytest.raises(ValueError, match="store_kv"):
        kernels.store_kv(key, value, k_cache, v_cache, rows[:-1])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # the causal and the prefix kernel's scratch
def test_two_engines_stepping_at_once_in_one_process_each_get_their_own_outputs(
        tiny_checkpoint: Path, dtype: str) -> None:
    """A worker serving two models runs two engines in two threads: the kernels' reusable scratch
    (packed K/V) is per thread, so neither corrupts the other's attention (it did when shared)."""
    from bulkinfer.engine import LLM, SamplingParams

    options = {"max_model_len": 512, "num_kv_blocks": 128, "max_num_seqs": 16, "dtype": dtype}
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    prompts = [f"def function_{n}(argument): return " * (n % 5 + 1) for n in range(12)]

    def three_runs() -> list[list[str]]:  # the 2nd and 3rd hit the prefix cache (bf16 rounds differently)
        llm = LLM(str(tiny_checkpoint), **options)
        return [[output.text for output in llm.generate(prompts, greedy)] for _ in range(3)]

    expected = three_runs()  # one engine alone
    outputs: dict[str, list[list[str]]] = {}

    def run(name: str) -> None:
        outputs[name] = three_runs()

    threads = [threading.Thread(target=run, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert sorted(outputs) == ["a", "b"]
    assert outputs["a"] == expected and outputs["b"] == expected


def test_no_compiler_means_the_pytorch_paths(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert build_and_open(None, tmp_path) is None
        assert build_and_open(str(tmp_path / "no-such-cc"), tmp_path) is None
    assert "no C compiler" in caplog.text and "native CPU kernels unavailable" in caplog.text


def test_kernels_can_be_turned_off_and_the_engine_then_runs_pytorch(monkeypatch, tiny_checkpoint) -> None:
    from bulkinfer.engine import LLM, SamplingParams
    from tests.engine.hf_reference import assert_same_greedy, hf_greedy

    cpu_kernels.load.cache_clear()
    monkeypatch.setenv(cpu_kernels.DISABLE_ENV, "0")
    try:
        assert cpu_kernels.load() is None
        llm = LLM(str(tiny_checkpoint), dtype="float32", num_kv_blocks=64)
        assert llm.engine.model.layers[0].self_attn.backend.kernels is None
        prompt = list(range(5, 75))
        [output] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8))
        assert_same_greedy(output.token_ids, hf_greedy(tiny_checkpoint, prompt, 8), prompt, tiny_checkpoint,
                           llm.engine.model)
    finally:
        cpu_kernels.load.cache_clear()


# ---- the sparse MoE block's element ops (moe_ops.c) ------------------------------------------------


@LAYER_DTYPES
@pytest.mark.parametrize("normalize", [True, False])
def test_moe_route_is_softmax_then_top_k_then_renormalisation(kernels: CpuKernels, dtype,
                                                              normalize: bool) -> None:
    generator = torch.Generator().manual_seed(11)
    # distinct in every row (eighths, exact in bf16): no ties, whose order torch.topk leaves open
    logits = torch.stack([torch.randperm(60, generator=generator) - 30 for _ in range(37)]).div(8).to(dtype)
    experts, weights = kernels.moe_route(logits, 4, normalize)
    probs = torch.softmax(logits.float(), dim=-1)
    expected_weights, expected_experts = torch.topk(probs, 4, dim=-1)
    if normalize:
        expected_weights = expected_weights / expected_weights.sum(dim=-1, keepdim=True)
    assert experts.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(experts, expected_experts)  # random logits: no ties
    torch.testing.assert_close(weights, expected_weights, rtol=1e-6, atol=1e-7)  # an exp's last bits


def test_moe_route_picks_the_lower_expert_among_equal_probabilities(kernels: CpuKernels) -> None:
    """torch.topk orders ties as its partial sort leaves them ([1, 3] here); the kernel, which both
    MoE paths route with on CPU, always takes the lower expert first."""
    logits = torch.tensor([[0.1, 0.3, 0.3, 0.3, 0.0, 0.0, 0.0, 0.0],
                           [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                           [0.0, 2.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0]])
    experts, weights = kernels.moe_route(logits, 2, True)
    assert experts.tolist() == [[1, 2], [0, 1], [1, 5]]
    assert weights[0, 0] == weights[0, 1] == 0.5 and weights[1].tolist() == [0.5, 0.5]


@LAYER_DTYPES
@pytest.mark.parametrize("fp32_weights", [True, False])
def test_moe_combine_gives_the_bits_of_the_python_paths_weighted_sum(kernels: CpuKernels, dtype,
                                                                     fp32_weights: bool) -> None:
    """SparseMoeBlock.grouped_experts' weighting (Mixtral: an fp32 product rounded once; Qwen: weights
    in the model dtype) and its sum over slots, which decode_layers.c must reproduce bit for bit."""
    generator = torch.Generator().manual_seed(12)
    rows, top_k, hidden = 29, 4, 200  # 200: a tail past whole vectors
    outputs = (torch.randn(rows * top_k, hidden, generator=generator) * 5).to(dtype)
    outputs[:8, :6] = -0.0  # a row whose every contribution is -0.0: the sum from +0 gives +0
    order = torch.randperm(rows * top_k, generator=generator)  # outputs[i] is pair order[i]
    weights = torch.rand(rows, top_k, generator=generator)
    if not fp32_weights:
        weights = weights.to(dtype)
    pair_weights = weights.reshape(-1).index_select(0, order)[:, None]
    if fp32_weights:
        weighted = (outputs.float() * pair_weights).to(dtype)
    else:
        weighted = outputs.clone().mul_(pair_weights)
    by_pair = torch.empty_like(weighted).index_copy_(0, order, weighted)
    expected = by_pair.view(rows, top_k, hidden).sum(dim=1)
    position = torch.empty_like(order).index_copy_(0, order, torch.arange(rows * top_k)).view(rows, top_k)
    ours = kernels.moe_combine(outputs, position, weights.float())
    assert torch.equal(ours.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       expected.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


@LAYER_DTYPES
def test_moe_shared_add_is_the_sigmoid_gated_shared_expert(kernels: CpuKernels, dtype) -> None:
    generator = torch.Generator().manual_seed(13)
    out = torch.randn(21, 100, generator=generator).to(dtype)
    gate = (torch.randn(21, 1, generator=generator) * 4).to(dtype)
    shared = torch.randn(21, 100, generator=generator).to(dtype)
    expected = out + torch.sigmoid(gate) * shared
    ours = kernels.moe_shared_add_(out.clone(), gate, shared)
    if dtype == torch.float32:
        torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-6)
    else:  # one bf16 rounding apart where the sigmoids' last fp32 bits straddle a rounding boundary
        torch.testing.assert_close(ours.float(), expected.float(), rtol=1e-2, atol=1e-2)
        assert float((ours != expected).float().mean()) < 0.02
