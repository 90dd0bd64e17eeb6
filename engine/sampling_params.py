"""Per-request sampling parameters (vLLM's names and semantics; see docs/sampling.md)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bulkinfer.engine.errors import ErrorKind, SamplingParamsError

if TYPE_CHECKING:
    from bulkinfer.engine.structured_output import StructuredSpec

# Temperatures below this are greedy: dividing logits by ~0 overflows (vLLM uses the same epsilon).
GREEDY_EPSILON = 1e-5
MAX_LOGPROBS = 20
STRUCTURED_FIELDS = ("json_schema", "regex", "choice", "grammar", "structural_tag")


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    `temperature=0` is greedy. `top_k` of -1 or 0 disables top-k; `top_p=1.0` disables top-p;
    `min_p=0` disables min-p. `seed` makes a request's tokens reproducible whatever else runs in
    the batch. `stop` strings end the text (cut before the match unless
    `include_stop_str_in_output`); `stop_token_ids` and EOS end it on a token. At most one of
    `json_schema` / `regex` / `choice` / `grammar` / `structural_tag` constrains the output
    (`structural_tag`: xgrammar's structural-tag format, e.g. free text until a tool call's trigger,
    then the call's JSON arguments; what tool calls and thinking models are constrained with).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    # Per prompt token after the first: its logprob and the top-k alternatives (0: its own only).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    json_schema: dict[str, Any] | bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        if isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids)

    # ---- derived -------------------------------------------------------------------------------

    @property
    def has_penalties(self) -> bool:
        """Presence, frequency or repetition penalty: sampling reads every token generated so far."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def structured(self) -> StructuredSpec | None:
        """The output constraint as the structured-output manager's spec (its cache key), or None."""
        if all(getattr(self, name) is None for name in STRUCTURED_FIELDS) or self.json_schema is False:
            return None
        from bulkinfer.engine.structured_output import StructuredSpec  # lazy: xgrammar only when used

        if self.json_schema is not None:
            return StructuredSpec.json_schema(self.json_schema)  # canonical text; True -> ""
        if self.regex is not None:
            return StructuredSpec.regex(self.regex)
        if self.choice is not None:
            return StructuredSpec.choice(list(self.choice))
        if self.structural_tag is not None:
            return StructuredSpec.structural_tag(self.structural_tag)
        return StructuredSpec.grammar(self.grammar)  # type: ignore[arg-type]

    # ---- validation ----------------------------------------------------------------------------

    def validate(self) -> None:
        """Raise `SamplingParamsError` (a ValueError) with a message naming the field, the rule and
        the value, and its kind: `STRUCTURED_OUTPUT` for the constraint fields, else `INVALID_SAMPLING`."""
        _check_int(self.n, "n", "must be an integer >= 1", minimum=1)
        if not _is_number(self.temperature) or not self.temperature >= 0.0 or math.isinf(self.temperature):
            raise _invalid(f"temperature must be >= 0 and finite, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise _invalid(f"top_p must be in (0, 1], got {self.top_p!r}")
        _check_int(self.top_k, "top_k", "must be -1 or 0 (off) or >= 1", minimum=-1)
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise _invalid(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise _invalid(f"seed must be an integer or None, got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise _invalid(f"{name} must be in [-2, 2], got {value!r}")
        rp = self.repetition_penalty
        if not _is_number(rp) or not rp > 0.0 or math.isinf(rp):
            raise _invalid(f"repetition_penalty must be a finite number > 0, got {rp!r}")
        # 0: score the prompt only (prompt_logprobs), generate nothing.
        _check_int(self.max_tokens, "max_tokens", "must be >= 0", minimum=0)
        _check_int(self.min_tokens, "min_tokens", "must be >= 0", minimum=0)
        if self.min_tokens > self.max_tokens:
            raise _invalid(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens!r}"
            )
        self._validate_stops()
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise _invalid(f"{name} must be in [0, {MAX_LOGPROBS}] or None, got {value!r}")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise _invalid(f"{name} must be a bool, got {getattr(self, name)!r}")
        self._validate_structured()

    def _validate_stops(self) -> None:
        if not isinstance(self.stop, list):
            raise _invalid(f"stop must be a string or a list of strings, got {self.stop!r}")
        for stop in self.stop:
            if not isinstance(stop, str) or not stop:
                raise _invalid(f"stop must hold non-empty strings, got {stop!r}")
        if not isinstance(self.stop_token_ids, list):
            raise _invalid(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        for token_id in self.stop_token_ids:
            if not _is_int(token_id) or token_id < 0:
                raise _invalid(f"stop_token_ids must hold token ids >= 0, got {token_id!r}")

    def _validate_structured(self) -> None:
        given = [
            name
            for name in STRUCTURED_FIELDS
            if getattr(self, name) is not None and getattr(self, name) is not False
        ]
        if len(given) > 1:
            fields = ", ".join(STRUCTURED_FIELDS)
            raise _invalid_structured(f"at most one of {fields} may be set, got {given}")
        schema = self.json_schema
        if schema is not None and schema is not True and not isinstance(schema, dict):
            raise _invalid_structured(
                f"json_schema must be a dict (a JSON schema), True or None, got {schema!r}")
        if isinstance(schema, dict):
            try:
                json.dumps(schema)
            except (TypeError, ValueError) as exc:
                raise _invalid_structured(
                    f"json_schema must be JSON-serializable, got {schema!r}: {exc}") from None
        tag = self.structural_tag
        if tag is not None and (not isinstance(tag, dict) or tag.get("type") != "structural_tag"):
            raise _invalid_structured(
                f"structural_tag must be a dict of type 'structural_tag', got {tag!r}"[:300])
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise _invalid_structured(f"{name} must be a non-empty string or None, got {value!r}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise _invalid_structured(f"choice must be a non-empty list of strings, got {self.choice!r}")
            for option in self.choice:
                if not isinstance(option, str) or not option:
                    raise _invalid_structured(f"choice must hold non-empty strings, got {option!r}")


def _invalid(message: str) -> SamplingParamsError:
    return SamplingParamsError(ErrorKind.INVALID_SAMPLING, message)


def _invalid_structured(message: str) -> SamplingParamsError:
    return SamplingParamsError(ErrorKind.STRUCTURED_OUTPUT, message)


def _check_int(value: object, name: str, rule: str, minimum: int) -> None:
    if not _is_int(value) or value < minimum:  # type: ignore[operator]
        raise _invalid(f"{name} {rule}, got {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
