"""Structured-output requests in the OpenAI shape: `json_object` or `json_schema`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    # `schema` shadows a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


class JsonObjectFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["json_object"]


class TextFormat(BaseModel):
    """Plain text: the same as asking for no format; accepted because OpenAI files contain it."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]


AnyResponseFormat = JsonSchemaFormat | JsonObjectFormat | TextFormat
ResponseFormat = Annotated[AnyResponseFormat, Field(discriminator="type")]
RESPONSE_FORMAT = TypeAdapter(ResponseFormat)


def wants_json(response_format: AnyResponseFormat | None) -> bool:
    """Whether the output text should parse as JSON (and be written parsed)."""
    return isinstance(response_format, JsonSchemaFormat | JsonObjectFormat)


def engine_response_format(response_format: AnyResponseFormat | None) -> dict[str, Any] | None:
    """What a row hands the engine: the OpenAI wire shape (with `schema`), or None for plain text."""
    if not wants_json(response_format):
        return None
    return response_format.model_dump(by_alias=True, exclude_none=True)  # type: ignore[union-attr]
