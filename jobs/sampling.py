"""Sampling parameters a job (or one row) may set: the OpenAI / vLLM knobs, with valid ranges."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP_SEQUENCES = 16
# Samples per row: each is a full completion (the prompt's KV is shared), so a cap keeps one row
# from taking a shard's worth of work.
MAX_N = 16



class JobSampling(BaseModel):
    """Unset fields mean "the engine's default"; a row's overrides are merged over the job's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    n: int | None = Field(None, ge=1, le=MAX_N, description="samples per row (choices in the output)")
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, description="-1 or 0 disables top-k")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=0, description="unset: until the answer ends (EOS or a stop), "
                                   "bounded by the model's context and the deployment's max_tokens_cap "
                                   "(OpenAI /v1/completions lines: 16, that API's default); 0: generate "
                                   "nothing (score the prompt: prompt_logprobs)")
    min_tokens: int | None = Field(None, ge=0)
    seed: int | None = None
    stop: list[str] | None = Field(None, max_length=MAX_STOP_SEQUENCES,
                                   json_schema_extra={"items": {"type": "string", "minLength": 1}})
    include_stop_str_in_output: bool | None = Field(None, description="keep the matched stop string (vLLM)")
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = Field(None, description="keep generating past EOS (as vLLM's extra knob)")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    logprobs: int | None = Field(None, ge=0, le=20, description="top-k logprobs per output token (0: the "
                                 "chosen token's only); OpenAI chat's logprobs/top_logprobs map here")
    prompt_logprobs: int | None = Field(None, ge=0, le=20, description="per prompt token after the first: "
                                        "its logprob and the top-k alternatives (0: its own only), as vLLM's")
    skip_special_tokens: bool | None = Field(None, description="leave special tokens out of the text (vLLM)")

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:  # raw user input
        # OpenAI accepts one string or a list of strings.
        return [value] if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _stop_strings_not_empty(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(not item for item in value):
            raise ValueError("stop strings must not be empty")
        return value

    def merged(self, overrides: JobSampling | dict[str, Any] | None) -> JobSampling:
        """These params with every field `overrides` sets taking precedence (validated again)."""
        if not overrides:
            return self
        if isinstance(overrides, JobSampling):
            overrides = overrides.model_dump(exclude_none=True)
        return JobSampling.model_validate({**self.model_dump(exclude_none=True), **overrides})

    def as_dict(self) -> dict[str, Any]:
        """Only the fields that were set: what the engine should override."""
        return self.model_dump(exclude_none=True)
