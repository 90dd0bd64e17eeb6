"""The kept verdict of a CPU whose flags do not settle `dtype="auto"` (AVX512-BF16 without usable
AMX: bf16 runs about as fast as fp32 there, faster or slower by machine): bf16 against fp32 measured
once on the reference workload (engine/dtype_benchmark.py), kept in a small JSON file beside the
model cache and read by every later start, so every process on the machine chooses alike.

The file holds one verdict per CPU (model name, the flags that matter, torch's version): a model
cache shared by different machines keeps each one's. `remeasure_dtype` measures again and replaces
it. Two processes starting together measure once: the second waits on the file's lock, then reads.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import tempfile
from collections.abc import Callable, Collection, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

VERDICTS_ENV = "BULKINFER_DTYPE_VERDICTS"  # the file, over the engine's option (tests: a temp file)
VERDICTS_FILE_NAME = "cpu-dtype-verdicts.json"
# The model cache's default (the `model_cache` setting's), where the engine alone keeps them.
DEFAULT_VERDICTS_FILE = Path.home() / ".cache" / "bulkinfer" / "models" / VERDICTS_FILE_NAME
FORMAT = 1
# The flags that decide how bf16 and fp32 matmuls run (the key's part of /proc/cpuinfo).
KEY_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
             "amx_tile", "amx_bf16")


@dataclass(frozen=True)
class Bf16Verdict:
    """bf16 against fp32 on the reference workload: fp32's time over bf16's (above 1: bf16 faster)."""

    dtype: str  # "bfloat16" or "float32": what `auto` runs on this CPU
    speedup: float  # the whole workload
    decode_speedup: float
    prefill_speedup: float
    measured_at: str  # ISO 8601, UTC
    rounds: int
    busy: float  # the machine's busy share (all cores) just before measuring: 0 quiet, 1 saturated
    workload: str

    def describe(self) -> str:
        return (f"bf16 {self.speedup:.2f}x fp32 on the reference workload (decode "
                f"{self.decode_speedup:.2f}x, prefill {self.prefill_speedup:.2f}x; median of {self.rounds} "
                f"rounds, measured {self.measured_at} with the machine {self.busy:.0%} busy)")


def verdicts_file(configured: str | os.PathLike[str] | None = None) -> Path:
    """Where verdicts are kept: `$BULKINFER_DTYPE_VERDICTS`, else `configured` (a worker's:
    `<model_cache>/cpu-dtype-verdicts.json`), else the default model cache's file."""
    chosen = os.environ.get(VERDICTS_ENV) or configured
    return Path(chosen).expanduser() if chosen else DEFAULT_VERDICTS_FILE


def verdict_key(cpu_model: str, flags: Collection[str], torch_version: str) -> str:
    """One CPU kind with one torch (oneDNN comes with it): its model name and the flags that matter."""
    kept = " ".join(flag for flag in KEY_FLAGS if flag in flags)
    return f"{cpu_model} | {kept} | torch {torch_version}"


def read_verdict(path: Path, key: str) -> Bf16Verdict | None:
    """The verdict kept for `key`; None when there is none, or the file cannot be read (it is then
    measured again and rewritten, never an error)."""
    entry = _read_all(path).get(key)
    if not isinstance(entry, dict):
        return None
    try:
        return Bf16Verdict(**entry)
    except TypeError:
        return None


def write_verdict(path: Path, key: str, verdict: Bf16Verdict) -> None:
    """Keep `verdict` for `key` beside the others, replacing the file in one rename."""
    verdicts = {**_read_all(path), key: asdict(verdict)}
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as file:
        json.dump({"format": FORMAT, "verdicts": verdicts}, file, indent=2, sort_keys=True)
    os.replace(file.name, path)


# (file, key) whose verdict this process measured: measured again only once per process.
_measured_here: set[tuple[Path, str]] = set()


def kept_verdict(path: Path, key: str, measure: Callable[[], Bf16Verdict],
                 remeasure: bool = False) -> tuple[Bf16Verdict, bool]:
    """(the verdict for `key`, whether it was measured now): the one kept in `path`, else (or with
    `remeasure`, once per process) `measure()`'s, then kept there."""
    if (path, key) in _measured_here:
        remeasure = False
    if not remeasure and (verdict := read_verdict(path, key)) is not None:
        return verdict, False
    with _locked(path):
        if not remeasure and (verdict := read_verdict(path, key)) is not None:
            return verdict, False  # another process measured it while this one waited
        verdict = measure()
        try:
            write_verdict(path, key, verdict)
        except OSError as error:
            logger.warning("cannot keep the dtype verdict in %s (%s): measured again next start", path, error)
        else:
            logger.info("dtype verdict for %s: %s; kept in %s", key, verdict.describe(), path)
        _measured_here.add((path, key))
        return verdict, True


def _read_all(path: Path) -> dict[str, object]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    verdicts = data.get("verdicts") if isinstance(data, dict) and data.get("format") == FORMAT else None
    return verdicts if isinstance(verdicts, dict) else {}


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Held while one process measures; a folder that cannot be made only skips the lock."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.parent / f".{path.name}.lock", "w")  # noqa: SIM115 - closed below
    except OSError:
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
