"""SamplingParams: defaults, normalization, validation messages (field, rule, value), structured spec."""

from __future__ import annotations

import json

import pytest

from bulkinfer.engine import SamplingParams


def test_defaults_are_valid_and_match_vllm():
    params = SamplingParams()
    params.validate()
    assert (params.n, params.temperature, params.top_p, params.top_k, params.min_p) == (1, 1.0, 1.0, -1, 0.0)
    assert (
        params.max_tokens == 16 and params.min_tokens == 0 and params.stop == [] and params.logprobs is None
    )
    assert params.skip_special_tokens and not params.ignore_eos and params.structured is None


def test_a_single_stop_string_becomes_a_list():
    assert SamplingParams(stop="\n").stop == ["\n"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"n": 0}, "n must be an integer >= 1, got 0"),
        ({"n": 2.0}, "n must be an integer >= 1, got 2.0"),
        ({"temperature": -0.5}, "temperature must be >= 0 and finite, got -0.5"),
        ({"temperature": float("nan")}, "temperature must be >= 0 and finite, got nan"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"top_k": -2}, "top_k must be -1 or 0 (off) or >= 1, got -2"),
        ({"min_p": 1.5}, "min_p must be in [0, 1], got 1.5"),
        ({"seed": "7"}, "seed must be an integer or None, got '7'"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5"),
        ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2], got -3"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be a finite number > 0, got 0.0"),
        ({"max_tokens": -1}, "max_tokens must be >= 0, got -1"),
        ({"min_tokens": -1}, "min_tokens must be >= 0, got -1"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens must be <= max_tokens (10), got 20"),
        ({"stop": [""]}, "stop must hold non-empty strings, got ''"),
        ({"stop": [3]}, "stop must hold non-empty strings, got 3"),
        ({"stop_token_ids": [-1]}, "stop_token_ids must hold token ids >= 0, got -1"),
        ({"logprobs": 21}, "logprobs must be in [0, 20] or None, got 21"),
        ({"logprobs": -1}, "logprobs must be in [0, 20] or None, got -1"),
        ({"prompt_logprobs": 21}, "prompt_logprobs must be in [0, 20] or None, got 21"),
        ({"prompt_logprobs": True}, "prompt_logprobs must be in [0, 20] or None, got True"),
        ({"ignore_eos": 1}, "ignore_eos must be a bool, got 1"),
        ({"json_schema": "{}"}, "json_schema must be a dict (a JSON schema), True or None, got '{}'"),
        ({"regex": ""}, "regex must be a non-empty string or None, got ''"),
        ({"choice": []}, "choice must be a non-empty list of strings, got []"),
        ({"choice": ["a", 1]}, "choice must hold non-empty strings, got 1"),
        ({"grammar": 5}, "grammar must be a non-empty string or None, got 5"),
        (
            {"regex": "a+", "choice": ["a"]},
            "at most one of json_schema, regex, choice, grammar, structural_tag may be set, got "
            "['regex', 'choice']",
        ),
    ],
)
def test_validation_names_field_rule_and_value(kwargs, expected):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs).validate()
    assert str(info.value) == expected


def test_structured_spec_of_each_kind():
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    spec = SamplingParams(json_schema=schema).structured
    assert spec.kind == "json" and json.loads(spec.value) == schema
    assert SamplingParams(json_schema=True).structured.value == ""
    assert SamplingParams(regex="[0-9]+").structured.value == "[0-9]+"
    choice = SamplingParams(choice=["yes", "no"]).structured
    assert (choice.kind, json.loads(choice.value)) == ("choice", ["yes", "no"])
    assert SamplingParams(grammar='root ::= "x"').structured.kind == "grammar"
    # Key order does not matter: the same schema is the same cache key.
    reordered = dict(reversed(list(schema.items())))
    assert SamplingParams(json_schema=reordered).structured == spec
