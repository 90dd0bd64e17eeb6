"""Native CPU kernels of the engine: C compiled once per machine, used where they exist.

Decode attention is memory-bound and small per request, so in PyTorch its cost is the gathering
of each request's blocks into a contiguous tensor and the per-call overhead of a kernel built for
long queries. `decode_attention.c` reads K/V straight from the paged cache instead; on CPUs with
AMX (or, without it, AVX512-BF16's dot product), `prefix_attention.c` attends the blocks a group of
rows shares (an instruction) and bf16 causal prefill chunks, also straight from the cache. They are
compiled with the machine's C compiler (`$CC`, else `cc`) and OpenMP (`-march=native`, less what is
above the project's ISA cap `BULKINFER_CPU_ISA`, so the library is cached per CPU kind, cap and
source, in `$BULKINFER_KERNEL_CACHE` or ~/.cache/bulkinfer/kernels) and loaded with ctypes; OpenMP
resolves to the libgomp torch already loaded, so the kernels share torch's threads. No compiler, a
failed build or `BULKINFER_CPU_KERNELS=0`: the engine uses its PyTorch path (same results within
rounding), and says why once in its log.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bulkinfer.cpu_isa import active_cap, compiler_flags, describe_cap
from bulkinfer.engine.cpu_kernels.quant import QuantKernels

logger = logging.getLogger(__name__)

# The slowest to compile first (a build compiles them in this order, several at once: the last ones
# running are then short).
SOURCES = [Path(__file__).with_name(name)
           for name in ("decode_attention.c", "causal_attention.c", "quant_gemm.c", "row_gemm.c",
                        "prefix_attention.c", "layer_ops.c", "kv_store.c", "moe_ops.c", "lora_ops.c",
                        "decode_layers.c")]
HEADERS = [Path(__file__).with_name("simd.h")]
DISABLE_ENV = "BULKINFER_CPU_KERNELS"  # "0": never build or use the native kernels
CACHE_ENV = "BULKINFER_KERNEL_CACHE"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared"]
ABI_VERSION = 19
HEAD_DIMS = (16, 32, 64, 80, 96, 128)  # the head sizes decode_attention.c is specialised for
PREFIX_HEAD_DIMS = (32, 64, 96, 128)  # prefix_attention.c: whole 32-dim AMX tiles
CAUSAL_HEAD_DIMS = (32, 64, 96, 128)  # causal_attention.c: at most 16 vectors a row
# prefix_attention_kind() and row_gemm_bf16_available(): the unit their bf16 products run on
BF16_UNITS = {1: "amx", 2: "avx512_bf16"}
LAYER_OP_DTYPES = (torch.bfloat16, torch.float32)  # layer_ops.c
_POINTER = ctypes.c_void_p
_INT = ctypes.c_int64
_DECODE_ARGUMENTS = [_POINTER, _POINTER, _POINTER, _POINTER, _INT, _POINTER, _POINTER, _INT, _INT, _INT, _INT,
                     _INT, ctypes.c_float, _POINTER, _POINTER, _POINTER, _POINTER]


class CpuKernels:
    """The loaded library; each method checks what it is handed before passing raw pointers."""

    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self.vector_lanes = int(library.kernel_vector_lanes())  # 16 with AVX-512, else 8
        self._decode = {torch.float32: _declare(library.decode_attention_f32, _DECODE_ARGUMENTS),
                        torch.bfloat16: _declare(library.decode_attention_bf16, _DECODE_ARGUMENTS)}
        suffixes = {torch.bfloat16: "bf16", torch.float32: "f32"}
        self._add_rms_norm = {dtype: _declare(getattr(library, f"add_rms_norm_{suffix}"),
                                              [_POINTER] * 4 + [_INT, _INT, ctypes.c_float])
                              for dtype, suffix in suffixes.items()}
        self._rope = {dtype: _declare(getattr(library, f"rope_{suffix}"), [_POINTER] * 3 + [_INT] * 4)
                      for dtype, suffix in suffixes.items()}
        self._silu_and_mul = {dtype: _declare(getattr(library, f"silu_and_mul_{suffix}"),
                                              [_POINTER] * 2 + [_INT] * 2)
                              for dtype, suffix in suffixes.items()}
        self._store_kv = _declare(library.store_kv, [_POINTER] * 5 + [_INT] * 4)
        # The sparse MoE block's element ops (moe_ops.c), shared by its Python path and decode_layers.c.
        self._moe_route = {dtype: _declare(getattr(library, f"moe_route_{suffix}"), [_POINTER] + [_INT] * 5
                                           + [_POINTER] * 2)
                           for dtype, suffix in suffixes.items()}
        self._moe_combine = {dtype: _declare(getattr(library, f"moe_combine_{suffix}"),
                                             [_POINTER] * 4 + [_INT] * 3)
                             for dtype, suffix in suffixes.items()}
        self._moe_shared_add = {dtype: _declare(getattr(library, f"moe_shared_add_{suffix}"),
                                                [_POINTER] * 3 + [_INT] * 2)
                                for dtype, suffix in suffixes.items()}
        # Each row's LoRA update from its adapter's slot (lora_ops.c), shared by the Python path
        # (engine/lora/slots.py) and decode_layers.c.
        self._lora_update = {dtype: _declare(getattr(library, f"lora_update_{suffix}"),
                                             [_POINTER, _INT, _POINTER, _INT, _POINTER, _INT] + [_POINTER] * 3
                                             + [_INT] * 2)
                             for dtype, suffix in suffixes.items()}
        # bf16 shared-prefix attention: built only for CPUs with AMX or AVX512-BF16, usable once Linux
        # grants AMX's tile state (where the build uses AMX).
        self._prefix = None
        if hasattr(library, "prefix_attention_bf16") and library.prefix_attention_available() == 1:
            self._prefix = _declare(library.prefix_attention_bf16,
                                    [_POINTER] * 5 + [_INT] * 9 + [ctypes.c_float] + [_POINTER] * 3)
        self.prefix_kind = BF16_UNITS.get(int(library.prefix_attention_kind())) if self._prefix else None
        # Scratch the kernels pack K/V into, reused call to call: one per calling thread, since two
        # engines of one process (a worker serving two models) call these kernels at the same time.
        self._scratch = threading.local()
        packed_arguments = [_POINTER] * 7 + [_INT] * 8 + [ctypes.c_float, _POINTER, _POINTER]
        self._packed = {torch.float32: _declare(library.packed_attention_f32, packed_arguments)}
        if self._prefix is not None:
            self._packed[torch.bfloat16] = _declare(library.packed_attention_bf16,
                                                    [*packed_arguments, _POINTER])
        self._causal_f32 = _declare(library.causal_attention_f32, [_POINTER] * 4 + [_INT] * 8
                                    + [ctypes.c_float, _POINTER, _POINTER, _POINTER])
        # Projections of single-token rows (row_gemm.c): fp32 where the build has AVX-512, bf16 on AMX
        # or AVX512-BF16 (see row_gemm_dtypes).
        self.row_gemm_bf16_kind = BF16_UNITS.get(int(library.row_gemm_bf16_available()))
        self.row_gemm_dtypes = row_gemm_dtypes(self.vector_lanes, self.row_gemm_bf16_kind is not None)
        self._row_panel_f32 = int(library.row_gemm_panel_width_f32())
        self._row_pack = {dtype: _declare(getattr(library, f"row_gemm_pack_{suffix}"),
                                          [_POINTER, _INT, _INT, _POINTER])
                          for dtype, suffix in suffixes.items()}
        # Every decoder layer of a pure decode step in one call (engine/models/native_decode.py).
        self._decode_layers = library.decode_layers
        self._decode_layers.argtypes = [_POINTER, _POINTER]
        self._decode_layers.restype = None
        self.has_prefix_decode_layers = bool(library.decode_layers_can_attend_prefixes())
        self._row_gemm = {dtype: _declare(getattr(library, f"row_gemm_{suffix}"),
                                          [_POINTER, _INT, _POINTER, _POINTER, _POINTER] + [_INT] * 4)
                          for dtype, suffix in suffixes.items()}
        # bf16 rows with fp32 results: the LM head's logits (row_gemm_bf16_f32).
        self._row_gemm_to_f32 = _declare(library.row_gemm_bf16_f32,
                                         [_POINTER, _INT, _POINTER, _POINTER, _POINTER] + [_INT] * 4)
        # Quantized checkpoints' projections (quant_gemm.c, engine/quant/).
        self.quant = QuantKernels(library, self)

    def _scratch_buffer(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """This thread's scratch `name` of at least `numel` elements, grown as inputs grow."""
        buffer = getattr(self._scratch, name, None)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=dtype)
            setattr(self._scratch, name, buffer)
        return buffer

    def supports(self, dtype: torch.dtype, head_dim: int, block_size: int) -> bool:
        return (dtype in self._decode and head_dim in HEAD_DIMS and head_dim % self.vector_lanes == 0
                and block_size % self.vector_lanes == 0)

    def decode_attention(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        num_tokens: torch.Tensor,
        first_token: torch.Tensor,
        initial: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of ``query [R, kv_heads, Q, dim]`` (the Q query rows that read each kv head)
        over each row r's tokens ``[first_token[r], num_tokens[r])``, counted along its row of
        ``block_tables [R, W]`` in the cache ``[blocks, kv_heads, block_size, dim]``. Returns the
        output (query's dtype) and the log-sum-exp of the scaled scores ``[R, kv_heads, Q]`` (fp32).
        ``initial``: (output, lse) of an earlier part of each query's context (a shared prefix) to
        continue from; an lse of -inf means none. Every row must see at least one token."""
        rows, kv_heads, queries, head_dim = query.shape
        block_size = k_cache.shape[-2]
        consistent = (
            query.dtype == k_cache.dtype == v_cache.dtype
            and k_cache.shape[1:] == (kv_heads, block_size, head_dim) == v_cache.shape[1:]
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and block_tables.dtype == num_tokens.dtype == first_token.dtype == torch.int64
            and len(num_tokens) == len(first_token) == len(block_tables) == rows
        )
        if initial is not None:
            consistent = consistent and initial[0].shape == query.shape and initial[0].dtype == query.dtype \
                and initial[1].shape == query.shape[:-1] and initial[1].dtype == torch.float32
            initial = (initial[0].contiguous(), initial[1].contiguous())
        if not (consistent and self.supports(query.dtype, head_dim, block_size)):
            raise ValueError("decode_attention: unsupported or inconsistent inputs")
        query = query.contiguous()
        block_tables, num_tokens, first_token = (
            block_tables.contiguous(), num_tokens.contiguous(), first_token.contiguous())
        out = torch.empty_like(query)
        lse = torch.empty(rows, kv_heads, queries, dtype=torch.float32)
        initial_out, initial_lse = (initial[0].data_ptr(), initial[1].data_ptr()) if initial else (None, None)
        self._decode[query.dtype](
            query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
            block_tables.stride(0), num_tokens.data_ptr(), first_token.data_ptr(), rows, kv_heads, queries,
            head_dim, block_size, head_dim ** -0.5, initial_out, initial_lse, out.data_ptr(), lse.data_ptr(),
            torch.get_num_threads())
        return out, lse


    def supports_prefix_attention(self, dtype: torch.dtype, head_dim: int, block_size: int) -> bool:
        return (self._prefix is not None and dtype == torch.bfloat16 and head_dim in PREFIX_HEAD_DIMS
                and block_size % 16 == 0)

    def prefix_attention(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        rows: torch.Tensor,
        block_ids: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        causal_base: int = -1,
    ) -> None:
        """Attention of ``query [R, kv_heads, Q, dim]`` rows ``rows`` (``groups * n``, group after
        group) over their group's shared blocks ``block_ids [groups, k]`` of the cache ``[blocks,
        kv_heads, block_size, dim]``: writes the output into ``out`` (like ``query``) and the
        log-sum-exp of the scaled scores into ``lse [R, kv_heads, Q]`` (fp32) at those rows.
        ``causal_base >= 0``: causal prefill, the i-th row of a group sees only the first
        ``causal_base + i + 1`` keys of its blocks. ``query``'s rows may lie apart (a view of the
        QKV projection: no copy); its heads and dims may not."""
        num_rows, kv_heads, queries, head_dim = query.shape
        block_size = k_cache.shape[-2]
        groups, shared = block_ids.shape
        _require(self.supports_prefix_attention(query.dtype, head_dim, block_size)
                 and query.dtype == k_cache.dtype == v_cache.dtype == out.dtype
                 and k_cache.shape[1:] == (kv_heads, block_size, head_dim) == v_cache.shape[1:]
                 and out.shape == query.shape and lse.shape == query.shape[:-1] and lse.dtype == torch.float32
                 and _rows_apart(query) and all(t.is_contiguous() for t in (k_cache, v_cache, out, lse))
                 and rows.dtype == block_ids.dtype == torch.int64 and groups > 0 and shared > 0
                 and rows.numel() % groups == 0 and rows.numel() > 0, "prefix_attention")
        rows, block_ids = rows.contiguous(), block_ids.contiguous()
        length = shared * block_size
        needed = groups * kv_heads * (length + -(-length // 32) * 32) * head_dim
        packed = self._scratch_buffer("prefix", needed, torch.bfloat16)  # prefix K/V in tile layout
        assert self._prefix is not None
        self._prefix(query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), rows.data_ptr(),
                     block_ids.data_ptr(), groups, rows.numel() // groups, shared, kv_heads, queries,
                     head_dim, block_size, causal_base, query.stride(0), head_dim ** -0.5, packed.data_ptr(),
                     out.data_ptr(), lse.data_ptr(), torch.get_num_threads())

    def supports_causal_attention(self, dtype: torch.dtype, head_dim: int) -> bool:
        return dtype == torch.float32 and head_dim in CAUSAL_HEAD_DIMS and head_dim % self.vector_lanes == 0

    def causal_attention(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_ids: torch.Tensor, causal_base: int, keys: int | None = None,
                         with_lse: bool = False, out: torch.Tensor | None = None
                         ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """fp32 attention of ``query [n, kv_heads, Q, dim]`` over the first ``keys`` tokens along
        ``block_ids`` of the cache ``[blocks, kv_heads, block_size, dim]``: token i sees the first
        ``min(causal_base + i + 1, keys)`` of them. A prefill chunk after ``causal_base`` tokens of
        context (its K/V already in the cache): ``keys`` None, i.e. ``causal_base + n``; a decode
        group's shared prefix: ``causal_base = keys``, every query sees every key. Returns the
        output, shaped like ``query``, and with ``with_lse`` the log-sum-exp of each query's scaled
        scores ``[n, kv_heads, Q]`` (to continue it, as decode_attention's ``initial``). ``query``'s
        rows may lie apart (a view of the QKV projection); ``out`` (contiguous, like ``query``)
        receives the output in place of a new tensor."""
        length, kv_heads, queries, head_dim = query.shape
        block_size = k_cache.shape[-2]
        keys = causal_base + length if keys is None else keys
        _require(self.supports_causal_attention(query.dtype, head_dim)
                 and query.dtype == k_cache.dtype == v_cache.dtype
                 and k_cache.shape[1:] == (kv_heads, block_size, head_dim) == v_cache.shape[1:]
                 and _rows_apart(query) and all(t.is_contiguous() for t in (k_cache, v_cache))
                 and (out is None or (out.shape == query.shape and out.dtype == query.dtype
                                      and out.is_contiguous()))
                 and block_ids.dtype == torch.int64 and causal_base >= 0 and length > 0 and keys > 0
                 and block_ids.numel() * block_size >= keys, "causal_attention")
        block_ids = block_ids.contiguous()
        step = 4 * self.vector_lanes  # the kernel's keys per score block
        needed = kv_heads * -(-keys // step) * step * head_dim
        packed = self._scratch_buffer("causal", needed, torch.float32)  # K transposed VL keys at a time
        out = torch.empty(query.shape, dtype=query.dtype) if out is None else out
        lse = torch.empty(query.shape[:-1], dtype=torch.float32) if with_lse else None
        self._causal_f32(query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_ids.data_ptr(),
                         length, kv_heads, queries, head_dim, block_size, causal_base, keys, query.stride(0),
                         head_dim ** -0.5, packed.data_ptr(), out.data_ptr(),
                         lse.data_ptr() if lse is not None else None,
                         torch.get_num_threads())
        return (out, lse) if lse is not None else out

    def supports_packed_attention(self, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether ``packed_attention`` runs here: fp32 as ``causal_attention``, bf16 where the
        prefix kernel is built (AMX or AVX512-BF16)."""
        if dtype == torch.bfloat16:
            return torch.bfloat16 in self._packed and head_dim in PREFIX_HEAD_DIMS
        return self.supports_causal_attention(dtype, head_dim)

    def packed_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         starts: torch.Tensor, causal: bool, out: torch.Tensor) -> None:
        """Attention of packed sequences over themselves (an embedding pass): sequence s is the
        tokens ``starts[s]:starts[s + 1]`` (int64, ``S + 1`` values from 0 to the token count), each
        token seeing every token of its own sequence, or (``causal``) those up to itself.
        ``query [T, kv_heads, Q, dim]`` and ``key``/``value`` ``[T, kv_heads, dim]`` may be views of
        the QKV projection (rows apart; heads and dims packed); writes ``out`` (contiguous, like
        ``query``)."""
        tokens, kv_heads, queries, head_dim = query.shape
        count = starts.numel() - 1
        _require(self.supports_packed_attention(query.dtype, head_dim)
                 and query.dtype == key.dtype == value.dtype == out.dtype and out.shape == query.shape
                 and out.is_contiguous() and _rows_apart(query)
                 and key.shape == value.shape == (tokens, kv_heads, head_dim)
                 and all(t.stride()[1:] == (head_dim, 1) and t.stride(0) >= kv_heads * head_dim
                         for t in (key, value))
                 and starts.dtype == torch.int64 and count > 0 and int(starts[0]) == 0
                 and int(starts[-1]) == tokens, "packed_attention")
        starts = starts.contiguous()
        lengths = starts.diff()
        _require(bool((lengths > 0).all()), "packed_attention")
        if query.dtype == torch.bfloat16:
            per_head = (-(-lengths // 16) * 16 + -(-lengths // 32) * 32) * head_dim
            per_item = 32
        else:
            step = 4 * self.vector_lanes  # the fp32 kernel's keys per score block
            per_head = -(-lengths // step) * step * head_dim
            per_item = 24 if self.vector_lanes == 16 else 16  # causal_attention.c's ITEM
        packed_at = torch.zeros(count + 1, dtype=torch.int64)
        torch.cumsum(per_head * kv_heads, 0, out=packed_at[1:])
        item_at = torch.zeros(count + 1, dtype=torch.int64)
        torch.cumsum(-(-(lengths * queries) // per_item) * kv_heads, 0, out=item_at[1:])
        rows = self._token_indices(tokens)
        packed = self._scratch_buffer(f"packed_{query.dtype}", int(packed_at[-1]), query.dtype)
        arguments = [query.data_ptr(), key.data_ptr(), value.data_ptr(), starts.data_ptr(),
                     packed_at.data_ptr(), item_at.data_ptr(), rows.data_ptr(), count, kv_heads, queries,
                     head_dim, query.stride(0),
                     key.stride(0), value.stride(0), int(causal), head_dim ** -0.5, packed.data_ptr(),
                     out.data_ptr()]
        if query.dtype == torch.bfloat16:
            lse = self._scratch_buffer("packed_lse", tokens * kv_heads * queries, torch.float32)
            arguments.append(lse.data_ptr())
        self._packed[query.dtype](*arguments, torch.get_num_threads())

    def _token_indices(self, tokens: int) -> torch.Tensor:
        """0 .. tokens - 1 (int64), kept between calls: the packed kernels' block ids."""
        indices = getattr(self._scratch, "token_indices", None)
        if indices is None or indices.numel() < tokens:
            indices = torch.arange(max(tokens, 16384), dtype=torch.int64)
            self._scratch.token_indices = indices
        return indices

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 rows: torch.Tensor) -> None:
        """Head h of token t of ``key``/``value`` ``[T, kv_heads, dim]`` (tokens may be strided, as
        views into a fused QKV output; heads and dims not) into row ``rows[t * kv_heads + h]`` of the
        caches viewed ``[-1, dim]``; any dtype, CPU."""
        tokens, heads, dim = key.shape
        packed = all(t.stride(2) == 1 and t.stride(1) == dim for t in (key, value))
        if not packed or key.stride(0) != value.stride(0):
            key, value = key.contiguous(), value.contiguous()
        _require(key.dtype == value.dtype == k_cache.dtype == v_cache.dtype and rows.dtype == torch.int64
                 and key.device.type == "cpu" and k_cache.is_contiguous() and v_cache.is_contiguous()
                 and k_cache.shape[-1] == dim and value.shape == key.shape and rows.numel() == tokens * heads
                 and k_cache.shape == v_cache.shape and rows.is_contiguous(), "store_kv")
        size = key.element_size()
        self._store_kv(key.data_ptr(), value.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                       rows.data_ptr(), tokens, heads, key.stride(0) * size, dim * size,
                       torch.get_num_threads())

    # ---- projections of single-token rows (engine/cpu_kernels/row_gemm.c) ----------------------------

    def supports_row_gemm(self, weight: torch.Tensor) -> bool:
        """Whether this Linear weight ``[out, in]`` can run through the row kernel here (bf16 needs
        ``in`` a multiple of 32: whole AMX tiles)."""
        return (weight.dtype in self.row_gemm_dtypes and weight.dim() == 2 and weight.device.type == "cpu"
                and (weight.dtype != torch.bfloat16 or weight.shape[1] % 32 == 0))

    def pack_row_gemm(self, weight: torch.Tensor) -> torch.Tensor:
        """The weight ``[out, in]`` in the order the row kernel reads it (a new tensor, as large)."""
        _require(self.supports_row_gemm(weight), "pack_row_gemm")
        weight = weight.contiguous()
        out_features, in_features = weight.shape
        panel = self._row_panel_f32 if weight.dtype == torch.float32 else 32
        packed = torch.empty(-(-out_features // panel) * panel * in_features, dtype=weight.dtype)
        self._row_pack[weight.dtype](weight.data_ptr(), out_features, in_features, packed.data_ptr(),
                                     torch.get_num_threads())
        return packed

    def row_gemm(self, x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None,
                 out: torch.Tensor | None = None, fp32_out: bool = False) -> torch.Tensor:
        """``x [rows, in] @ W.T (+ bias)`` with W packed by ``pack_row_gemm``, into ``out [rows, out]``
        (a new tensor when None; a row-contiguous view is fine). Each row's result is the same
        whatever the other rows are. ``fp32_out``: the fp32 sums as they are (not rounded to the
        inputs' dtype), for bf16 inputs as for fp32."""
        rows, in_features = x.shape
        x = x.contiguous()
        out_dtype = torch.float32 if fp32_out else x.dtype
        if out is None:
            out = torch.empty(rows, out_features, dtype=out_dtype)
        _require(x.dtype == packed.dtype and out.dtype == out_dtype and x.dtype in self.row_gemm_dtypes
                 and out.shape == (rows, out_features) and out.stride(1) == 1
                 and (bias is None or (bias.dtype == x.dtype and bias.shape == (out_features,)
                                       and bias.is_contiguous())), "row_gemm")
        if rows:
            bias_pointer = bias.data_ptr() if bias is not None else None
            kernel = self._row_gemm_to_f32 if out_dtype != x.dtype else self._row_gemm[x.dtype]
            kernel(x.data_ptr(), in_features, packed.data_ptr(), bias_pointer, out.data_ptr(), out.stride(0),
                   rows, out_features, in_features, torch.get_num_threads())
        return out

    def decode_layers(self, layers: ctypes.Array, step: ctypes.Structure) -> None:
        """Run decode_layers.c over ``layers`` (a ctypes array of its layer struct) for ``step`` (its
        step struct): the caller (engine/models/native_decode.py) has checked every shape and pointer."""
        self._decode_layers(ctypes.addressof(layers), ctypes.addressof(step))

    # ---- bf16 and fp32 layer ops (engine/cpu_kernels/layer_ops.c) ----------------------------------

    @staticmethod
    def layer_ops_apply(tensor: torch.Tensor) -> bool:
        return tensor.dtype in LAYER_OP_DTYPES and tensor.device.type == "cpu"

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``; with ``residual``: ``residual += x`` in place, then ``(norm(residual),
        residual)``. x, residual: [rows, hidden]; weight [hidden]; all bf16 or all fp32."""
        hidden = x.shape[-1]
        _require(x.dtype == weight.dtype and x.dtype in LAYER_OP_DTYPES and weight.shape == (hidden,)
                 and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype
                                           and residual.is_contiguous())), "add_rms_norm")
        x, weight = x.contiguous(), weight.contiguous()
        out = torch.empty_like(x)
        self._add_rms_norm[x.dtype](x.data_ptr(), residual.data_ptr() if residual is not None else None,
                                    weight.data_ptr(), out.data_ptr(), x.numel() // hidden, hidden, eps,
                                    torch.get_num_threads())
        return out if residual is None else (out, residual)

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of ``x [T, heads, dim]`` in place (rows may be strided, heads and dims
        not); cos/sin: [T, 1, dim / 2], x's dtype (bf16 or fp32)."""
        tokens, heads, dim = x.shape
        cos, sin = cos.reshape(tokens, dim // 2).contiguous(), sin.reshape(tokens, dim // 2).contiguous()
        _require(x.dtype == cos.dtype == sin.dtype and x.dtype in LAYER_OP_DTYPES and x.stride(2) == 1
                 and x.stride(1) == dim, "rope_")
        self._rope[x.dtype](x.data_ptr(), cos.data_ptr(), sin.data_ptr(), tokens, heads, x.stride(0), dim,
                            torch.get_num_threads())
        return x

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of ``gate_up [rows, 2 * width]`` (gate first), bf16 or fp32."""
        rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        _require(gate_up.dtype in LAYER_OP_DTYPES and gate_up.dim() == 2, "silu_and_mul")
        gate_up = gate_up.contiguous()
        out = torch.empty(rows, width, dtype=gate_up.dtype)
        self._silu_and_mul[gate_up.dtype](gate_up.data_ptr(), out.data_ptr(), rows, width,
                                          torch.get_num_threads())
        return out

    # ---- LoRA (engine/cpu_kernels/lora_ops.c) --------------------------------------------------------

    def lora_update_(self, x: torch.Tensor, out: torch.Tensor, slots: torch.Tensor, packed_a: torch.Tensor,
                     packed_b: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
        """``out[r] += (x[r] @ A_s.T) @ B_s.T`` in place for every row r whose slot ``s = slots[r]`` is
        not -1, through the row kernel: x [rows, in], out [rows, out_features] (rows contiguous in
        each); ``packed_a`` / ``packed_b`` the addresses of each slot's A [k, in] and B [out, k]
        packed by ``pack_row_gemm``, ``widths`` their k (0: none), all int64 [slots], as
        engine/lora/slots.py keeps them alive. Each row's result is the same whatever the other
        rows are."""
        rows, in_features = x.shape
        count = packed_a.shape[0]
        _require(x.dtype == out.dtype and x.dtype in self.row_gemm_dtypes and x.device.type == "cpu"
                 and x.stride(1) == 1 and out.stride(1) == 1 and out.shape[0] == rows and out.dim() == 2
                 and slots.shape == (rows,) and packed_b.shape == widths.shape == (count,)
                 and slots.dtype == packed_a.dtype == packed_b.dtype == widths.dtype == torch.int64
                 and slots.is_contiguous(), "lora_update_")
        # slots in [-1, count), and the packed weights' shapes, hold by construction (engine/lora/);
        # checking values here would cost more than the update at a few rows.
        if rows:
            self._lora_update[x.dtype](x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0),
                                       slots.data_ptr(), rows, packed_a.data_ptr(), packed_b.data_ptr(),
                                       widths.data_ptr(), in_features, out.shape[1], torch.get_num_threads())
        return out

    # ---- the sparse MoE block's element ops (engine/cpu_kernels/moe_ops.c) ----------------------------

    def moe_route(self, logits: torch.Tensor, top_k: int,
                  normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(experts [rows, k] int64, weights [rows, k] fp32) of router ``logits [rows, experts]`` (bf16
        or fp32): softmax in fp32, the top k in descending order (the lower expert first among equal
        probabilities), renormalised to sum to 1 where ``normalize``."""
        rows, experts = logits.shape
        _require(logits.dtype in LAYER_OP_DTYPES and logits.device.type == "cpu" and 0 < top_k <= experts,
                 "moe_route")
        logits = logits.contiguous()
        chosen = torch.empty(rows, top_k, dtype=torch.int64)
        weights = torch.empty(rows, top_k, dtype=torch.float32)
        self._moe_route[logits.dtype](logits.data_ptr(), rows, experts, top_k, int(normalize), 0,
                                      chosen.data_ptr(), weights.data_ptr(), torch.get_num_threads())
        return chosen, weights

    def moe_combine(self, pair_out: torch.Tensor, position: torch.Tensor,
                    weights: torch.Tensor) -> torch.Tensor:
        """``out[t] = sum_s round(pair_out[position[t, s]] * weights[t, s])`` (slot order, an fp32 sum
        rounded once to pair_out's dtype): ``position``/``weights`` [rows, k], int64 / fp32."""
        rows, top_k = position.shape
        hidden = pair_out.shape[-1]
        _require(pair_out.dtype in LAYER_OP_DTYPES and pair_out.dim() == 2 and position.dtype == torch.int64
                 and weights.dtype == torch.float32 and weights.shape == position.shape
                 and bool(((position >= 0) & (position < pair_out.shape[0])).all()), "moe_combine")
        pair_out, position, weights = pair_out.contiguous(), position.contiguous(), weights.contiguous()
        out = torch.empty(rows, hidden, dtype=pair_out.dtype)
        self._moe_combine[pair_out.dtype](pair_out.data_ptr(), position.data_ptr(), weights.data_ptr(),
                                          out.data_ptr(), rows, top_k, hidden, torch.get_num_threads())
        return out

    def moe_shared_add_(self, out: torch.Tensor, gate: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
        """``out += sigmoid(gate) * shared`` in place (out, shared [rows, hidden]; gate [rows, 1]; one
        dtype), rounding after each op as that tensor expression does."""
        _require(out.dtype == gate.dtype == shared.dtype and out.dtype in LAYER_OP_DTYPES
                 and out.is_contiguous() and out.dim() == 2 and shared.shape == out.shape
                 and gate.shape == (out.shape[0], 1), "moe_shared_add_")
        gate, shared = gate.contiguous(), shared.contiguous()
        self._moe_shared_add[out.dtype](out.data_ptr(), gate.data_ptr(), shared.data_ptr(), out.shape[0],
                                        out.shape[1], torch.get_num_threads())
        return out


def row_gemm_dtypes(vector_lanes: int, bf16_products: bool) -> tuple[torch.dtype, ...]:
    """The dtypes whose single-token rows go through the row kernel on this CPU; both stream the
    weights faster than oneDNN's packed GEMM and let a decode step take the native path:
    - fp32 with AVX-512: Intel Xeon 1.2-1.3x at 1-64 rows; AMD EPYC 1.5x at 1-8 rows, 1.2x at 32,
      equal from 64 (fp32 SmolLM2 step on the EPYC: 1 row 49.9 -> 22.0 ms, 128 rows 287 -> 269 ms);
    - bf16 where the CPU multiplies bf16 (``bf16_products``): on AMX 1.3-2x; on AVX512-BF16 without
      AMX (vdpbf16ps) 1.7x at 1 row, 1.35x at 32, 1.1x at 128-256 (bf16 SmolLM2 step on the EPYC:
      1 row 38.2 -> 14.6 ms, 32 rows 63.8 -> 49.1, 128 rows 141.4 -> 117.0).
    Elsewhere (AVX2) the engine keeps oneDNN for every row."""
    dtypes = []
    if vector_lanes == 16:
        dtypes.append(torch.float32)
    if bf16_products:
        dtypes.append(torch.bfloat16)
    return tuple(dtypes)


def _rows_apart(query: torch.Tensor) -> bool:
    """[rows, kv_heads, Q, dim] with everything but the rows packed; rows at least a row apart."""
    _, kv_heads, queries, head_dim = query.shape
    return (query.stride()[1:] == (queries * head_dim, head_dim, 1)
            and (query.shape[0] == 1 or query.stride(0) >= kv_heads * queries * head_dim))


def _declare(function: Any, arguments: Sequence[type[Any]]) -> Any:
    """`function` (a ctypes function of the library) with its argument types set."""
    function.argtypes = [*arguments, ctypes.c_int]  # every kernel takes its thread count last
    function.restype = None
    return function


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise ValueError(f"{what}: unsupported or inconsistent inputs")


def _cpu_signature() -> str:
    """What -march=native compiles for: the CPU model and its feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return os.uname().machine
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))][:2]
    return "\n".join(keep)


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(compiler: str, target: Path, flags: list[str] = FLAGS) -> None:
    """Compile the kernels into the shared library `target` (tests also build other ISAs): each
    source into its object, as many at once as this process may use CPUs (a source's compile is a
    process of its own either way, so the library is the same bytes as one `cc` command's), then
    one link."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        staging = Path(scratch) / target.name
        objects = [Path(scratch) / f"{source.stem}.o" for source in SOURCES]
        with concurrent.futures.ThreadPoolExecutor(max_workers=_build_jobs()) as pool:
            list(pool.map(_compile, [[compiler, *flags, "-c", "-o", str(obj), str(source)]
                                     for source, obj in zip(SOURCES, objects, strict=True)]))
        _compile([compiler, *flags, "-o", str(staging), *map(str, objects), "-lm"])
        os.replace(staging, target)  # atomic: two processes building at once both end well


def _build_jobs() -> int:
    """How many compiles run at once: the CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _compile(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {result.stderr.strip()[-2000:]}")


def open_library(path: Path) -> CpuKernels:
    library = ctypes.CDLL(str(path))
    if library.kernel_abi_version() != ABI_VERSION:
        raise RuntimeError(f"{path} has ABI {library.kernel_abi_version()}, expected {ABI_VERSION}")
    return CpuKernels(library, path)


@functools.cache
def load() -> CpuKernels | None:
    """The kernels, built the first time on this machine; None (and one log line) where they
    cannot be had. Once per process."""
    if os.environ.get(DISABLE_ENV, "1").strip() == "0":
        logger.info("native CPU kernels disabled (%s=0): PyTorch paths", DISABLE_ENV)
        return None
    return build_and_open(_compiler(), cache_dir(), native_flags())


def cache_dir() -> Path:
    """Where the built libraries are kept, each under its key: `$BULKINFER_KERNEL_CACHE`, else
    ~/.cache/bulkinfer/kernels."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "bulkinfer" / "kernels")


def native_flags() -> list[str]:
    """FLAGS, less the instructions above the project's ISA cap (`BULKINFER_CPU_ISA`,
    bulkinfer/cpu_isa.py), so the sources' `#if` paths build the capped kind's code; the flags are
    part of the cache key, so each cap has its own library."""
    note = describe_cap()
    if note:
        logger.info("native CPU kernels: %s", note)
    return [*FLAGS, *compiler_flags(active_cap())]


def build_and_open(compiler: str | None, cache: Path, flags: list[str] = FLAGS) -> CpuKernels | None:
    """The library for these sources, flags, compiler and CPU from `cache`, built there if absent."""
    if compiler is None:
        logger.warning("no C compiler (cc, gcc or $CC): native CPU kernels not built, PyTorch paths")
        return None
    texts = [source.read_text() for source in SOURCES + HEADERS]
    key = hashlib.sha256("\n".join([*texts, " ".join(flags), compiler, _cpu_signature(),
                                    str(ABI_VERSION)]).encode()).hexdigest()[:16]
    target = cache / key / "libbulkinfer_cpu.so"
    try:
        if not target.is_file():
            logger.info("building native CPU kernels with %s into %s (once per machine)", compiler, target)
            build(compiler, target, flags)
        return open_library(target)
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        logger.warning("native CPU kernels unavailable (%s): PyTorch paths", error)
        return None
