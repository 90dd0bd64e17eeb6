"""Make a JSON schema safe for xgrammar 0.2.9 before compiling it (see docs/structured-output.md).

Each rewrite below answers a case where xgrammar's grammar admits outputs that strict
``json.loads`` or a validator rejects (measured; tests/engine/test_structured_output_schemas.py):

1. mlc-ai/xgrammar#800: a string with ``minLength``/``maxLength`` compiles to ``[^"\\\r\n]{m,n}``,
   which admits raw control characters (strict ``json.loads`` rejects them), encoded surrogates
   and overlong UTF-8 (they decode to U+FFFD and break the length). The limits become a
   ``pattern`` over SAFE_CHAR_CLASS: xgrammar counts a regex repetition in code points, as JSON
   Schema counts length, so every string it allows is valid for the original schema (it offers
   no escapes in such strings, which only narrows the choice).
2. ``format`` date / time / date-time / ipv4: xgrammar allows Nov 31 and leading-zero octets;
   they become exact-or-narrower patterns.
3. ``pattern`` regexes (and ``regex`` specs, see compile.py): an optional group holding a
   quantifier (``(a[0-9]+)?``) is mis-compiled, and ``.`` admits invalid UTF-8; see safe_regex.
4. Keywords xgrammar silently ignores (``not``, ``if``, ``contains``, ``uniqueItems``, ...), or
   drops when combined (pattern/format with minLength/maxLength): the schema fails to compile,
   naming the keyword and where, instead of producing outputs that do not validate.
"""

from __future__ import annotations

import copy
from typing import Any

# Keywords that xgrammar 0.2.9 does not enforce (checked one by one against its grammar output).
UNENFORCED = {
    "not": "'not' is not enforced",
    "if": "'if'/'then'/'else' are not enforced",
    "then": "'if'/'then'/'else' are not enforced",
    "else": "'if'/'then'/'else' are not enforced",
    "contains": "'contains' is not enforced",
    "minContains": "'minContains' is not enforced",
    "maxContains": "'maxContains' is not enforced",
    "dependentRequired": "'dependentRequired' is not enforced",
    "dependentSchemas": "'dependentSchemas' is not enforced",
    "dependencies": "'dependencies' is not enforced",
}

# Subschema positions: keyword -> how its value holds schemas.
_SCHEMA = ("additionalProperties", "items", "propertyNames", "unevaluatedProperties", "unevaluatedItems")
_SCHEMA_MAP = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")

# Characters a JSON string may hold unescaped: no quote, backslash or control character, and
# valid UTF-8 only. Written as literal characters on purpose: xgrammar then builds exact UTF-8
# byte ranges, while a negated class (or \\u escapes) also lets through overlong encodings
# (E0 85 AE) and encoded surrogates (ED A0 80), bytes that decode to U+FFFD replacement
# characters, which breaks the length count (measured on xgrammar 0.2.9).
SAFE_CHAR_CLASS = "[ !#-\\[\\]-\ud7ff\ue000-\U0010ffff]"
# Python's ``.`` (any character but a newline), valid UTF-8 only, for the ``regex`` kind. NUL is
# escaped: xgrammar refuses a literal NUL in a regex.
ANY_CHAR_CLASS = "[\\x00\x01-\t\x0b-\ud7ff\ue000-\U0010ffff]"

# `format`s whose xgrammar grammar is looser than what validators check, as equivalent-or-narrower
# patterns: dates with the right days per month (Feb 29 left out), IPv4 octets without leading
# zeros (Python's ipaddress rejects them), a bounded fraction of a second.
_DATE = (r"[0-9]{4}-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)"
         r"|02-(0[1-9]|1[0-9]|2[0-8]))")
_TIME = r"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]{1,6}|)(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
FORMAT_PATTERNS = {
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}$",
    "date-time": f"^{_DATE}T{_TIME}$",
    "ipv4": rf"^{_OCTET}(\.{_OCTET}){{3}}$",
}


class UnsupportedSchema(ValueError):
    """The schema uses something xgrammar would not enforce; the message names it and where."""


