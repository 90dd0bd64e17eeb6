"""bulkinfer: batch LLM inference over object storage, on its own paged-KV engine.

    from bulkinfer import Client                      # the SDK (pip install 'bulkinfer[client]')
    from bulkinfer.engine import LLM, SamplingParams  # the engine alone (bulkinfer[worker])

Installed, everything lives under this one name (`bulkinfer.api`, `bulkinfer.jobs`, `bulkinfer.worker`,
`bulkinfer.engine`, `bulkinfer.benchmarks`), so nothing shadows a user's own `api` or `jobs` module.
The repository keeps those packages as top-level folders; in a checkout a link per package in this
folder (`bulkinfer/engine -> ../engine`) makes `bulkinfer.engine` `./engine` for Python and for tools
that read code without running it (editors, type checkers), and the wheel maps them (setup.py).
"""

from __future__ import annotations

import logging
from importlib import import_module
from typing import TYPE_CHECKING, Any

from bulkinfer.cpu_isa import apply_cpu_isa_cap

# Every entry point imports this package before torch: cap oneDNN and ATen here when
# $BULKINFER_CPU_ISA asks (bulkinfer/cpu_isa.py). A bad value must not break `import bulkinfer`.
try:
    apply_cpu_isa_cap()
except ValueError as _error:
    logging.getLogger("bulkinfer.cpu_isa").warning("%s: ignored", _error)

# Imported on first use: `import bulkinfer.engine` must not load the SDK, nor `from bulkinfer import
# Client` the engine. Type checkers and editors read the names from the block below.
if TYPE_CHECKING:
    from bulkinfer.api.client import ApiError, AsyncClient, Client, JobSpec, JobState, WaitTimeout

__all__ = ["ApiError", "AsyncClient", "Client", "JobSpec", "JobState", "WaitTimeout"]
_EXPORTS = dict.fromkeys(__all__, "bulkinfer.api.client")


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'bulkinfer' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
