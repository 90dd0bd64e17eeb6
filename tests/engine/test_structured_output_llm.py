"""Structured output end to end: ``LLM.generate(..., SamplingParams(json_schema=...))`` on a
random-weight checkpoint sampled at temperature 1.0. Every output that finishes (finish_reason
"stop": the grammar completed and the stop token was sampled) parses with strict json.loads and
validates. Sizes are bounded (see structured_schemas.py), so every output finishes well within
max_tokens; an output cut by max_tokens (finish_reason "length") is truncated text, not JSON,
as the last test shows."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from bulkinfer.engine import LLM, ErrorKind, SamplingParams
from tests.engine.structured_schemas import SCHEMAS

MAX_TOKENS = 400  # the corpus' longest random-logits output is ~170 tokens
LENGTH_LIMITED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 10},
        "code": {"type": "string", "minLength": 3, "maxLength": 3},
        "notes": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "code", "notes"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tiny_checkpoint: Path) -> LLM:
    return LLM(model=str(tiny_checkpoint), dtype="float32", max_num_seqs=128)


def validator(schema: dict) -> jsonschema.protocols.Validator:
    cls = jsonschema.validators.validator_for(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def assert_valid(schema: dict, texts: list[str]) -> None:
    check = validator(schema)
    for text in texts:
        errors = [e.message for e in check.iter_errors(json.loads(text))]  # strict json.loads
        assert not errors, (text, errors)


@pytest.mark.timeout(900)
def test_every_corpus_schema_through_the_engine(llm: LLM) -> None:
    names = sorted(SCHEMAS)
    prompts = [f"Answer with JSON for {name}:" for name in names]
    params = [
        SamplingParams(json_schema=SCHEMAS[name], n=3, temperature=1.0, seed=i, max_tokens=MAX_TOKENS)
        for i, name in enumerate(names)
    ]
    outputs = llm.generate(prompts, params)
    for name, output in zip(names, outputs, strict=True):
        assert output.error is None, (name, output.error)
        assert len(output.outputs) == 3
        reasons = [c.finish_reason for c in output.outputs]
        assert reasons == ["stop"] * 3, (name, reasons)
        assert_valid(SCHEMAS[name], [c.text for c in output.outputs])


@pytest.mark.timeout(600)
def test_length_limited_strings_parse_strictly(llm: LLM) -> None:
    """mlc-ai/xgrammar#800 through the engine: 64 samples at temperature 1.0."""
    outputs = llm.generate(
        [f"Person {i}:" for i in range(64)],
        SamplingParams(json_schema=LENGTH_LIMITED, temperature=1.0, max_tokens=MAX_TOKENS),
    )
    assert [o.finish_reason for o in outputs] == ["stop"] * 64
    assert_valid(LENGTH_LIMITED, [o.text for o in outputs])


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_mixture_of_experts_models_follow_the_schema(arch: str, checkpoint_factory) -> None:
    """The grammar masks every step's logits, whatever the router picked: 8 samples, each a
    strictly valid object."""
    llm = LLM(model=str(checkpoint_factory(arch=arch)), dtype="float32", num_kv_blocks=128)
    outputs = llm.generate(
        [f"Person {i}:" for i in range(8)],
        [SamplingParams(json_schema=LENGTH_LIMITED, temperature=1.0, seed=i, max_tokens=MAX_TOKENS)
         for i in range(8)],
    )
    assert [o.finish_reason for o in outputs] == ["stop"] * 8
    assert_valid(LENGTH_LIMITED, [o.text for o in outputs])


