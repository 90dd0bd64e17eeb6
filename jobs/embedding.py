"""Embed rows: what one asks for (`EmbedRequest`) and how its vectors are shaped for the outputs.

Vectors travel as `array('f')` (float32, no numpy needed on the API side). `shorten` is the
Matryoshka step (first `dimensions` values, renormalised to unit length); `base64_vector` is
OpenAI's `encoding_format: base64`: the little-endian float32 bytes, as the openai SDK decodes them.
"""

from __future__ import annotations

import base64
import math
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

EncodingFormat = Literal["float", "base64"]
ENCODING_FORMATS: tuple[str, ...] = ("float", "base64")
# How a model's token vectors become one vector (engine/pooling.py's names): the mean of every
# token's, the first token's ([CLS]), or the last token's (a decoder's, as Qwen3-Embedding).
Pooling = Literal["mean", "cls", "last"]
# One input of an embed row: text (tokenized with the model's special tokens) or token ids as given.
EmbedInput = str | tuple[int, ...]


@dataclass(frozen=True, slots=True)
class EmbedRequest:
    """What an embed row asks for: one vector per input, in order."""

    inputs: tuple[EmbedInput, ...]
    dimensions: int | None = None  # None: the model's full size
    encoding_format: EncodingFormat = "float"  # OpenAI bodies only; the other outputs hold floats
    truncate: bool = False  # cut inputs past the model's maximum length instead of failing the row
    # None: the model's own (its sentence-transformers files, else its kind's default).
    pooling: Pooling | None = None
    normalize: bool | None = None
    max_length: int | None = None  # tokens per input at most, within the model's own maximum (None: that)


def shorten(vector: Sequence[float], dimensions: int | None, renormalize: bool = True) -> array:
    """The first `dimensions` values renormalised to unit length unless `renormalize` is False (a job
    that asked for `normalize: false`); the whole vector, as float32, when `dimensions` is None or
    the vector's size."""
    values = array("f", vector)
    if dimensions is None or dimensions == len(values):
        return values
    if dimensions > len(values):
        raise ValueError(f"dimensions {dimensions} is more than the model's {len(values)}")
    kept = values[:dimensions]
    if not renormalize:
        return kept
    norm = math.sqrt(math.fsum(value * value for value in kept))
    return array("f", (value / norm for value in kept)) if norm > 0 else kept


def little_endian_bytes(vector: array) -> bytes:
    if sys.byteorder == "little":
        return vector.tobytes()
    swapped = array("f", vector)
    swapped.byteswap()
    return swapped.tobytes()


def base64_vector(vector: array) -> str:
    return base64.b64encode(little_endian_bytes(vector)).decode("ascii")


def vector_from_base64(text: str) -> array:
    """`base64_vector` read back."""
    values = array("f", base64.b64decode(text))
    if sys.byteorder != "little":
        values.byteswap()
    return values
