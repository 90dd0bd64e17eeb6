"""LoRA adapters registered on served base models: name → location, and which base each one fits.

The `lora_adapters` setting (docs/configuration.md) registers them, as JSON
`{"name": "s3://… or folder"}` (or `{"name": {"location": …, "model": "base"}}` to pin one to a base
model), or as `name=location,name2=location2` (what `--lora NAME=LOCATION` flags build). An adapter
without a `model` is registered on every served model: a deployment usually serves one base.

The API checks a job's `lora` here (no torch needed); a worker resolves a row's adapter name to
its location here before fetching it (worker/lora_files.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from bulkinfer.jobs.errors import LookupFailed

LOCATION_PREFIXES = ("s3://", "file://", "/")
ADAPTER_CONFIG = "adapter_config.json"  # what every PEFT adapter folder holds


def is_adapter_location(value: str) -> bool:
    """Whether a job's `lora` is a location (`s3://…`, `file://…`, an absolute folder), not a name."""
    return value.startswith(LOCATION_PREFIXES)


class UnknownAdapter(LookupFailed):
    def __init__(self, name: str, model: str, registered: list[str]) -> None:
        shown = ", ".join(registered) if registered else "none: set lora_adapters or --lora NAME=LOCATION"
        super().__init__(f"{name!r} is neither model {model!r} nor a LoRA adapter registered on it "
                         f"(registered: {shown})")
        self.name = name
        self.model = model
        self.registered = registered


@dataclass(frozen=True)
class Adapter:
    name: str
    location: str
    model: str | None = None  # the base model it is registered on; None: every served model


class AdapterRegistry:
    """The registered adapters; `for_model` lists those a base model serves."""

    def __init__(self, adapters: Iterable[Adapter] = ()) -> None:
        self._adapters: dict[str, Adapter] = {}
        for adapter in adapters:
            if not adapter.name or any(ch.isspace() for ch in adapter.name) or "," in adapter.name:
                raise ValueError(f"LoRA adapter name {adapter.name!r} must be non-empty text without spaces "
                                 "or commas")
            if is_adapter_location(adapter.name):
                raise ValueError(f"LoRA adapter name {adapter.name!r} looks like a location; name it")
            if not adapter.location:
                raise ValueError(f"LoRA adapter {adapter.name!r}: its location must be a folder or s3:// URI")
            self._adapters[adapter.name] = adapter

    @classmethod
    def parse(cls, value: str | None) -> AdapterRegistry:
        """From the setting's text: a JSON object, or `name=location,…`; None or blank: none."""
        if not value or not value.strip():
            return cls()
        text = value.strip()
        if text.startswith("{"):
            return cls(_from_json(text))
        adapters = []
        for item in text.split(","):
            name, equals, location = item.strip().partition("=")
            if not equals:
                raise ValueError(f"lora_adapters: {item.strip()!r} is not NAME=LOCATION")
            adapters.append(Adapter(name.strip(), location.strip()))
        return cls(adapters)

    def __bool__(self) -> bool:
        return bool(self._adapters)

    def names(self) -> list[str]:
        return sorted(self._adapters)

    def all(self) -> list[Adapter]:
        return [self._adapters[name] for name in sorted(self._adapters)]

    def for_model(self, model: str) -> list[str]:
        """The names of the adapters `model` serves, sorted."""
        return [adapter.name for adapter in self.all() if adapter.model in (None, model)]

    def get(self, model: str, name: str) -> Adapter:
        """The adapter `name` on `model`; `UnknownAdapter` naming the registered ones otherwise."""
        adapter = self._adapters.get(name)
        if adapter is None or adapter.model not in (None, model):
            raise UnknownAdapter(name, model, self.for_model(model))
        return adapter

    def base_of(self, name: str, served: Iterable[str]) -> str | None:
        """The one served model an adapter name runs on (an OpenAI line's `model` naming an adapter),
        or None when `name` is not an adapter or fits several served models."""
        adapter = self._adapters.get(name)
        if adapter is None:
            return None
        if adapter.model is not None:
            return adapter.model
        served = list(served)
        return served[0] if len(served) == 1 else None

    def check_models(self, served: Mapping[str, str], aliases: Iterable[str]) -> None:
        """ValueError for an adapter pinned to a model not served, or named like a model or alias
        (an OpenAI line's `model` could not tell them apart)."""
        clashes = set(served) | set(aliases)
        for adapter in self._adapters.values():
            if adapter.name in clashes:
                raise ValueError(f"LoRA adapter {adapter.name!r} has the name of a served model or alias")
            if adapter.model is not None and adapter.model not in served:
                raise ValueError(f"LoRA adapter {adapter.name!r} is registered on model {adapter.model!r}, "
                                 f"which is not served (served: {', '.join(sorted(served)) or 'none'})")


def _from_json(text: str) -> list[Adapter]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"lora_adapters: not JSON ({error.msg})") from None
    if not isinstance(data, dict):
        raise ValueError("lora_adapters: expected a JSON object of adapter name → location")
    adapters = []
    for name, entry in data.items():
        if isinstance(entry, str):
            adapters.append(Adapter(name, entry))
        elif isinstance(entry, dict) and isinstance(entry.get("location"), str) \
                and isinstance(entry.get("model", ""), str) and set(entry) <= {"location", "model"}:
            adapters.append(Adapter(name, entry["location"], entry.get("model") or None))
        else:
            raise ValueError(f"lora_adapters: {name!r} must be a location, or {{\"location\": ..., "
                             "\"model\": ...}}")
    return adapters


def lora_flags_text(flags: Iterable[str] | None) -> str | None:
    """`--lora NAME=LOCATION` flags (repeatable) as the setting's JSON text; None when none given."""
    adapters: dict[str, str] = {}
    for item in (flag.strip() for flag in flags or ()):
        name, equals, location = item.partition("=")
        if not equals or not name.strip() or not location.strip():
            raise ValueError(f"--lora {item!r}: expected NAME=LOCATION (a folder or s3:// URI)")
        adapters[name.strip()] = location.strip()
    return json.dumps(adapters) if adapters else None