def test_regex_choice_and_grammar(llm: LLM) -> None:
    regex = r"[A-Z]{2}-[0-9]{2,4}( [a-z]{1,5})?"
    choices = ["positive", "negative", 'a "quoted" one', "ünïcode"]
    grammar = 'root ::= "[" item ("," item){0,2} "]"\nitem ::= "true" | "false" | [0-9]'
    outputs = llm.generate(
        ["Plate:"] * 16 + ["Sentiment:"] * 16 + ["List:"] * 16,
        [SamplingParams(regex=regex, max_tokens=64)] * 16
        + [SamplingParams(choice=choices, max_tokens=64)] * 16
        + [SamplingParams(grammar=grammar, max_tokens=64)] * 16,
    )
    assert all(o.finish_reason == "stop" for o in outputs)
    assert all(re.fullmatch(regex, o.text) for o in outputs[:16]), [o.text for o in outputs[:16]]
    assert all(o.text in choices for o in outputs[16:32])
    pattern = r"\[(true|false|[0-9])(,(true|false|[0-9])){0,2}\]"
    assert all(re.fullmatch(pattern, o.text) for o in outputs[32:]), [o.text for o in outputs[32:]]


def test_any_json_object(llm: LLM) -> None:
    prompts = [f"Object {i}:" for i in range(8)]
    outputs = llm.generate(prompts, SamplingParams(json_schema=True, max_tokens=128))
    finished = [o.text for o in outputs if o.finish_reason == "stop"]
    # Unbounded strings and nesting: a random model may wander to max_tokens; what finishes is an object.
    assert finished
    assert all(isinstance(json.loads(text), dict) for text in finished)


def test_properties_come_in_the_schemas_order(llm: LLM) -> None:
    # Users order fields on purpose ("reasoning" before "answer"): the output keeps that order.
    names = ["zeta", "alpha", "mid", "beta"]
    schema = {"type": "object", "properties": {name: {"type": "boolean"} for name in names},
              "required": names, "additionalProperties": False}
    outputs = llm.generate([f"Flags {i}:" for i in range(4)],
                           SamplingParams(json_schema=schema, temperature=1.0, seed=5, max_tokens=64))
    assert all(o.finish_reason == "stop" for o in outputs)
    assert all(list(json.loads(o.text)) == names for o in outputs)


def test_a_schema_that_fails_to_compile_fails_only_its_row(llm: LLM) -> None:
    good = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    outputs = llm.generate(
        ["a", "b", "c"],
        [
            SamplingParams(json_schema=good, max_tokens=32),
            SamplingParams(json_schema={"type": "array", "uniqueItems": True}, max_tokens=32),
            SamplingParams(regex="(unclosed", max_tokens=32),
        ],
    )
    assert outputs[0].finish_reason == "stop" and json.loads(outputs[0].text)["ok"] in (True, False)
    assert outputs[1].finish_reason == "error"
    assert "grammar for json_schema failed to compile: 'uniqueItems' is not enforced" in outputs[1].error
    assert outputs[2].finish_reason == "error"
    assert "grammar for regex failed to compile" in outputs[2].error
    assert outputs[1].error_kind == outputs[2].error_kind == ErrorKind.STRUCTURED_OUTPUT


def test_max_tokens_cuts_the_output_before_the_grammar_completes(llm: LLM) -> None:
    """The engine does not force a grammar closed at max_tokens: the text is a truncated prefix."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 20, "maxLength": 30}},
              "required": ["s"]}
    output = llm.generate(["x"], SamplingParams(json_schema=schema, max_tokens=8))[0]
    assert output.finish_reason == "length" and len(output.token_ids) == 8
    assert output.text.startswith('{"s')
    with pytest.raises(json.JSONDecodeError):
        json.loads(output.text)


def test_a_compiling_grammar_holds_only_its_own_request(tiny_checkpoint: Path) -> None:
    """While one request's grammar compiles (held here), the engine runs the others to the end."""
    import threading

    from bulkinfer.engine.structured_output import StructuredOutputManager

    class Gated(StructuredOutputManager):
        gate = threading.Event()

        def _compile(self, spec):
            self.gate.wait(60)
            return super()._compile(spec)

    llm = LLM(model=str(tiny_checkpoint), dtype="float32", max_num_seqs=8)
    engine = llm.engine
    engine._grammars.manager = Gated(engine.tokenizer, engine._vocab_size, 8)  # the engine's manager slot
    engine.add_request("json", "a", SamplingParams(json_schema={"type": "boolean"}, max_tokens=8))
    engine.add_request("plain", "b", SamplingParams(max_tokens=8, ignore_eos=True))
    done: dict[str, object] = {}
    while "plain" not in done:
        done.update({o.request_id: o for o in engine.step()})
    assert "json" not in done and engine.has_unfinished_requests()
    Gated.gate.set()
    while "json" not in done:
        done.update({o.request_id: o for o in engine.step()})
    assert done["json"].finish_reason == "stop" and done["json"].text in ("true", "false")
    assert len(done["plain"].token_ids) == 8


