"""JSON schemas through the manager with random logits at temperature 1.0: every output of the
corpus parses with strict json.loads and validates (formats checked too). Also the schema
rewrites that make this true on xgrammar 0.2.9 (mlc-ai/xgrammar#800 and friends), each shown to
be needed: compiled without the rewrite, xgrammar emits outputs that fail."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import xgrammar as xgr
from transformers import AutoTokenizer

from bulkinfer.engine.structured_output import StructuredOutputManager, StructuredSpec
from bulkinfer.engine.structured_output.schema import (
    FORMAT_PATTERNS,
    UnsupportedSchema,
    prepare_json_schema,
    safe_regex,
)
from tests.engine.structured_schemas import SCHEMAS, sample_with_random_logits

VOCAB = 2048
LENGTH_LIMITED = {
    "type": "object",
    "properties": {
        "a": {"type": "string", "minLength": 1, "maxLength": 8},
        "b": {"type": "string", "maxLength": 3},
        "c": {"type": "array", "items": {"type": "string", "minLength": 2, "maxLength": 5}, "maxItems": 3},
    },
    "required": ["a", "b", "c"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint: Path):
    return AutoTokenizer.from_pretrained(tiny_checkpoint)


@pytest.fixture(scope="module")
def manager(tokenizer):
    manager = StructuredOutputManager(tokenizer, VOCAB, max_num_seqs=256)
    yield manager
    manager.shutdown()


def validator(schema: dict) -> jsonschema.protocols.Validator:
    cls = jsonschema.validators.validator_for(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def sample_texts(manager, tokenizer, spec: StructuredSpec, count: int, seed: int) -> list[str | None]:
    ids = [f"{seed}-{i}" for i in range(count)]
    for request_id in ids:
        manager.register(request_id, spec)
    for request_id in ids:
        assert manager._wait_ready(request_id) == "ready", manager.error(request_id)
    tokens = sample_with_random_logits(manager, ids, VOCAB, seed=seed, max_steps=600)
    for request_id in ids:
        manager.release(request_id)
    return [None if t is None else tokenizer.decode(t) for t in tokens.values()]


def assert_all_valid(schema: dict, texts: list[str | None]) -> None:
    check = validator(schema)
    unfinished = [i for i, t in enumerate(texts) if t is None]
    assert not unfinished, f"{len(unfinished)} outputs did not finish"
    for text in texts:
        value = json.loads(text)  # strict: raw control characters fail here
        errors = [e.message for e in check.iter_errors(value)]
        assert not errors, (text, errors)


def test_the_corpus_is_diverse() -> None:
    assert len(SCHEMAS) >= 20
    text = json.dumps(SCHEMAS)
    for keyword in ("$defs", "$ref", "anyOf", "oneOf", "enum", "const", "minItems", "maxItems", "prefixItems",
                    "minimum", "exclusiveMaximum", "multipleOf", "maxLength", "pattern", "format", "null",
                    "boolean", '"additionalProperties": false'):
        assert keyword in text, keyword


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_output_parses_strictly_and_validates(manager, tokenizer, name: str) -> None:
    schema = SCHEMAS[name]
    texts = sample_texts(manager, tokenizer, StructuredSpec.json_schema(schema), 24, seed=len(name))
    assert_all_valid(schema, texts)


def test_length_limited_strings_never_hold_control_characters(manager, tokenizer) -> None:
    """mlc-ai/xgrammar#800, 256 samples."""
    texts = sample_texts(manager, tokenizer, StructuredSpec.json_schema(LENGTH_LIMITED), 256, seed=800)
    assert_all_valid(LENGTH_LIMITED, texts)


def _raw_xgrammar_texts(tokenizer, schema: dict, count: int, seed: int) -> list[str | None]:
    """The same loop, compiled by xgrammar directly (no rewrite)."""

    class Raw(StructuredOutputManager):
        def _compile(self, spec: StructuredSpec) -> xgr.CompiledGrammar:
            return self.compiler.compile_json_schema(spec.value, any_whitespace=False, strict_mode=True)

    raw = Raw(tokenizer, VOCAB, max_num_seqs=count)
    try:
        return sample_texts(raw, tokenizer, StructuredSpec.json_schema(schema), count, seed)
    finally:
        raw.shutdown()


