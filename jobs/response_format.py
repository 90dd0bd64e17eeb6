"""Structured-output requests in the OpenAI shape: `json_object` or `json_schema`."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator

# A schema becomes a grammar compiled for the job (or each row that brings one): limits keep one
# submission from holding a worker's compiler for minutes or its memory for gigabytes.
MAX_SCHEMA_BYTES = 64 * 1024
MAX_SCHEMA_DEPTH = 32


def schema_depth(value: Any) -> int:
    """Nesting depth of JSON containers (a flat object is 1), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in children)
    return deepest


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    # `schema` shadows a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] = Field(
        alias="schema", description=f"a JSON schema of at most {MAX_SCHEMA_BYTES} bytes (compact JSON) "
                                    f"and {MAX_SCHEMA_DEPTH} levels of nesting")
    strict: bool | None = None

    @field_validator("json_schema")
    @classmethod
    def _schema_within_limits(cls, schema: dict[str, Any]) -> dict[str, Any]:
        size = len(json.dumps(schema, separators=(",", ":"), ensure_ascii=False).encode())
        if size > MAX_SCHEMA_BYTES:
            raise ValueError(f"the schema is {size:,} bytes; at most {MAX_SCHEMA_BYTES:,} are allowed")
        depth = schema_depth(schema)
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"the schema nests {depth} levels deep; at most {MAX_SCHEMA_DEPTH} are allowed")
        return schema


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
