"""StructuredSpec -> xgrammar CompiledGrammar (runs in the manager's compile threads)."""

from __future__ import annotations

import json
import re

import xgrammar as xgr

from engine.structured_output.schema import ANY_CHAR_CLASS, prepare_json_schema, safe_regex
from engine.structured_output.spec import StructuredSpec

# "Any JSON object": xgrammar's builtin JSON grammar also allows a top-level array.
ANY_JSON_OBJECT: dict = {"type": "object"}


class GrammarError(ValueError):
    """The spec cannot become a grammar; the message is shown to the user."""


def compile_spec(compiler: xgr.GrammarCompiler, spec: StructuredSpec) -> xgr.CompiledGrammar:
    """Compile one spec. Raises GrammarError("grammar for <kind> failed to compile: <why>")."""
    try:
        if spec.kind == "json":
            schema = ANY_JSON_OBJECT if spec.value == "" else json.loads(spec.value)
            # Compact output (no free whitespace: a random or weak model can't pad forever) and
            # strict mode (no properties beyond those listed unless the schema allows them).
            text = json.dumps(prepare_json_schema(schema), ensure_ascii=False)
            return compiler.compile_json_schema(text, any_whitespace=False, strict_mode=True)
        if spec.kind == "regex":
            return compiler.compile_regex(safe_regex(spec.value, ANY_CHAR_CLASS))
        if spec.kind == "choice":
            return compiler.compile_grammar(choice_ebnf(json.loads(spec.value)))
        return compiler.compile_grammar(spec.value, root_rule_name="root")
    except Exception as exc:  # xgrammar raises RuntimeError / ValueError / its own errors
        reason = clean_reason(str(exc))
        raise GrammarError(f"grammar for {spec.kind_name} failed to compile: {reason}") from exc


# xgrammar's C++ messages start with "[12:00:00] /project/cpp/file.cc:123: " and sometimes
# "Check failed: (error.empty()) is false: "; the user needs the part after them.
_LOG_PREFIX = re.compile(r"^\[\d\d:\d\d:\d\d\] \S+:\d+: (Check failed: .*? is false: )?")


def clean_reason(message: str) -> str:
    return _LOG_PREFIX.sub("", " ".join(message.split()))


def choice_ebnf(choices: list[str]) -> str:
    """The output is exactly one of the choices' raw text. JSON string escapes are valid EBNF
    string literal escapes in xgrammar, so every character (quotes, backslashes, controls) is safe."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