def prepare_json_schema(schema: Any) -> Any:
    """A copy of ``schema`` with length-limited strings rewritten; raises UnsupportedSchema."""
    if not isinstance(schema, (dict, bool)):
        raise UnsupportedSchema(f"a JSON schema must be an object or a boolean, got {type(schema).__name__}")
    schema = copy.deepcopy(schema)
    _visit(schema, "#")
    return schema


def _visit(node: Any, where: str) -> None:
    if not isinstance(node, dict):
        return
    for keyword, reason in UNENFORCED.items():
        if keyword in node:
            raise UnsupportedSchema(f"{reason} by the grammar engine (at {where}/{keyword})")
    if node.get("uniqueItems") is True:
        raise UnsupportedSchema(
            f"'uniqueItems' is not enforced by the grammar engine (at {where}/uniqueItems)"
        )
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        raise UnsupportedSchema(f"'allOf' with more than one schema is not supported (at {where}/allOf)")
    _rewrite_string_length(node, where)
    _rewrite_format(node)
    _rewrite_patterns(node)

    for keyword in _SCHEMA:
        _visit(node.get(keyword), f"{where}/{keyword}")
    for keyword in _SCHEMA_MAP:
        children = node.get(keyword)
        if isinstance(children, dict):
            for name, child in children.items():
                _visit(child, f"{where}/{keyword}/{name}")
    for keyword in _SCHEMA_LIST:
        children = node.get(keyword)
        if isinstance(children, list):
            for i, child in enumerate(children):
                _visit(child, f"{where}/{keyword}/{i}")


def _rewrite_patterns(node: dict) -> None:
    if isinstance(node.get("pattern"), str):
        node["pattern"] = safe_regex(node["pattern"], SAFE_CHAR_CLASS)
    properties = node.get("patternProperties")
    if isinstance(properties, dict):
        node["patternProperties"] = {safe_regex(k, SAFE_CHAR_CLASS): v for k, v in properties.items()}


def safe_regex(pattern: str, dot: str) -> str:
    """Rewrite a regex into one xgrammar 0.2.9 compiles right, with the same or a narrower language:

    - ``(...)?`` -> ``(...){0,1}``: an optional group holding a quantifier inside a JSON-schema
      ``pattern`` is mis-compiled (``^x(a[0-9]{1,6})?Z$`` accepts "x1Z"); the counted form is not.
    - ``.`` -> ``dot``, a class of literal characters: xgrammar's ``.`` also admits overlong UTF-8
      and encoded surrogates, which decode to U+FFFD (and then break the pattern's own counts).
    """
    out, i, in_class = [], 0, False
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
        elif char == ")" and pattern[i + 1:i + 2] == "?":
            out.append("){0,1}")
            i += 2
            continue
        elif char == ".":
            char = dot
        out.append(char)
        i += 1
    return "".join(out)


def _rewrite_format(node: dict) -> None:
    pattern = FORMAT_PATTERNS.get(node.get("format"))  # type: ignore[arg-type]
    if pattern is not None and "pattern" not in node:
        del node["format"]
        node["pattern"] = pattern


def _rewrite_string_length(node: dict, where: str) -> None:
    if "minLength" not in node and "maxLength" not in node:
        return
    for other in ("pattern", "format"):
        if other in node:
            raise UnsupportedSchema(
                f"a string with both '{other}' and minLength/maxLength is not supported "
                f"(the grammar engine would drop the length limits) (at {where})"
            )
    low, high = node.pop("minLength", 0), node.pop("maxLength", None)
    for name, value in (("minLength", low), ("maxLength", high)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise UnsupportedSchema(f"'{name}' must be a non-negative integer, got {value!r} (at {where})")
    if high is not None and high < low:
        raise UnsupportedSchema(f"'maxLength' {high} is below 'minLength' {low} (at {where})")
    repeat = f"{{{low},}}" if high is None else f"{{{low},{high}}}"
    node["pattern"] = f"^{SAFE_CHAR_CLASS}{repeat}$"
