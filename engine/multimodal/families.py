"""Which image processor a checkpoint's family uses, from its config alone (no weights loaded): the
engine builds it at start-up, and a worker renders its rows' prompts with it off the engine's loop."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bulkinfer.engine.multimodal.processing import ImageProcessorFamily


def image_family(model_dir: str | Path, tokenizer: Any) -> ImageProcessorFamily | None:
    """The family's processor; None for a text-only model."""
    from bulkinfer.engine.models.idefics3 import Idefics3Config
    from bulkinfer.engine.models.idefics3_processing import Idefics3ImageProcessing
    from bulkinfer.engine.models.loader import model_config_from_dir
    from bulkinfer.engine.models.qwen2_5_vl import Qwen25VLConfig
    from bulkinfer.engine.models.qwen2_5_vl_processing import QwenImageProcessing

    config = model_config_from_dir(model_dir)
    if isinstance(config, Qwen25VLConfig) and config.vision is not None:
        return QwenImageProcessing(model_dir, config.image_token_id, config.vision.spatial_merge_size)
    if not isinstance(config, Idefics3Config) or config.vision is None:
        return None
    return Idefics3ImageProcessing(model_dir, tokenizer, config.image_token_id, config.vision.image_size,
                                   config.vision.patch_size, config.scale_factor)
