"""Speculative decoding settings, with vLLM's key names (``speculative_config={...}``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How to propose draft tokens; verification and outputs are the same for every method.

    - ``method="ngram"``: prompt lookup. The draft is the ``num_speculative_tokens`` tokens that
      followed the most recent earlier occurrence of the sequence's last n tokens (prompt or
      output), for the longest n in [``prompt_lookup_min``, ``prompt_lookup_max``] that occurs.
    - ``method="draft_model"``: ``model`` (a checkpoint directory) is a smaller model with the
      target's vocabulary; it decodes the drafts greedily with its own paged KV cache.

    ``disable_by_batch_size``: speculate only while at most this many requests run. None (the
    default) decides from the step times this engine measured on this machine (engine/speculative/
    gate.py): speculation runs while verifying drafts costs less than the tokens it gains.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    model: str | None = None
    disable_by_batch_size: int | None = None

    @classmethod
    def from_value(cls, value: SpeculativeConfig | Mapping[str, Any] | None) -> SpeculativeConfig | None:
        """A config from the dict users pass (unknown keys refused by name), validated."""
        if value is None or isinstance(value, SpeculativeConfig):
            config = value
        elif isinstance(value, Mapping):
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise ValueError(f"speculative_config: unknown key {unknown[0]!r} "
                                 f"(known: {', '.join(sorted(known))})")
            config = cls(**dict(value))
        else:
            raise ValueError(f"speculative_config must be a dict or None, got {type(value).__name__}")
        if config is not None:
            config.validate()
        return config

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, got {self.method!r}")
        _positive_int(self.num_speculative_tokens, "num_speculative_tokens")
        _positive_int(self.prompt_lookup_min, "prompt_lookup_min")
        _positive_int(self.prompt_lookup_max, "prompt_lookup_max")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) exceeds "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model):
            raise ValueError(
                "speculative_config.model (the draft checkpoint) is required for method 'draft_model'"
            )
        if self.disable_by_batch_size is not None:
            _positive_int(self.disable_by_batch_size, "disable_by_batch_size")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _positive_int(value: object, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"speculative_config.{name} must be an integer >= 1, got {value!r}")
