"""The JSON types of the ``adapter_config.json`` fields that decide what the engine computes.

Python's truthiness would read ``"use_rslora": "false"`` as true and scale every update wrong
without a word, so each field the engine reads or refuses on must have the type PEFT's
``LoraConfig`` declares for it; anything else is refused naming the field and the value. ``null``
means the field's default, as in PEFT. Fields that change nothing the engine computes (dropout,
task_type, init_lora_weights, ...) are not read, so not checked.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from bulkinfer.engine.errors import LoRAAdapterError


def _is_bool(value: object) -> bool:
    return isinstance(value, bool)


def _is_string(value: object) -> bool:
    return isinstance(value, str)


def _is_list_of_strings(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def _is_string_or_list_of_strings(value: object) -> bool:
    return isinstance(value, str) or _is_list_of_strings(value)


def _is_list(value: object) -> bool:
    return isinstance(value, list)


def _is_object(value: object) -> bool:
    return isinstance(value, dict)


# field -> (check, what the message says it must be); r and lora_alpha have their own rules.
FIELD_TYPES: dict[str, tuple[Callable[[object], bool], str]] = {
    "use_rslora": (_is_bool, "true or false"),
    "use_dora": (_is_bool, "true or false"),
    "lora_bias": (_is_bool, "true or false"),
    "peft_type": (_is_string, "a string"),
    "bias": (_is_string, "a string"),
    "base_model_name_or_path": (_is_string, "a string"),
    "target_modules": (_is_string_or_list_of_strings, "a list of names or a string"),
    "modules_to_save": (_is_list_of_strings, "a list of names"),
    "layer_replication": (_is_list, "a list"),
    "rank_pattern": (_is_object, "an object"),
    "alpha_pattern": (_is_object, "an object"),
}


def check_field_types(raw: dict[str, Any], where: str) -> None:
    """Raise LoRAAdapterError naming the first field whose JSON value has the wrong type."""
    for field, (check, expected) in FIELD_TYPES.items():
        value = raw.get(field)
        if value is not None and not check(value):
            raise LoRAAdapterError(f"{where}: {field} must be {expected}, got {shown(value)}")


def shown(value: object) -> str:
    """The value with its JSON type, so `"false"` reads as the string it is."""
    if value is None:
        return "null"
    kind = ("boolean" if isinstance(value, bool) else "number" if isinstance(value, (int, float))
            else "string" if isinstance(value, str) else "list" if isinstance(value, list)
            else "object" if isinstance(value, dict) else type(value).__name__)
    text = json.dumps(value, default=repr)
    return f"the {kind} " + (text if len(text) <= 80 else text[:77] + "...")
