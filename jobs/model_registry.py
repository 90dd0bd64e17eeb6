"""The models a deployment serves: name → checkpoint location, and the queue each one's shards use.

The API checks a job's model here (no torch needed); a worker loads `location(name)` and consumes
`queue_for(name)`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from bulkinfer.jobs.errors import LookupFailed
from bulkinfer.jobs.lora_adapters import AdapterRegistry, UnknownAdapter, is_adapter_location
from bulkinfer.jobs.names import model_queue

MODELS_ENV = "BULKINFER_MODELS"
ALIASES_ENV = "BULKINFER_MODEL_ALIASES"


class UnknownModel(LookupFailed):
    """A model name that is neither served nor an alias. With `aliases` (a name a caller sent: a job's,
    a batch line's or request's model) the message lists them and says how to add one (for `target`,
    else the first served model)."""

    def __init__(self, name: str, served: list[str], aliases: Mapping[str, str] | None = None,
                 target: str | None = None) -> None:
        listed = f"served: {', '.join(served)}" if served else "served: none: set BULKINFER_MODELS"
        aliases = aliases if served else None
        if aliases is not None:
            listed += "; aliases: " + (", ".join(f"{alias} → {model}" for alias, model in
                                                 sorted(aliases.items())) or "none")
        message = f"model {name!r} is not served here ({listed})"
        if aliases is not None:  # the setting that would make it one, keeping the aliases there are
            example = json.dumps({**aliases, name: target or served[0]})
            message += (f"; to send {name!r} to a served model, add an alias: {ALIASES_ENV}='{example}' "
                        "(the model_aliases setting)")
        super().__init__(message)
        self.name = name
        self.served = served


class ModelNotRun(UnknownAdapter):
    """A request's `model` (an Anthropic request's `params.model`) that is not the model its job runs,
    an alias of it, or one of its LoRA adapters: the message is about the model it names."""

    def __init__(self, message: str, name: str, model: str, registered: list[str]) -> None:
        LookupFailed.__init__(self, message)
        self.name = name
        self.model = model
        self.registered = registered


class AmbiguousAdapter(UnknownModel):
    """A batch line's model names an adapter registered on several served models: which one runs it?"""

    def __init__(self, name: str, served: list[str]) -> None:
        LookupFailed.__init__(self, f"{name!r} is a LoRA adapter registered on every served model "
                                    f"({', '.join(served)}): a batch line cannot name it alone; register "
                                    "it on one model (lora_adapters: {name: {location, model}})")
        self.name = name
        self.served = served