@pytest.mark.parametrize("arch", ["gemma3", "phi3"])
def test_the_newer_families_complete_schemas_and_choices(checkpoint_factory, arch: str) -> None:
    """Gemma 3 (its final-logit soft-cap under the grammar mask) and Phi-3 through the same masks."""
    llm = LLM(model=str(checkpoint_factory(arch=arch)), dtype="float32", max_num_seqs=16)
    schema = SamplingParams(json_schema=LENGTH_LIMITED, n=3, temperature=1.0, seed=5, max_tokens=MAX_TOKENS)
    choice = SamplingParams(choice=["red", "green", "blue"], temperature=0.0, max_tokens=8)
    json_output, choice_output = llm.generate(["Give JSON:", "Pick a colour:"], [schema, choice])
    assert [c.finish_reason for c in json_output.outputs] == ["stop"] * 3
    assert_valid(LENGTH_LIMITED, [c.text for c in json_output.outputs])
    assert choice_output.outputs[0].text in ("red", "green", "blue")


CALL_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                "days": {"type": "integer", "minimum": 1, "maximum": 9}},
               "required": ["city", "days"], "additionalProperties": False}


def test_structural_tags_force_calls_whose_arguments_validate(llm: LLM) -> None:
    """`structural_tag`: only `<call name="…">{arguments}</call>` blocks (one or more, newline
    apart), the arguments held to the schema; a random model at temperature 1 still writes them."""
    calls = [{"type": "tag", "begin": f'<call name="{name}">',
              "content": {"type": "json_schema", "json_schema": CALL_SCHEMA, "max_whitespace_cnt": 1},
              "end": "</call>"} for name in ("forecast", "history")]
    tag = {"type": "structural_tag",
           "format": {"type": "tags_with_separator", "tags": calls, "separator": "\n", "at_least_one": True}}
    outputs = llm.generate([f"Call {i}:" for i in range(6)],
                           SamplingParams(structural_tag=tag, temperature=1.0, seed=3, max_tokens=150))
    finished = [o.text for o in outputs if o.finish_reason == "stop"]
    assert len(finished) >= 4, [o.text for o in outputs]
    block = re.compile(r'<call name="(forecast|history)">(.*?)</call>', re.S)
    for text in finished:
        found = block.findall(text)
        assert found and "\n".join(m.group(0) for m in block.finditer(text)) == text, text
        for _, arguments in found:
            assert not list(validator(CALL_SCHEMA).iter_errors(json.loads(arguments))), arguments


def test_a_structural_tag_that_does_not_compile_fails_its_row(llm: LLM) -> None:
    nonsense = {"type": "tag", "begin": "<a>", "content": {"type": "nonsense"}, "end": "</a>"}
    bad = {"type": "structural_tag", "format": nonsense}
    bad_output, good = llm.generate(["x", "y"], [SamplingParams(structural_tag=bad, max_tokens=8),
                                                 SamplingParams(max_tokens=4)])
    assert bad_output.error_kind == ErrorKind.STRUCTURED_OUTPUT and "structural_tag" in bad_output.error
    assert good.error is None
