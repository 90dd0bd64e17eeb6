"""What a request asks its output to match, as a hashable cache key."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

Kind = Literal["json", "regex", "choice", "grammar", "structural_tag"]
KINDS: tuple[Kind, ...] = ("json", "regex", "choice", "grammar", "structural_tag")

# The names users know these kinds by (SamplingParams fields), for error messages.
KIND_NAMES: dict[str, str] = {
    "json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
    "structural_tag": "structural_tag",
}


@dataclass(frozen=True)
class StructuredSpec:
    """``kind`` and ``value`` are the compile cache key.

    json: the schema as canonical JSON text ("" = any JSON object); regex: the pattern;
    choice: the choices as a JSON list text; grammar: EBNF text (xgrammar dialect, rule ``root``);
    structural_tag: xgrammar's structural tag as canonical JSON text.
    """

    kind: Kind
    value: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.value, str):
            raise ValueError(f"structured output value must be a str, got {type(self.value).__name__}")

    @staticmethod
    def json_schema(schema: dict | bool) -> StructuredSpec:
        """``True`` (any JSON object) or a schema dict, in canonical text (equal schemas share a key)."""
        if schema is True:
            return StructuredSpec("json", "")
        if not isinstance(schema, dict):
            raise ValueError(f"json_schema must be a dict or True, got {schema!r}")
        return StructuredSpec("json", canonical_json(schema))

    @staticmethod
    def regex(pattern: str) -> StructuredSpec:
        return StructuredSpec("regex", pattern)

    @staticmethod
    def choice(choices: list[str]) -> StructuredSpec:
        if not choices or not all(isinstance(c, str) for c in choices):
            raise ValueError(f"choice must be a non-empty list of strings, got {choices!r}")
        return StructuredSpec("choice", json.dumps(list(choices), ensure_ascii=False))

    @staticmethod
    def structural_tag(tag: dict) -> StructuredSpec:
        if not isinstance(tag, dict):
            raise ValueError(f"structural_tag must be a dict, got {tag!r}")
        return StructuredSpec("structural_tag", canonical_json(tag))

    @staticmethod
    def grammar(ebnf: str) -> StructuredSpec:
        return StructuredSpec("grammar", ebnf)

    @property
    def kind_name(self) -> str:
        return KIND_NAMES[self.kind]


def canonical_json(value: object) -> str:
    """Schema text for the cache key: keys sorted (equal schemas share one compile), except the
    order of a `properties` map, which is kept: outputs list their fields in the schema's order, and
    that order is the user's (e.g. "reasoning" before "answer")."""
    return json.dumps(_ordered(value, keep_order=False), separators=(",", ":"), ensure_ascii=False)


def _ordered(value: object, keep_order: bool) -> object:
    if isinstance(value, dict):
        items = value.items() if keep_order else sorted(value.items())
        # Only a schema's own "properties" keeps its order, not a property that happens to be so named.
        return {key: _ordered(item, keep_order=key == "properties" and not keep_order)
                for key, item in items}
    if isinstance(value, list):
        return [_ordered(item, keep_order=False) for item in value]
    return value
