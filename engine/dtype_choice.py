"""`dtype="auto"`: the compute dtype that serves a checkpoint best on this device, the same on
every start of the same machine.

- CUDA: the checkpoint's own dtype (``torch_dtype``/``dtype`` in config.json); fp32 checkpoints
  stay fp32, and bf16 falls back to fp16 on a GPU without bf16.
- CPU, by its flags (under the project's ISA cap, bulkinfer/cpu_isa.py) where they settle it:
  neither AMX nor AVX-512's bf16 dot product → fp32 (bf16 matmul is emulated, ~70x slower); AMX
  whose tile state Linux grants → bf16 (4-7x faster). Where they do not (AVX512-BF16 without usable
  AMX: about as fast as fp32, either side by machine), by the verdict measured once on a reference
  workload and kept beside the model cache (engine/dtype_verdict.py, engine/dtype_benchmark.py).
  Never by a timing taken at start-up: that meets whatever load the machine has at that moment, and
  two starts of one machine chose differently.

The choice and the rule that made it are logged by the engine (`DtypeChoice.reason`); each job's
manifest lists the dtype.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

import torch

from bulkinfer.cpu_isa import describe_cap
from bulkinfer.engine.cpu_features import (
    DOT_BF16_FLAG,
    amx_tile_state_granted,
    cpu_flags,
    cpu_model_name,
    has_amx,
    native_bf16_products,
)
from bulkinfer.engine.dtype_verdict import Bf16Verdict, kept_verdict, verdict_key, verdicts_file

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_CHOICES = ("auto", *DTYPES)

__all__ = ["DTYPES", "DTYPE_CHOICES", "DtypeChoice", "checkpoint_dtype", "cpu_auto_dtype", "cpu_flags",
           "cpu_model_name", "native_bf16_products", "resolve_dtype"]


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str  # one of DTYPES
    reason: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


VerdictSource = Callable[[], tuple[Bf16Verdict, bool]]  # (verdict, measured now)


def cpu_auto_dtype(flags: Collection[str], verdict: VerdictSource,
                   amx_granted: Callable[[], bool] = amx_tile_state_granted,
                   cap_note: str | None = None) -> DtypeChoice:
    """`auto` on a CPU with these flags: the flags where they settle it, else `verdict()`."""
    capped = f" ({cap_note})" if cap_note else ""
    if has_amx(flags):
        if amx_granted():
            return DtypeChoice("bfloat16", f"auto: CPU flags{capped}: AMX (amx_bf16), its tile state granted "
                                           "by Linux: bf16 runs 4-7x faster than fp32")
        without_amx = "AMX flags but Linux does not grant AMX's tile state"
    else:
        without_amx = "no AMX"
    if DOT_BF16_FLAG not in flags:
        return DtypeChoice("float32", f"auto: CPU flags{capped}: {without_amx} and no AVX512-BF16: bf16 "
                                      "would be emulated, far slower than fp32")
    found, measured_now = verdict()
    how = "measured now on this CPU and kept" if measured_now else "the verdict kept for this CPU"
    return DtypeChoice(found.dtype, f"auto: CPU flags{capped}: avx512_bf16, {without_amx}, so by {how}: "
                                    f"{found.describe()}")


@functools.cache
def _torch_version() -> str:
    return torch.__version__.split("+")[0]


def cpu_dtype_verdict(verdicts: str | None = None, remeasure: bool = False) -> VerdictSource:
    """This CPU's kept verdict (measured once, or again with `remeasure`) in `verdicts_file(verdicts)`."""

    def source() -> tuple[Bf16Verdict, bool]:
        from bulkinfer.engine.dtype_benchmark import measure_bf16_verdict

        key = verdict_key(cpu_model_name(), cpu_flags(), _torch_version())
        return kept_verdict(verdicts_file(verdicts), key, measure_bf16_verdict, remeasure)

    return source


def checkpoint_dtype(model_dir: str | Path) -> str | None:
    """The dtype a checkpoint's config.json declares (``dtype`` in transformers 5, ``torch_dtype``
    before), as one of DTYPES; None when absent or not one of ours."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get("dtype") or config.get("torch_dtype")
    return value if value in DTYPES else None


def resolve_dtype(
    requested: str,
    device: str,
    checkpoint: str | None,
    cpu: Callable[[], DtypeChoice] | None = None,
    cuda_bf16: Callable[[], bool] | None = None,
    *,
    verdicts: str | None = None,
    remeasure: bool = False,
) -> DtypeChoice:
    """The dtype to run in and why. ``requested`` is ``auto`` or one of DTYPES. ``cpu``: `auto`'s
    choice on a CPU (default: this CPU's, its verdict kept in `verdicts`, measured again with
    `remeasure`: engine/dtype_verdict.py)."""
    if requested not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {requested!r}")
    if requested != "auto":
        return DtypeChoice(requested, f"{requested} requested")
    if torch.device(device).type == "cuda":
        declared = checkpoint or "float32"
        if declared == "bfloat16" and not (cuda_bf16 or torch.cuda.is_bf16_supported)():
            return DtypeChoice("float16", "auto: checkpoint is bfloat16 but this GPU has no bf16; float16")
        return DtypeChoice(declared, f"auto: the checkpoint's dtype on CUDA ({checkpoint or 'not declared'})")
    if torch.device(device).type != "cpu":
        return DtypeChoice("float32", f"auto: float32 on {device}")
    if cpu is None:
        return cpu_auto_dtype(cpu_flags(), cpu_dtype_verdict(verdicts, remeasure), cap_note=describe_cap())
    return cpu()
