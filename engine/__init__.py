"""bulkinfer's inference engine: a vLLM-V1-style paged-KV engine in PyTorch.

from engine import LLM, SamplingParams
outputs = LLM(model="path/to/hf-folder").generate(["Hello"], SamplingParams(max_tokens=8))
"""

from engine.config import EngineConfig
from engine.errors import ErrorKind, LoRAAdapterError, SamplingParamsError
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.lora import LoRARequest
from engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams

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
