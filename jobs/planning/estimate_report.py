"""`JobEstimate`: what a dry run answers (jobs/planning/estimate.py computes it). Its own light module: the
SDK reads it and installs without the readers and stores the estimate needs."""

from __future__ import annotations

from pydantic import BaseModel, Field


class JobEstimate(BaseModel):
    dry_run: bool = True
    model: str
    shards: int
    rows: int = Field(description="rows in the input (an estimate when not every row was read)")
    rows_read: int = Field(description="rows actually read and counted; the figures below scale from them")
    rows_failing: int = Field(description="rows that would fail before running (unreadable, no prompt, ...)")
    rows_deduplicated: int = Field(description="rows that would take an identical row's output, not run")
    rows_by_lora: dict[str, int] = Field(default_factory=dict, description="running rows per LoRA adapter "
                                         "(the rest run on the base model); rows naming an adapter not "
                                         "registered count in rows_failing")
    prompt_tokens: int | None = Field(description="counted with the model's tokenizer; None without it")
    shared_prefix_tokens: int | None = Field(description="prompt tokens the prefix cache would reuse")
    max_output_tokens: int = Field(description="each running row's max_tokens (unset: the deployment's "
                                   "max_tokens_cap) × n, summed: an upper bound")
    expected_output_tokens: int = Field(0, description="what the running rows are expected to generate: "
                                        "each row's max_tokens or the model's measured output length "
                                        "(before it has one, the output_tokens_estimate setting), "
                                        "whichever is less, × n")
    estimated_seconds: float | None = Field(description="None: this deployment has not measured the model")
    estimate_basis: str = Field(description="how the run time was estimated, or why it is unknown")
    tokenizer: str | None = Field(description="where the tokenizer came from")
    problems: list[str] = Field(default_factory=list, description="what would fail the job at planning")
