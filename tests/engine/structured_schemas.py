"""A corpus of JSON schemas for structured-output tests: every output must parse with strict
``json.loads`` and validate. Sizes are bounded (maxLength, maxItems, ranges, enums) so that a
random-weight model, which wanders, still finishes every output within the tests' max_tokens."""

from __future__ import annotations

from typing import Any

SHORT = {"type": "string", "minLength": 1, "maxLength": 8}

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat_person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "active": {"type": "boolean"},
        },
        "required": ["name", "age", "active"],
        "additionalProperties": False,
    },
    "nested_address": {
        "type": "object",
        "properties": {
            "owner": SHORT,
            "address": {
                "type": "object",
                "properties": {
                    "street": {"type": "string", "maxLength": 16},
                    "city": {"enum": ["Paris", "Zürich", "São Paulo", "東京"]},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["street", "city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["owner", "address"],
    },
    "int_array_bounded": {
        "type": "array",
        "items": {"type": "integer", "minimum": -100, "maximum": 100},
        "minItems": 1,
        "maxItems": 4,
    },
    "array_of_objects": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"sku": SHORT, "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
                "minItems": 0,
                "maxItems": 3,
            }
        },
        "required": ["items"],
    },
    "tricky_enum": {
        "type": "object",
        "properties": {
            "label": {"enum": ['say "hi"', "back\\slash", "tab\there", "new\nline", "ünïcødé", ""]}
        },
        "required": ["label"],
    },
    "const_value": {
        "type": "object",
        "properties": {"version": {"const": "v1"}, "data": {"const": {"a": [1, 2.5, None, True]}}},
        "required": ["version", "data"],
    },
    "number_range": {
        "type": "object",
        "properties": {
            "x": {"type": "number", "minimum": -1.5, "maximum": 2.25},
            "p": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["x", "p"],
    },
    "exclusive_integers": {
        "type": "object",
        "properties": {
            "small": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
            "neg": {"type": "integer", "minimum": -50, "exclusiveMaximum": 0},
            "third": {"type": "integer", "minimum": 0, "maximum": 300, "multipleOf": 3},
        },
        "required": ["small", "neg", "third"],
    },
    "optional_fields": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 1000},
            "nickname": SHORT,
            "score": {"type": "number", "minimum": 0, "maximum": 10},
            "tags": {"type": "array", "items": SHORT, "maxItems": 2},
        },
        "required": ["id"],
        "additionalProperties": False,
    },
    "nullable_fields": {
        "type": "object",
        "properties": {
            "middle_name": {"type": ["string", "null"], "maxLength": 6},
            "parent": {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": 0, "maximum": 9}]},
            "nothing": {"type": "null"},
        },
        "required": ["middle_name", "parent", "nothing"],
    },
    "defs_and_refs": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -9, "maximum": 9},
                    "y": {"type": "integer", "minimum": -9, "maximum": 9},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
    },
    "any_of_shapes": {
        "type": "object",
        "properties": {
            "shape": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {
                            "kind": {"const": "circle"},
                            "r": {"type": "integer", "minimum": 1, "maximum": 9},
                        },
                        "required": ["kind", "r"],
                        "additionalProperties": False,
                    },
                    {
                        "type": "object",
                        "properties": {
                            "kind": {"const": "rect"},
                            "w": {"type": "integer", "minimum": 1, "maximum": 9},
                            "h": {"type": "integer", "minimum": 1, "maximum": 9},
                        },
                        "required": ["kind", "w", "h"],
                        "additionalProperties": False,
                    },
                ]
            }
        },
        "required": ["shape"],
    },
    "one_of_primitives": {
        "type": "array",
        "items": {"oneOf": [{"type": "boolean"}, {"type": "string", "maxLength": 4}, {"type": "null"}]},
        "minItems": 2,
        "maxItems": 4,
    },
    "booleans": {
        "type": "object",
        "properties": {
            "flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 3, "maxItems": 3}
        },
        "required": ["flags"],
    },
    "closed_nested": {
        "type": "object",
        "properties": {
            "meta": {
                "type": "object",
                "properties": {"created": {"type": "string", "format": "date"}, "author": SHORT},
                "required": ["created", "author"],
                "additionalProperties": False,
            },
            "empty": {"type": "object", "properties": {}, "additionalProperties": False},
        },
        "required": ["meta", "empty"],
        "additionalProperties": False,
    },
    "string_formats": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "format": "uuid"},
            "when": {"type": "string", "format": "date-time"},
            "ip": {"type": "string", "format": "ipv4"},
            "day": {"type": "string", "format": "date"},
        },
        "required": ["id", "when", "ip", "day"],
    },
    "matrix": {
        "type": "array",
        "items": {
            "type": "array",
            "items": {"type": "number", "minimum": -1, "maximum": 1},
            "minItems": 2,
            "maxItems": 2,
        },
        "minItems": 1,
        "maxItems": 2,
    },
    "linked_list": {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "value": {"type": "integer", "minimum": 0, "maximum": 9},
                    "next": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/node"}]},
                },
                "required": ["value", "next"],
                "additionalProperties": False,
            }
        },
        "$ref": "#/$defs/node",
    },
    "exact_length_strings": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "minLength": 4, "maxLength": 4},
            "long_enough": {"type": "string", "minLength": 3, "maxLength": 10},
            "maybe_empty": {"type": "string", "maxLength": 2},
        },
        "required": ["code", "long_enough", "maybe_empty"],
    },
    "tuple_prefix_items": {
        "type": "array",
        "prefixItems": [
            {"type": "integer", "minimum": 0, "maximum": 5},
            {"type": "string", "maxLength": 5},
            {"type": "boolean"},
        ],
        "items": False,
        "minItems": 3,
    },
    "pattern_strings": {
        "type": "object",
        "properties": {
            "plate": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
            "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"},
            "any": {"type": "string", "pattern": "^.{1,6}$"},
            "version": {"type": "string", "pattern": "^v[0-9]{1,2}(\\.[0-9]{1,2})?(-rc[0-9])?$"},
        },
        "required": ["plate", "hex", "any", "version"],
    },
    "mixed_enum": {
        "type": "object",
        "properties": {"v": {"enum": [1, "one", None, True, [1, 2], {"k": "v"}]}},
        "required": ["v"],
    },
    "unicode_keys": {
        "type": "object",
        "properties": {"prénom": SHORT, "名前": SHORT, "key with \"quote\"": {"type": "boolean"}},
        "required": ["prénom", "名前", "key with \"quote\""],
        "additionalProperties": False,
    },
    "annotations": {
        "title": "Annotated",
        "description": "annotations must not change the grammar",
        "type": "object",
        "properties": {
            "level": {
                "type": "integer",
                "minimum": 1,
                "maximum": 5,
                "description": "1-5",
                "default": 3,
                "examples": [1, 2],
            }
        },
        "required": ["level"],
    },
}


def sample_with_random_logits(manager: Any, request_ids: list[str], vocab_size: int, *, seed: int = 0,
                              max_steps: int = 400, scale: float = 2.0) -> dict[str, list[int] | None]:
    """Drive ``manager`` the way the engine does, with random logits sampled at temperature 1.0:
    returns each request's tokens (the final stop token excluded), or None if it did not finish."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    tokens: dict[str, list[int]] = {r: [] for r in request_ids}
    live = list(request_ids)
    for _ in range(max_steps):
        if not live:
            break
        bitmask = manager.fill_bitmask(live)
        logits = torch.randn(len(live), vocab_size, generator=generator) * scale
        manager.apply_bitmask(logits, bitmask)
        sampled = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)[:, 0].tolist()
        still = []
        for request_id, token_id in zip(live, sampled, strict=True):
            assert manager.accept_token(request_id, token_id), f"{request_id}: token {token_id} rejected"
            if not manager.is_terminated(request_id):
                tokens[request_id].append(token_id)
                still.append(request_id)
        live = still
    return {r: (None if r in live else tokens[r]) for r in request_ids}
