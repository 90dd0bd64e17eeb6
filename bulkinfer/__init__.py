"""bulkinfer: batch LLM inference over object storage, on its own paged-KV engine.

    from bulkinfer import Client                      # the SDK (pip install 'bulkinfer[client]')
    from bulkinfer.engine import LLM, SamplingParams  # the engine alone (bulkinfer[worker])

Installed, everything lives under this one name (`bulkinfer.api`, `bulkinfer.jobs`, `bulkinfer.worker`,
`bulkinfer.engine`, `bulkinfer.benchmarks`), so nothing shadows a user's own `api` or `jobs` module.
The repository keeps those packages as top-level folders: the wheel maps them (setup.py), and in a
checkout this file puts the checkout's root on the package path, so `bulkinfer.engine` is `./engine`.
"""

from __future__ import annotations

import logging
from importlib import import_module
from pathlib import Path
from typing import Any

from bulkinfer.cpu_isa import apply_cpu_isa_cap

# Every entry point imports this package before torch: cap oneDNN and ATen here when
# $BULKINFER_CPU_ISA asks (bulkinfer/cpu_isa.py). A bad value must not break `import bulkinfer`.
try:
    apply_cpu_isa_cap()
except ValueError as _error:
    logging.getLogger("bulkinfer.cpu_isa").warning("%s: ignored", _error)

_CHECKOUT_ROOT = Path(__file__).resolve().parent.parent
# A checkout (not site-packages): its root has the project file and the package folders.
if (_CHECKOUT_ROOT / "pyproject.toml").is_file() and (_CHECKOUT_ROOT / "engine" / "__init__.py").is_file():
    __path__.append(str(_CHECKOUT_ROOT))

# Imported on first use: `import bulkinfer.engine` must not load the SDK, nor `from bulkinfer import
# Client` the engine.
_EXPORTS = {name: "bulkinfer.api.client"
            for name in ("Client", "AsyncClient", "JobState", "JobSpec", "ApiError", "WaitTimeout")}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'bulkinfer' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
