"""Engine configuration: one dataclass, validated once before the engine is built."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from bulkinfer.engine.speculative.config import SpeculativeConfig

SCHEDULING_POLICIES = ("fcfs", "priority")
# "auto": chosen from the device and checkpoint when the engine starts (engine/dtype_choice.py).
DTYPES = ("auto", "float32", "float16", "bfloat16")


@dataclass
class EngineConfig:
    """Everything needed to build an engine.

    `max_model_len=None` means "the model's `max_position_embeddings`": the model runner resolves it
    (e.g. `dataclasses.replace(config, max_model_len=...)`) before the scheduler is built.
    `kv_cache_memory`: int = bytes, float in (0, 1] = fraction of free device memory, None = default.
    `num_kv_blocks` overrides the memory budget with an explicit block count (tests, benchmarks).
    `kv_populate_seconds`: at most this long at start mapping the CPU KV cache's memory (first
    writes fault; paid here they stay out of the first job's steps); 0 = map it on first use.
    `kv_growth_reserve_tokens`: a waiting request is admitted only while the free KV blocks leave
    every running request room for its next this-many tokens (fewer where its max_tokens ends it
    sooner), so it does not push a neighbour out later (preempted, recomputed); 0 = admit while
    blocks are free, as vLLM does.
    """

    model: str
    block_size: int = 16
    # 4,096 (vLLM's CPU default too): on the 2-core AMX Xeon, SmolLM2 in one process, fewer and larger
    # prefill steps ran unique 256 x 450 tokens 5-8% and mixed lengths 4% faster than 2,048
    # (docs/benchmarks.md).
    max_num_batched_tokens: int = 4096
    max_num_seqs: int = 256
    max_model_len: int | None = None
    kv_cache_memory: int | float | None = None
    num_kv_blocks: int | None = None
    kv_populate_seconds: float = 3.0
    kv_growth_reserve_tokens: int = 128
    dtype: str = "auto"
    # `auto` on a CPU whose flags do not settle it reads the verdict kept in this file (None:
    # engine/dtype_verdict.py's default; a worker's: beside its model cache), measured once per CPU,
    # or again with `remeasure_dtype`.
    dtype_verdicts: str | None = None
    remeasure_dtype: bool = False
    device: str = "cpu"
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    seed: int = 0
    # Pure decode steps through fixed-shape buffers, replayed as CUDA graphs (engine/decode_graphs.py),
    # and steps with prefill chunks too where attention runs on the Triton kernels (mixed_graphs.py).
    # None: on a GPU (where a step is otherwise bound by kernel launches), off on CPU (whose native
    # decode path is faster); True on CPU runs the same fixed-shape path without capture.
    decode_graphs: bool | None = None
    # Attention and the layers' elementwise ops through Triton kernels (engine/gpu_kernels/): one
    # launch a layer reads the paged KV cache in place. None: on a CUDA device where triton is
    # installed; True: wherever asked (a CPU only under TRITON_INTERPRET=1, as CI runs them); False: off.
    triton_kernels: bool | None = None
    # Async scheduling (engine/device_step.py): the host schedules and prepares step N+1 and takes
    # step N-1's outputs while step N runs on the device. None: on a GPU, off on CPU (where the
    # "device" is the same cores). Not with speculative decoding or tensor parallel (their steps
    # need the last tokens on the host before they are built). With LoRA, the step in flight's
    # adapter slots are not reloaded for the next one (engine/lora/manager.py).
    async_scheduling: bool | None = None
    # Speculative decoding, with vLLM's keys: {"method": "ngram" | "draft_model", ...}
    # (engine/speculative/config.py); None = off.
    speculative_config: SpeculativeConfig | dict[str, Any] | None = None
    # Tensor parallel (vLLM's name): the model split over this many ranks, one process each (rank 0
    # is the engine's own; engine/parallel/). On CUDA rank r uses device index r (after `device`'s).
    tensor_parallel_size: int = 1
    # Batch invariance: a row's tokens and logprobs do not depend on which rows share its steps,
    # whether its prefix came from the cache, how its prefill was chunked or whether it was preempted
    # and recomputed. It turns off shared-prefix (cascade) attention and recomputes a preempted row's
    # output positions as the decode rows they were. None: on for CPU (where every kernel then reduces
    # in an order fixed by the row alone), off elsewhere: on a GPU it costs fixed-shape ops
    # (engine/invariant/: projections in 64-row blocks, tiled attention) instead of cuBLAS's and SDPA's.
    batch_invariant: bool | None = None
    # LoRA adapters chosen per request (vLLM's names and defaults; engine/lora/): at most `max_loras`
    # adapters in one step, ranks up to `max_lora_rank`, and `max_cpu_loras` kept in host memory
    # (None: max_loras), least recently used evicted.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Prefix KV in object storage (engine/kv_connector/): None = off. Blocks of prefixes that at
    # least `kv_store_min_hits` requests share are saved; the namespace (model, dtype, rank) is kept
    # under `kv_store_budget_bytes` (None: no cap), least recently used deleted; matched prefixes
    # shorter than `kv_store_min_tokens` are computed (None: the measured break-even,
    # engine/kv_connector/policy.py); a load not done in `kv_store_load_timeout_s` is computed instead.
    kv_store: Any = None  # a KVBlobStore
    kv_store_min_hits: int = 2
    kv_store_budget_bytes: int | None = None
    kv_store_min_tokens: int | None = None
    kv_store_load_timeout_s: float = 10.0

    @property
    def batch_invariant_on(self) -> bool:
        """The batch_invariant setting, or by default: on for CPU only."""
        return self.device.split(":")[0] == "cpu" if self.batch_invariant is None else self.batch_invariant

    def validate(self) -> None:
        """Raise ValueError naming the first bad field and its value."""
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty string, got {self.model!r}")
        _require_int(self.block_size, "block_size", minimum=1)
        _require_int(self.max_num_batched_tokens, "max_num_batched_tokens", minimum=1)
        _require_int(self.max_num_seqs, "max_num_seqs", minimum=1)
        if self.max_model_len is not None:
            _require_int(self.max_model_len, "max_model_len", minimum=2)
        if self.num_kv_blocks is not None:
            # Block 0 is the reserved null block, so one usable block needs two.
            _require_int(self.num_kv_blocks, "num_kv_blocks", minimum=2)
        self._validate_kv_cache_memory()
        seconds = self.kv_populate_seconds
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < math.inf:
            raise ValueError(f"kv_populate_seconds must be a finite number of seconds >= 0, got {seconds!r}")
        _require_int(self.kv_growth_reserve_tokens, "kv_growth_reserve_tokens", minimum=0)
        if self.decode_graphs is not None and not isinstance(self.decode_graphs, bool):
            raise ValueError(f"decode_graphs must be true, false or null, got {self.decode_graphs!r}")
        if self.batch_invariant is not None and not isinstance(self.batch_invariant, bool):
            raise ValueError(f"batch_invariant must be true, false or null, got {self.batch_invariant!r}")
        if self.triton_kernels is not None and not isinstance(self.triton_kernels, bool):
            raise ValueError(f"triton_kernels must be true, false or null, got {self.triton_kernels!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(f"device must be a non-empty string, got {self.device!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}"
            )
        _require_int(self.seed, "seed", minimum=0)
        _require_int(self.tensor_parallel_size, "tensor_parallel_size", minimum=1)
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be true, false or null, got {self.async_scheduling!r}")
        SpeculativeConfig.from_value(self.speculative_config)
        self._validate_lora()
        self._validate_kv_store()

    def _validate_kv_store(self) -> None:
        from bulkinfer.engine.kv_connector.blob_store import KVBlobStore

        _require_int(self.kv_store_min_hits, "kv_store_min_hits", minimum=1)
        if self.kv_store_budget_bytes is not None:
            _require_int(self.kv_store_budget_bytes, "kv_store_budget_bytes", minimum=1)
        if self.kv_store_min_tokens is not None:
            _require_int(self.kv_store_min_tokens, "kv_store_min_tokens", minimum=0)
        timeout = self.kv_store_load_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
            raise ValueError(f"kv_store_load_timeout_s must be a finite number of seconds > 0, "
                             f"got {timeout!r}")
        if self.kv_store is None:
            return
        if not isinstance(self.kv_store, KVBlobStore):
            raise ValueError(f"kv_store must be a KVBlobStore (get, put_if_absent, delete, list), "
                             f"got {type(self.kv_store).__name__}")
        if not self.enable_prefix_caching:
            raise ValueError("kv_store needs enable_prefix_caching (its keys are the prefix cache's hashes)")
        if self.tensor_parallel_size > 1:
            raise ValueError("kv_store cannot be used with tensor_parallel_size > 1 (not implemented)")
        speculative = SpeculativeConfig.from_value(self.speculative_config)
        if speculative is not None and speculative.method == "draft_model":
            # The draft's KV shares the blocks but is not stored: loaded blocks would lack it.
            raise ValueError("kv_store cannot be used with a draft_model speculative config "
                             "(not implemented)")

    def _validate_lora(self) -> None:
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be a bool, got {self.enable_lora!r}")
        _require_int(self.max_loras, "max_loras", minimum=1)
        _require_int(self.max_lora_rank, "max_lora_rank", minimum=1)
        if self.max_cpu_loras is not None:
            _require_int(self.max_cpu_loras, "max_cpu_loras", minimum=1)
            if self.max_cpu_loras < self.max_loras:
                raise ValueError(
                    f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ValueError("enable_lora cannot be used with tensor_parallel_size > 1 (not implemented)")

    def _validate_kv_cache_memory(self) -> None:
        value = self.kv_cache_memory
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"kv_cache_memory must be int bytes, a float fraction or None, got {value!r}")
        if isinstance(value, int) and value <= 0:
            raise ValueError(f"kv_cache_memory in bytes must be > 0, got {value}")
        if isinstance(value, float) and not 0.0 < value <= 1.0:
            raise ValueError(f"kv_cache_memory as a fraction must be in (0, 1], got {value}")


def _require_int(value: object, name: str, minimum: int) -> None:
    # bool is an int subclass; `block_size=True` is a mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
