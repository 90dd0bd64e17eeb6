"""bulkinfer's inference engine: a vLLM-V1-style paged-KV engine in PyTorch.

from engine import LLM, SamplingParams
outputs = LLM(model="path/to/hf-folder").generate(["Hello"], SamplingParams(max_tokens=8))
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.errors import ErrorKind, LoRAAdapterError, SamplingParamsError
    from engine.llm import LLM
    from engine.llm_engine import LLMEngine
    from engine.lora import LoRARequest
    from engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput, TokenLogprob
    from engine.sampling_params import SamplingParams

# Imported on first use, so torch-free parts (engine.kv_connector.catalog, for `bulkinfer kv ls`)
# can be imported without loading torch.
_HOMES = {
    "LLM": "engine.llm", "CompletionOutput": "engine.outputs", "EngineConfig": "engine.config",
    "ErrorKind": "engine.errors", "LLMEngine": "engine.llm_engine", "LoRAAdapterError": "engine.errors",
    "LoRARequest": "engine.lora", "PositionLogprobs": "engine.outputs", "RequestOutput": "engine.outputs",
    "SamplingParams": "engine.sampling_params", "SamplingParamsError": "engine.errors",
    "TokenLogprob": "engine.outputs",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "ErrorKind",
    "LLMEngine",
    "LoRAAdapterError",
    "LoRARequest",
    "PositionLogprobs",
    "RequestOutput",
    "SamplingParams",
    "SamplingParamsError",
    "TokenLogprob",
]
