"""Response bodies that are not domain models (a job's status is `bulkinfer.jobs.state.status.JobStatus`
itself)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from bulkinfer.jobs.state.results import TokenUsage
from bulkinfer.jobs.state.status import JobStatus, RowCounts
from bulkinfer.jobs.workers import BEAT_TTL_S, WorkerBeat


class ErrorBody(BaseModel):
    detail: str = Field(description="what went wrong, for a person")
    messages: list[str] = Field(default_factory=list, description="one line per problem (`field: problem`)")


class OpenAIError(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIErrorBody(BaseModel):
    """The error body under /v1/ (OpenAI's shape: its SDK raises its typed exceptions from it)."""

    error: OpenAIError


class AnthropicError(BaseModel):
    type: str
    message: str


class AnthropicErrorBody(BaseModel):
    """The error body under /v1/messages/ (Anthropic's shape)."""

    type: str = Field(pattern="^error$")
    error: AnthropicError


def error_responses(model: type[BaseModel],
                    descriptions: dict[int, str]) -> dict[int | str, dict[str, object]]:
    """The schema's `responses` for these statuses, each with `model` as its body."""
    return {code: {"model": model, "description": text} for code, text in descriptions.items()}


class JobPage(BaseModel):
    jobs: list[JobStatus]
    next_cursor: str | None = Field(None, description="pass as ?cursor= for the next page; null on the last")


class ResultPart(BaseModel):
    shard_index: int
    first_row: int | None = Field(None, description="position of the part's first row among all rows")
    rows: int
    bytes: int
    sha256: str
    uri: str
    url: str = Field(description="a presigned GET URL (a file:// URI for a local store)")


class JobResults(BaseModel):
    job_id: str
    state: str = Field("succeeded", description="the job's state when this answer was made")
    partial: bool = Field(False, description="true unless the job succeeded: only the shards finished so "
                                             "far (asked for with partial=true); more may come")
    shards_done: int = Field(0, description="shards in this answer")
    shards_total: int = Field(0, description="shards the job has")
    output_format: str
    rows: RowCounts
    usage: TokenUsage
    parts: list[ResultPart]
    error_parts: list[ResultPart] = Field(description="the failed rows of each shard, with reasons")
    dtypes: list[str] = Field([], description="the dtypes the engines computed in (float32, bfloat16, …)")
    usage_by_lora: dict[str, TokenUsage] = Field({}, description="the part of usage each LoRA adapter ran, "
                                                 "by name (the base model's is the rest)")


class ModelList(BaseModel):
    models: list[str]
    adapters: dict[str, list[str]] = Field(default_factory=dict, description="each served model's LoRA "
                                           "adapters by name (a job's lora, a row's lora_column, a batch "
                                           "line's model); models without any are left out, and the "
                                           "field when no model has any")


class Health(BaseModel):
    status: str = Field(description="ok, or failing")
    checks: dict[str, str]


ERROR_RESPONSES: dict[int | str, dict[str, object]] = {
    code: {"model": ErrorBody, "description": description} for code, description in {
        400: "the input or model cannot be used", 404: "no such job", 409: "conflicts with the job's state "
        "or an earlier submit", 422: "the request or job spec is invalid", 503: "a backing service is down",
    }.items()}


class WorkerList(BaseModel):
    workers: list[WorkerBeat] = Field(description="every worker that sent a heartbeat in the last "
                                                  f"{BEAT_TTL_S} s, by hostname")
