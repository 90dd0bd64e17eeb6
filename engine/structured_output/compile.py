"""StructuredSpec -> xgrammar CompiledGrammar (runs in the manager's compile threads)."""

from __future__ import annotations

import json
import re

import xgrammar as xgr

from bulkinfer.engine.structured_output.schema import ANY_CHAR_CLASS, prepare_json_schema, safe_regex
from bulkinfer.engine.structured_output.spec import StructuredSpec

# "Any JSON object": xgrammar's builtin JSON grammar also allows a top-level array.
ANY_JSON_OBJECT: dict = {"type": "object"}


class GrammarError(ValueError):
    """The spec cannot become a grammar; the message is shown to the user."""


def compile_spec(compiler: xgr.GrammarCompiler, spec: StructuredSpec) -> xgr.CompiledGrammar:
    """Compile one spec. Raises GrammarError("grammar for <kind> failed to compile: <why>")."""
    try:
        if spec.kind == "json":
            # Compact output (no free whitespace: a random or weak model can't pad forever) and
            # strict mode (no properties beyond those listed unless the schema allows them).
            return compiler.compile_json_schema(_schema_text(spec), any_whitespace=False, strict_mode=True)
        if spec.kind == "regex":
            return compiler.compile_regex(safe_regex(spec.value, ANY_CHAR_CLASS))
        if spec.kind == "choice":
            return compiler.compile_grammar(choice_ebnf(json.loads(spec.value)))
        if spec.kind == "structural_tag":
            return compiler.compile_structural_tag(structural_tag_text(spec))
        return compiler.compile_grammar(spec.value, root_rule_name="root")
    except Exception as exc:  # xgrammar raises RuntimeError / ValueError / its own errors
        raise _grammar_error(spec, exc) from exc


def check_spec(spec: StructuredSpec) -> None:
    """Build the spec's grammar without a tokenizer (milliseconds, no model): raises the same
    GrammarError a compile would, so a job can refuse a bad schema once instead of on every row."""
    try:
        if spec.kind == "json":
            xgr.Grammar.from_json_schema(_schema_text(spec), any_whitespace=False, strict_mode=True)
        elif spec.kind == "regex":
            xgr.Grammar.from_regex(safe_regex(spec.value, ANY_CHAR_CLASS))
        elif spec.kind == "choice":
            xgr.Grammar.from_ebnf(choice_ebnf(json.loads(spec.value)))
        elif spec.kind == "structural_tag":
            xgr.Grammar.from_structural_tag(structural_tag_text(spec))
        else:
            xgr.Grammar.from_ebnf(spec.value, root_rule_name="root")
    except Exception as exc:  # noqa: BLE001 - as in compile_spec
        raise _grammar_error(spec, exc) from exc


def _schema_text(spec: StructuredSpec) -> str:
    schema = ANY_JSON_OBJECT if spec.value == "" else json.loads(spec.value)
    return json.dumps(prepare_json_schema(schema), ensure_ascii=False)


def structural_tag_text(spec: StructuredSpec) -> str:
    """The structural tag with every JSON schema in it made safe as `json_schema` specs are."""
    return json.dumps(_safe_schemas(json.loads(spec.value)), ensure_ascii=False)


def _safe_schemas(node: object) -> object:
    if isinstance(node, list):
        return [_safe_schemas(item) for item in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and isinstance(node.get("json_schema"), dict):
        return {**node, "json_schema": prepare_json_schema(node["json_schema"])}
    return {key: _safe_schemas(value) for key, value in node.items()}


def _grammar_error(spec: StructuredSpec, exc: Exception) -> GrammarError:
    return GrammarError(f"grammar for {spec.kind_name} failed to compile: {clean_reason(str(exc))}")


# xgrammar's C++ messages start with "[12:00:00] /project/cpp/file.cc:123: " and sometimes
# "Check failed: (error.empty()) is false: "; the user needs the part after them.
_LOG_PREFIX = re.compile(r"^\[\d\d:\d\d:\d\d\] \S+:\d+: (Check failed: .*? is false: )?")


def clean_reason(message: str) -> str:
    return _LOG_PREFIX.sub("", " ".join(message.split()))


def choice_ebnf(choices: list[str]) -> str:
    """The output is exactly one of the choices' raw text. JSON string escapes are valid EBNF
    string literal escapes in xgrammar, so every character (quotes, backslashes, controls) is safe."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