def _invalid(schema: dict, texts: list[str | None]) -> int:
    check, bad = validator(schema), 0
    for text in texts:
        try:
            bad += bool(list(check.iter_errors(json.loads(text))))
        except json.JSONDecodeError:
            bad += 1
    return bad


@pytest.mark.parametrize(
    "schema",
    [
        LENGTH_LIMITED,  # raw control characters, overlong UTF-8 (#800)
        {
            "type": "object",
            "properties": {
                "ip": {"type": "string", "format": "ipv4"},
                "day": {"type": "string", "format": "date"},
            },
            "required": ["ip", "day"],
        },
        {"type": "string", "pattern": "^x(a[0-9]{1,6})?Z$"},  # optional group holding a quantifier
    ],
    ids=["length", "formats", "optional-group"],
)
def test_each_rewrite_is_needed(manager, tokenizer, schema: dict) -> None:
    """Without the rewrite xgrammar emits invalid outputs (if this starts failing, xgrammar fixed it)."""
    assert _invalid(schema, _raw_xgrammar_texts(tokenizer, schema, 128, seed=1)) > 0
    spec = StructuredSpec.json_schema(schema)
    assert_all_valid(schema, sample_texts(manager, tokenizer, spec, 128, seed=1))


def test_rewrites() -> None:
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 4},
                                              "t": {"type": "string", "minLength": 1},
                                              "d": {"type": "string", "format": "date"},
                                              "p": {"type": "string", "pattern": "^(a+)?b$"}}}
    before = json.dumps(schema)
    prepared = prepare_json_schema(schema)
    assert json.dumps(schema) == before  # the caller's schema is not modified
    props = prepared["properties"]
    assert "minLength" not in props["s"] and props["s"]["pattern"].endswith("{2,4}$")
    assert props["t"]["pattern"].endswith("{1,}$")
    assert props["d"] == {"type": "string", "pattern": FORMAT_PATTERNS["date"]}
    assert props["p"]["pattern"] == "^(a+){0,1}b$"
    # The rewritten length pattern means what it says, for Python's re too.
    safe = re.compile(props["s"]["pattern"])
    assert safe.fullmatch("ab") and safe.fullmatch("日本語!") and not safe.fullmatch("a")
    assert not safe.fullmatch("a\x01") and not safe.fullmatch('a"') and not safe.fullmatch("a\\")


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [("(a)?", "(a){0,1}"), (r"\)?", r"\)?"), ("[)?]", "[)?]"), ("((a)?b)?", "((a){0,1}b){0,1}"),
     (r"[\])?](a)?", r"[\])?](a){0,1}"), ("a?", "a?"), (r"a.\.[.]", r"a<dot>\.[.]")],
)
def test_safe_regex(pattern: str, expected: str) -> None:
    assert safe_regex(pattern, "<dot>") == expected


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"not": {"type": "null"}}, "'not' is not enforced by the grammar engine (at #/not)"),
        ({"type": "object", "properties": {"x": {"if": {}, "then": {}}}},
         "'if'/'then'/'else' are not enforced by the grammar engine (at #/properties/x/if)"),
        ({"type": "array", "contains": {"type": "integer"}}, "'contains' is not enforced"),
        ({"type": "array", "items": {"type": "array", "uniqueItems": True}},
         "'uniqueItems' is not enforced by the grammar engine (at #/items/uniqueItems)"),
        ({"allOf": [{"type": "object"}, {"required": ["a"]}]}, "'allOf' with more than one schema"),
        ({"$defs": {"d": {"type": "string", "pattern": "^a+$", "maxLength": 3}}},
         "a string with both 'pattern' and minLength/maxLength is not supported"),
        ({"type": "string", "format": "email", "minLength": 3}, "both 'format' and minLength/maxLength"),
        ({"type": "string", "minLength": 3, "maxLength": 2}, "'maxLength' 2 is below 'minLength' 3"),
        ({"type": "object", "dependentRequired": {"a": ["b"]}}, "'dependentRequired' is not enforced"),
        ([1], "a JSON schema must be an object or a boolean"),
    ],
)
def test_what_xgrammar_would_not_enforce_is_refused_with_the_reason(schema, message: str) -> None:
    with pytest.raises(UnsupportedSchema) as info:
        prepare_json_schema(schema)
    assert message in str(info.value)
