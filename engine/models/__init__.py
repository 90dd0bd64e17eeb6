"""Model implementations (the Llama family) and the HF safetensors loader."""

from bulkinfer.engine.models.llama import LlamaForCausalLM
from bulkinfer.engine.models.llama_config import LlamaFamilyConfig, UnsupportedModelError
from bulkinfer.engine.models.loader import (
    SUPPORTED_ARCHITECTURES,
    CheckpointError,
    load_model,
    model_config_from_dir,
)

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CheckpointError",
    "LlamaFamilyConfig",
    "LlamaForCausalLM",
    "UnsupportedModelError",
    "load_model",
    "model_config_from_dir",
]
