"""Engine settings tuned for one model on one machine, and where a worker finds them.

`bulkinfer tune` (worker/tuning/tune_cli.py) measures candidate settings and writes the fastest as a tuned
file; a worker loading that model on a matching machine reads it (`tuned_engine_options`) and puts
its options under the deployment's explicit `engine_options` (those always win, key by key).

A tuned file is JSON in ``<model cache>/tuned/``, named after the model's folder and a hash of its
path and config (so two models never share one), holding the options, the machine they were
measured on and the trials behind them. It applies only where the machine signature matches: CPU
model and thread count (or GPU name) and the requested dtype, since a different machine's best
batch sizes say little about this one's.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

TUNED_FOLDER = "tuned"
# What `tune` searches, one setting at a time from the engine's defaults (engine/config.py).
MAX_NUM_SEQS = (64, 128, 256, 512)
MAX_NUM_BATCHED_TOKENS = (512, 1024, 2048, 4096, 8192)
DEFAULTS = {"max_num_seqs": 256, "max_num_batched_tokens": 4096}  # engine/config.py's (a test holds it)
KV_GROWTH = 2  # a KV budget this many times the default's, tried when the best trial preempted
# A candidate must beat the defaults by more than one run's noise on a shared machine to replace them.
MIN_GAIN = 0.03


@dataclass
class Trial:
    options: dict[str, Any]
    wall_s: float
    output_tokens: int
    preemptions: int = 0
    kv_blocks: int = 0
    kv_bytes: int = 0
    error: str | None = None

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s and self.error is None else 0.0


@dataclass
class TuneResult:
    best: Trial
    trials: list[Trial] = field(default_factory=list)

    @property
    def default(self) -> Trial | None:
        return next((t for t in self.trials if t.options == DEFAULTS), None)


Measure = Callable[[dict[str, Any]], Trial]


def search(measure: Measure) -> TuneResult:
    """Coordinate search from the defaults: max_num_seqs, then max_num_batched_tokens at the best
    max_num_seqs, then a larger KV budget if the best so far had to preempt. Each candidate is
    measured once (the same options are never run twice); the fastest by output tok/s wins, unless
    it beats the defaults by less than MIN_GAIN (then the defaults stay)."""
    trials: dict[str, Trial] = {}

    def run(options: dict[str, Any]) -> Trial:
        key = json.dumps(options, sort_keys=True)
        if key not in trials:
            trial = measure(dict(options))
            trials[key] = trial
            logger.info("tune %s: %s", key, trial.error or f"{trial.output_tps:.1f} output tok/s")
        return trials[key]

    def best_of(candidates: Sequence[dict[str, Any]]) -> Trial:
        return max((run(options) for options in candidates), key=lambda t: t.output_tps)

    best = best_of([{**DEFAULTS, "max_num_seqs": n} for n in MAX_NUM_SEQS])
    best = best_of([{**best.options, "max_num_batched_tokens": n} for n in MAX_NUM_BATCHED_TOKENS])
    if best.preemptions and best.kv_bytes:
        bigger = run({**best.options, "kv_cache_memory": best.kv_bytes * KV_GROWTH})
        best = max((best, bigger), key=lambda t: t.output_tps)
    if best.error is not None:
        raise RuntimeError(f"every tuning trial failed; the first: {next(iter(trials.values())).error}")
    result = TuneResult(best, list(trials.values()))
    default = result.default
    if default is not None and default.error is None \
            and best.output_tps < default.output_tps * (1 + MIN_GAIN):
        result.best = default  # within the noise of the defaults: keep them
    return result


def machine_signature(device: str, dtype: str) -> dict[str, Any]:
    """What a tuned file's figures depend on besides the model."""
    import torch

    if device.startswith("cuda"):
        return {"device": device, "name": torch.cuda.get_device_name(torch.device(device)), "dtype": dtype}
    from bulkinfer.engine.dtype_choice import cpu_model_name

    return {"device": "cpu", "name": cpu_model_name(), "threads": torch.get_num_threads(), "dtype": dtype}


def tuned_path(cache_dir: Path, model_dir: Path) -> Path:
    resolved = model_dir.resolve()
    config = (resolved / "config.json").read_bytes() if (resolved / "config.json").is_file() else b""
    digest = hashlib.sha256(str(resolved).encode() + b"\0" + config).hexdigest()[:12]
    return cache_dir / TUNED_FOLDER / f"{resolved.name}-{digest}.json"


def write_tuned(path: Path, model_dir: Path, signature: dict[str, Any], result: TuneResult,
                workload: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {"model": str(model_dir.resolve()), "machine": signature, "workload": workload,
                "engine_options": result.best.options, "best": asdict(result.best),
                "trials": [asdict(trial) for trial in result.trials]}
    scratch = path.with_suffix(".json.tmp")
    scratch.write_text(json.dumps(document, indent=1))
    scratch.replace(path)  # a worker reading it never sees half a file


def tuned_engine_options(cache_dir: Path, model_dir: Path, signature: dict[str, Any]) -> dict[str, Any]:
    """The tuned options for this model on this machine, or {} (none, another machine's, unreadable)."""
    path = tuned_path(cache_dir, model_dir)
    if not path.is_file():
        return {}
    try:
        document = json.loads(path.read_text())
        options, machine = document["engine_options"], document["machine"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        logger.warning("ignoring tuned settings %s: unreadable (%s)", path, error)
        return {}
    if machine != signature:
        logger.info("ignoring tuned settings %s: measured on %s, this worker is %s", path, machine, signature)
        return {}
    logger.info("using tuned engine settings %s from %s", options, path)
    return dict(options)
