"""LoRA adapters chosen per request: many fine-tunes of one base model served in the same steps.

``LoRARequest`` names the adapter (vLLM's fields); ``read_adapter_config`` validates a PEFT folder
without a model; the engine's ``LoRAManager`` (engine/lora/manager.py) loads adapters into slots
that the model's projections apply per row (engine/lora/slots.py).
"""

from bulkinfer.engine.lora.adapter_config import AdapterConfig, read_adapter_config
from bulkinfer.engine.lora.request import LoRARequest

__all__ = ["AdapterConfig", "LoRARequest", "read_adapter_config"]
