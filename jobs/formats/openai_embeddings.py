"""OpenAI Batch API lines with `url: /v1/embeddings`: their body becomes one embed row.

`input` is a string, a list of strings, a list of token ids or a list of token-id lists (one vector
per input, in order); `encoding_format` is `float` (default) or `base64`; `dimensions` shortens the
vectors (else the job's `dimensions`). `model` and `user` are ignored, as on every line. The job's
`instructions` go before each text input (token ids are embedded as given); its `truncate`,
`pooling` and `normalize` apply to every line.
"""

from __future__ import annotations

from typing import Any

from bulkinfer.jobs.embedding import ENCODING_FORMATS, EmbedInput, EmbedRequest
from bulkinfer.jobs.formats.rows import Row, RowErrorCode, RowProblem, with_instructions_prompt
from bulkinfer.jobs.sampling import JobSampling
from bulkinfer.jobs.spec import JobSpec

EMBEDDINGS_URL = "/v1/embeddings"
EMBEDDING_FIELDS = frozenset({"input", "model", "encoding_format", "dimensions", "user"})
# OpenAI's own cap on inputs per request.
MAX_INPUTS = 2048


def embedding_row(index: int, custom_id: str, body: dict[str, Any], spec: JobSpec, line: int | None) -> Row:
    """The row of one `/v1/embeddings` body; raises `RowProblem` naming what is wrong."""
    unsupported = sorted(name for name in body if name not in EMBEDDING_FIELDS)
    if unsupported:
        raise RowProblem(RowErrorCode.INVALID_ROW, f"body.{unsupported[0]} is not supported in an "
                         f"/v1/embeddings body (known: {', '.join(sorted(EMBEDDING_FIELDS))})")
    inputs = tuple(_instructed(spec.instructions, item) for item in embedding_inputs(body.get("input")))
    given = body.get("encoding_format")
    encoding: Any = "float" if given is None else given  # checked just below
    if encoding not in ENCODING_FORMATS:
        raise RowProblem(RowErrorCode.INVALID_ROW, f"body.encoding_format must be one of "
                         f"{', '.join(ENCODING_FORMATS)}, got {encoding!r}")
    dimensions = body.get("dimensions")
    if dimensions is not None and (type(dimensions) is not int or dimensions < 1):
        raise RowProblem(RowErrorCode.INVALID_ROW,
                         f"body.dimensions must be a whole number ≥ 1, got {dimensions!r}")
    request = EmbedRequest(inputs, dimensions if dimensions is not None else spec.dimensions, encoding,
                           spec.truncate, spec.pooling, spec.normalize, spec.max_length)
    prompt = inputs[0] if len(inputs) == 1 and isinstance(inputs[0], str) else None
    return Row(index, custom_id, prompt, None, JobSampling(), None, {}, line, request)


def embedding_inputs(value: Any) -> list[EmbedInput]:
    """`input` as a list of texts and token-id tuples; raises `RowProblem` for any other shape."""
    if isinstance(value, str):
        items: list[Any] = [value]
    elif isinstance(value, list) and value and all(_is_token_id(item) for item in value):
        items = [tuple(value)]
    elif isinstance(value, list) and value:
        items = value
    else:
        raise RowProblem(RowErrorCode.INVALID_ROW, "body.input must be a string, a non-empty list of "
                         "strings, a list of token ids or a list of token-id lists")
    if len(items) > MAX_INPUTS:
        raise RowProblem(RowErrorCode.INVALID_ROW,
                         f"body.input has {len(items)} inputs; at most {MAX_INPUTS}")
    inputs: list[EmbedInput] = []
    for position, item in enumerate(items):
        where = "body.input" if len(items) == 1 else f"body.input[{position}]"
        if isinstance(item, str):
            if not item:
                raise RowProblem(RowErrorCode.INVALID_ROW, f"{where} is empty; there is nothing to embed")
            inputs.append(item)
        elif isinstance(item, list | tuple) and item and all(_is_token_id(token) for token in item):
            inputs.append(tuple(item))
        else:
            raise RowProblem(RowErrorCode.INVALID_ROW, f"{where} must be a non-empty string or a non-empty "
                             "list of token ids (whole numbers ≥ 0)")
    return inputs


def _is_token_id(value: Any) -> bool:
    return type(value) is int and value >= 0


def _instructed(instructions: str | None, item: EmbedInput) -> EmbedInput:
    return with_instructions_prompt(instructions, item) if isinstance(item, str) else item