class ModelRegistry:
    def __init__(self, models: Mapping[str, str] | None = None,
                 aliases: Mapping[str, str] | None = None, adapters: AdapterRegistry | None = None) -> None:
        self._models = dict(models or {})
        self._aliases = dict(aliases or {})
        self.adapters = adapters or AdapterRegistry()
        for alias, name in self._aliases.items():
            if not isinstance(name, str) or name not in self._models:
                raise ValueError(f"model alias {alias!r} names {name!r}, which is not a served model "
                                 f"(served: {', '.join(sorted(self._models)) or 'none'})")
        for name, location in self._models.items():
            if not isinstance(name, str) or not name.strip() or any(ch.isspace() for ch in name):
                raise ValueError(f"model name {name!r} must be non-empty text without spaces")
            if not isinstance(location, str) or not location:
                raise ValueError(f"model {name!r}: its location must be a directory or s3:// URI")
        self.adapters.check_models(self._models, self._aliases)

    @classmethod
    def parse(cls, value: str | None, aliases: str | None = None,
              adapters: str | None = None) -> ModelRegistry:
        """From JSON text `{"name": "dir or s3://…"}` or the path of a file holding it; None → empty.
        `aliases`: JSON text `{"alias": "served name"}`; `adapters`: the `lora_adapters` setting
        (jobs/lora_adapters.py)."""
        alias_map = (_json_object(aliases, "BULKINFER_MODEL_ALIASES", "alias → served model name")
                     if aliases and aliases.strip() else {})
        adapter_registry = AdapterRegistry.parse(adapters)
        if not value or not value.strip():
            return cls(aliases=alias_map, adapters=adapter_registry)
        text = value
        source = "BULKINFER_MODELS"
        if not value.lstrip().startswith(("{", "[")):
            path = Path(value).expanduser()
            try:
                text = path.read_text()
            except OSError as error:
                raise ValueError(f"{MODELS_ENV}: cannot read {path}: {error.strerror}") from None
            source = str(path)
        return cls(_json_object(text, source, "model name → location"), alias_map, adapter_registry)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ModelRegistry:
        return cls.parse((os.environ if environ is None else environ).get(MODELS_ENV))

    def names(self) -> list[str]:
        return sorted(self._models)

    def __contains__(self, name: object) -> bool:
        return name in self._models

    def location(self, name: str) -> str:
        """Where the checkpoint is; raises `UnknownModel` naming the served models."""
        try:
            return self._models[name]
        except KeyError:
            raise UnknownModel(name, self.names()) from None

    def aliases(self) -> dict[str, str]:
        """alias → the served model it names."""
        return dict(self._aliases)

    def resolve(self, name: str) -> str:
        """The served model a name means (itself, or what it is an alias of); `UnknownModel` naming
        the served models and the aliases otherwise."""
        served = self._aliases.get(name, name)
        if served not in self._models:
            raise UnknownModel(name, self.names(), self._aliases)
        return served

    def queue_for(self, name: str) -> str:
        self.location(name)
        return model_queue(name)

    def adapters_of(self, name: str) -> list[str]:
        """The LoRA adapters registered on served model `name`, sorted."""
        return self.adapters.for_model(name)

    def resolve_requested(self, name: str) -> tuple[str, str | None]:
        """What a batch line's `model` asks for: (served model, None) for a model or alias, (its base,
        adapter) for a registered adapter (as vLLM's server reads it); `UnknownModel` otherwise."""
        base = self.adapters.base_of(name, self.names())
        if base is not None:
            return base, name
        if name in self.adapters.names() and name not in self._models and name not in self._aliases:
            raise AmbiguousAdapter(name, self.names())
        return self.resolve(name), None

    def adapter_parent(self, name: str) -> str | None:
        """The one served model adapter `name` runs on (None: it is on several)."""
        return self.adapters.base_of(name, self.names())

    def row_adapter(self, model: str, requested: str | None, required: bool = True,
                    names_model: bool = False) -> str | None:
        """The adapter a row runs on (`Row.lora`, `Row.lora_required`, `Row.lora_names_model`) on
        `model`: a registered name, or the job's own location as it is; None: the base (named by
        itself or an alias, or an unknown name that is not `required`). `UnknownAdapter` naming the
        registered ones otherwise; `ModelNotRun`, about the model, for a request's model name
        (`names_model`) that is no adapter at all."""
        if requested is None or requested == model or self._aliases.get(requested) == model:
            return None
        if is_adapter_location(requested):
            return requested
        try:
            return self.adapters.get(model, requested).name
        except UnknownAdapter as unknown:
            if not required:
                return None
            if names_model and requested not in self.adapters.names():
                message = self._not_run(requested, model)
                raise ModelNotRun(message, requested, model, unknown.registered) from None
            raise

    def _not_run(self, name: str, model: str) -> str:
        served = self._aliases.get(name, name)
        if served in self._models:
            what = f"model {name!r}" if served == name else f"model {name!r} (an alias of {served!r})"
            return (f"{what} is served here, but this batch runs {model!r}: a batch runs one model (and "
                    f"its LoRA adapters); send the requests for {name!r} in a batch of their own")
        return str(UnknownModel(name, self.names(), self._aliases, target=model))



def _json_object(text: str, source: str, what: str) -> dict[str, str]:
    """`text` as a JSON object; ValueError naming `source` otherwise."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{source}: not JSON ({error.msg} at line {error.lineno})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a JSON object of {what}")
    return data
