"""bulkinfer's inference engine: a vLLM-V1-style paged-KV engine in PyTorch.

from bulkinfer.engine import LLM, SamplingParams
outputs = LLM(model="path/to/hf-folder").generate(["Hello"], SamplingParams(max_tokens=8))
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bulkinfer.engine.config import EngineConfig
    from bulkinfer.engine.errors import ErrorKind, LoRAAdapterError, SamplingParamsError
    from bulkinfer.engine.llm import LLM
    from bulkinfer.engine.llm_engine import LLMEngine
    from bulkinfer.engine.lora import LoRARequest
    from bulkinfer.engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput, TokenLogprob
    from bulkinfer.engine.sampling_params import SamplingParams

# Imported on first use, so torch-free parts (bulkinfer.engine.kv_connector.catalog, for `bulkinfer kv ls`)
# can be imported without loading torch.
_HOMES = {
    "LLM": "bulkinfer.engine.llm", "CompletionOutput": "bulkinfer.engine.outputs",
    "EngineConfig": "bulkinfer.engine.config",
    "ErrorKind": "bulkinfer.engine.errors", "LLMEngine": "bulkinfer.engine.llm_engine",
    "LoRAAdapterError": "bulkinfer.engine.errors",
    "LoRARequest": "bulkinfer.engine.lora", "PositionLogprobs": "bulkinfer.engine.outputs",
    "RequestOutput": "bulkinfer.engine.outputs",
    "SamplingParams": "bulkinfer.engine.sampling_params", "SamplingParamsError": "bulkinfer.engine.errors",
    "TokenLogprob": "bulkinfer.engine.outputs",
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
