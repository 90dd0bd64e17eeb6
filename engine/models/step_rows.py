"""`StepRows`: what the current forward pass's rows are, as the projections see them (which run
through the row kernel, the step's LoRA rows, image encoder rows, M-RoPE rows). The model sets it at
the start of each forward; its layers, quantized projections and LoRA slots read it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bulkinfer.engine.lora.rows import LoRARows
    from bulkinfer.engine.multimodal.mrope import StepRopeRows
    from bulkinfer.engine.multimodal.step_embeds import StepImageEmbeds


@dataclass
class StepRows:
    """How many leading rows of the current forward pass are single-token rows (decodes and
    verified drafts come first in a step's flattened batch): those rows' projections run through
    the row kernel, the rest through torch.mm. Set by the model at the start of each forward."""

    single: int = 0
    # Batch invariance: every row through the row kernel (each row alone), prefill rows too: oneDNN's
    # bf16 GEMM picks its kernel by the call's row count (AMX up to 32 rows, another one at 33-600)
    # and those round differently, so a prompt token's bits would follow the step's size.
    every_row: bool = False
    # The step's LoRA rows (engine/lora/rows.py), set by the model runner; None: no row has an adapter.
    lora: LoRARows | None = None
    # Image encoder rows for the step's image tokens (engine/multimodal/step_embeds.py); None: none.
    images: StepImageEmbeds | None = None
    # M-RoPE: the step's image rows and their three-part positions (engine/multimodal/mrope.py).
    rope_rows: StepRopeRows | None = None
