"""Structured output through the engine: the grammar constrains sampling, a failing grammar fails its
request alone, a compiling grammar holds back only its own request, preemption keeps matchers right."""

from __future__ import annotations

import json
import re
import threading

import pytest

from bulkinfer.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from tests.engine.test_llm_correctness import PROMPTS
from tests.engine.test_n_samples import run

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


@pytest.fixture(scope="module")
def llm(tiny_checkpoint) -> LLM:
    return LLM(model=str(tiny_checkpoint), dtype="float32", num_kv_blocks=128)


def test_no_structured_request_builds_no_manager(tiny_checkpoint):
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint), dtype="float32", num_kv_blocks=32))
    engine.add_request("plain", PROMPTS[0], GREEDY)
    run(engine)
    assert engine._grammars.manager is None


def test_choice_regex_and_json_constrain_the_output(llm):
    choices = ["yes", "no", "it depends"]
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    params = [
        SamplingParams(choice=choices, temperature=1.0, seed=1, max_tokens=20),
        SamplingParams(regex=r"[0-9]{3}-[a-z]{2}", temperature=1.0, seed=2, max_tokens=20),
        SamplingParams(json_schema=schema, temperature=0.0, max_tokens=60),
        SamplingParams(choice=choices, n=3, temperature=1.5, seed=3, max_tokens=20),
    ]
    outputs = llm.generate(["Answer:", "Code:", "Person:", "Again:"], params)
    assert outputs[0].text in choices and outputs[0].finish_reason == "stop"
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", outputs[1].text), outputs[1].text
    assert outputs[2].finish_reason == "stop", outputs[2].text
    value = json.loads(outputs[2].text)
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)
    assert all(o.text in choices and o.finish_reason == "stop" for o in outputs[3].outputs)


def test_a_grammar_that_must_end_ends_before_min_tokens(llm):
    # The only choice is one token long: min_tokens cannot be met, and the request must not fail.
    params = SamplingParams(choice=["a"], min_tokens=5, temperature=0.0, max_tokens=8)
    [out] = llm.generate(["Answer:"], params)
    assert (out.text, out.finish_reason, out.error) == ("a", "stop", None)


def test_a_failing_grammar_fails_its_request_alone(llm):
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2]]
    bad = SamplingParams(grammar="root ::= (", max_tokens=6)
    outputs = llm.generate(prompts, [GREEDY, bad, GREEDY])
    assert outputs[1].finish_reason == "error" and outputs[1].token_ids == []
    assert "structured output" in outputs[1].error and "failed to compile" in outputs[1].error
    alone = llm.generate([prompts[0], prompts[2]], GREEDY)
    assert [outputs[0].token_ids, outputs[2].token_ids] == [o.token_ids for o in alone]
    assert all(o.finish_reason == "length" for o in (outputs[0], outputs[2]))


def test_a_compiling_grammar_does_not_hold_back_other_requests(tiny_checkpoint):
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint), dtype="float32", num_kv_blocks=64))
    manager = engine._grammars.ensure_manager()
    gate = threading.Event()
    compile_now = manager._compile

    def gated_compile(spec):  # the compile thread waits until the test opens the gate
        gate.wait(timeout=120)
        return compile_now(spec)

    manager._compile = gated_compile
    engine.add_request("json", PROMPTS[3], SamplingParams(regex="[ab]{4}", max_tokens=10))
    engine.add_request("a", PROMPTS[4], GREEDY)
    engine.add_request("b", PROMPTS[5], GREEDY)
    finished = {}
    while "a" not in finished or "b" not in finished:
        finished.update({o.request_id: o for o in engine.step()})
    assert "json" not in finished and engine.scheduler.get_request("json").num_computed_tokens == 0
    assert engine.scheduler.num_waiting == 1
    gate.set()
    finished.update(run(engine))
    assert re.fullmatch("[ab]{4}", finished["json"].text) and finished["json"].finish_reason == "stop"


def test_preemption_keeps_the_grammar_state(tiny_checkpoint):
    # No growth reserve: every request is admitted, and they push each other out as they grow.
    llm = LLM(model=str(tiny_checkpoint), dtype="float32", num_kv_blocks=15, kv_growth_reserve_tokens=0)
    pattern = r"[a-z]{1,12}(,[a-z]{1,12}){2}\."
    params = SamplingParams(regex=pattern, temperature=1.0, seed=9, max_tokens=80)
    outputs = llm.generate(PROMPTS[:10], params)
    assert llm.get_metrics()["num_preemptions"] > 0
    for output in outputs:
        assert output.finish_reason == "stop", (output.text, output.error)
        assert re.fullmatch(pattern, output.text), output.text
