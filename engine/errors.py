"""Why a request ended with finish_reason "error", as a code callers map to their own.

A request's `error` is a sentence for people; its `error_kind` is what programs branch on, so a
reworded message never changes how a caller classifies it (vLLM likewise maps request statuses to
finish reasons instead of parsing text).
"""

from __future__ import annotations

import enum


class ErrorKind(enum.StrEnum):
    INVALID_PROMPT = "invalid_prompt"  # not a string or token ids, an id outside the vocabulary
    EMPTY_PROMPT = "empty_prompt"
    PROMPT_TOO_LONG = "prompt_too_long"  # past max_model_len or the whole KV pool
    INVALID_SAMPLING = "invalid_sampling"  # a SamplingParams value out of its range
    # A structured-output constraint that is malformed, does not compile (or not in time), or whose
    # grammar rejected the model's token.
    STRUCTURED_OUTPUT = "structured_output"
    NON_FINITE_LOGITS = "non_finite_logits"  # NaN/inf logits: a numerical fault of the model or dtype
    INVALID_IMAGE = "invalid_image"  # an image that cannot be read, or a model that takes none
    ENGINE_FAILURE = "engine_failure"  # the engine itself failed while running the request


class SamplingParamsError(ValueError):
    """A `SamplingParams` value out of range; `kind` says which sort (sampling or structured output)."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class LoRAAdapterError(ValueError):
    """A LoRA adapter that cannot be served: files missing or unreadable, a PEFT setting the engine
    does not run (DoRA, bias, modules_to_save, another PEFT type), a config field of the wrong JSON
    type, a tensor that is not a float matrix of rank ``r``, a rank above ``max_lora_rank``, a
    target module or tensor shape the base model lacks. The message names the adapter and the problem."""
