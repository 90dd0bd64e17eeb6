"""Each tool-call format's grammar against its parser (worker/tools/): what the grammar lets through
parses back into the calls written; what it refuses (wrong arguments, a second call where one is
allowed, text where only calls are) never reaches a parser. Thinking is found where the prompt says."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string as accepts

from bulkinfer.engine.structured_output.compile import check_spec
from bulkinfer.engine.structured_output.spec import StructuredSpec
from bulkinfer.jobs.tool_calls import TOOL_CALL_FORMATS, openai_tool_request
from bulkinfer.worker.tools.constraints import output_structural_tag
from bulkinfer.worker.tools.formats import FORMATS, ToolCallsUnreadable, template_tool_format
from bulkinfer.worker.tools.prompting import call_text, messages_with_tools
from bulkinfer.worker.tools.reasoning import ThinkingState, split_thinking, thinking_state, thinking_tokens

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
ONE = [("get_weather", {"city": "Oslo"})]
TWO = [("get_weather", {"city": "Oslo"}), ("get_time", {})]


def grammar(choice: object, name: str, thinking: ThinkingState = ThinkingState.OFF,
            schema: dict | None = None, parallel: bool = True) -> xgr.Grammar:
    tools = openai_tool_request({"tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": parallel})
    tag = output_structural_tag(tools, FORMATS[name], thinking, schema)
    assert tag is not None
    check_spec(StructuredSpec.structural_tag(tag))  # as the engine compiles it
    return xgr.Grammar.from_structural_tag(json.dumps(tag))


def test_the_jobs_side_names_every_format_the_worker_has() -> None:
    assert tuple(FORMATS) == TOOL_CALL_FORMATS


@pytest.mark.parametrize("name", list(FORMATS))
def test_required_calls_parse_back_and_nothing_else_is_allowed(name: str) -> None:
    tool_format = FORMATS[name]
    required = grammar("required", name)
    assert accepts(required, call_text(ONE, tool_format))
    assert accepts(required, call_text(TWO, tool_format)) == tool_format.parallel
    assert not accepts(required, "Hello.")
    assert not accepts(required, call_text([("get_weather", {"town": "Oslo"})], tool_format))  # off-schema
    assert not accepts(required, call_text([("delete_all", {})], tool_format))  # not a function offered
    assert not accepts(grammar("required", name, parallel=False), call_text(TWO, tool_format))
    text, calls = tool_format.split(call_text(TWO if tool_format.parallel else ONE, tool_format))
    assert text == "" and [(c.name, c.arguments) for c in calls] == (TWO if tool_format.parallel else ONE)


@pytest.mark.parametrize("name", list(FORMATS))
def test_auto_takes_text_or_calls_and_none_takes_text_only(name: str) -> None:
    tool_format = FORMATS[name]
    auto = grammar("auto", name)
    written = "Let me check. " + call_text(ONE, tool_format)
    assert accepts(auto, "It is sunny.") and accepts(auto, written)
    assert not accepts(auto, "Let me check. " + call_text([("get_weather", {"city": 5})], tool_format))
    text, calls = tool_format.split(written)
    assert text == "Let me check." and [c.name for c in calls] == ["get_weather"]
    assert not accepts(grammar("none", name), written) and accepts(grammar("none", name), "It is sunny.")


def test_a_named_function_is_called_once() -> None:
    named = grammar({"type": "function", "function": {"name": "get_time"}}, "hermes")
    assert accepts(named, call_text([("get_time", {})], FORMATS["hermes"]))
    assert not accepts(named, call_text(ONE, FORMATS["hermes"]))
    assert not accepts(named, call_text([("get_time", {}), ("get_time", {})], FORMATS["hermes"]))


def test_auto_with_a_response_format_is_that_json_or_calls() -> None:
    answer = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    either = grammar("auto", "hermes", schema=answer)
    assert accepts(either, '{"n": 3}') and accepts(either, call_text(ONE, FORMATS["hermes"]))
    assert not accepts(either, "three")


def test_thinking_comes_first_and_the_answer_is_held_after_it() -> None:
    answer = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    tools = openai_tool_request({"tools": TOOLS, "tool_choice": "none"})
    opened = json.dumps(output_structural_tag(tools, FORMATS["hermes"], ThinkingState.OPEN, answer))
    assert accepts(xgr.Grammar.from_structural_tag(opened), 'Four? no, 3.</think>\n\n{"n": 3}')
    assert not accepts(xgr.Grammar.from_structural_tag(opened), '{"n": 3}')  # the thinking first
    own = json.dumps(output_structural_tag(None, None, ThinkingState.OWN, answer))
    assert accepts(xgr.Grammar.from_structural_tag(own), '<think>free {not json</think>\n{"n": 3}')
    assert output_structural_tag(None, None, ThinkingState.OFF, answer) is None  # plain json_schema then


def test_a_call_cut_at_max_tokens_keeps_the_calls_finished_before_it() -> None:
    hermes = FORMATS["hermes"]
    cut = call_text(ONE, hermes) + "\n<tool_call>\n{\"name\": \"get_ti"
    with pytest.raises(ToolCallsUnreadable, match="cut off"):
        hermes.split(cut)
    text, calls = hermes.split(cut, cut=True)
    assert [c.name for c in calls] == ["get_weather"] and text == ""
    with pytest.raises(ToolCallsUnreadable):
        hermes.split("<tool_call>\n{\"name\": \"get_weather\", \"argu", cut=True)  # none finished


def test_templates_show_their_format_and_a_deployment_can_supply_one() -> None:
    assert template_tool_format("{% if tools %}<tool_call>{% endif %}").name == "hermes"
    assert template_tool_format("{% for t in tools %}[TOOL_CALLS]{% endfor %}").name == "mistral"
    assert template_tool_format("{% if tools %}<|python_tag|>{% endif %}").name == "llama3_json"
    assert template_tool_format("{{ messages }}<tool_call>") is None  # never reads tools
    oslo = '{"city": "Oslo"}'
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": oslo}}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    written = messages_with_tools(messages, TOOLS, FORMATS["hermes"])
    system = written[0]["content"]
    assert system.startswith("Be brief.\n\n# Tools") and '"get_weather"' in system
    assert written[2] == {"role": "assistant", "content": call_text(ONE, FORMATS["hermes"])}
    assert written[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}


def test_where_the_thinking_is() -> None:
    assert thinking_state("<|im_start|>assistant\n", thinks=True) == ThinkingState.OWN
    assert thinking_state("<|im_start|>assistant\n<think>\n", thinks=True) == ThinkingState.OPEN
    assert thinking_state("assistant\n<think>\n\n</think>\n\n", thinks=True) == ThinkingState.OFF
    assert thinking_state("<|im_start|>assistant\n<think>\n", thinks=False) == ThinkingState.OFF
    assert split_thinking("a plan</think>\n\nThe answer.", ThinkingState.OPEN) == ("a plan", "The answer.")
    assert split_thinking("<think>a plan</think>Yes", ThinkingState.OWN) == ("a plan", "Yes")
    assert split_thinking("Yes", ThinkingState.OWN) == (None, "Yes")
    assert split_thinking("never closed", ThinkingState.OPEN) == ("never closed", "")  # cut at max_tokens
    pieces = ["<think>", "ab", "c</th", "ink>", "Yes"]
    assert thinking_tokens(list(range(5)), lambda ids: "".join(pieces[i] for i in ids)) == 4
    assert thinking_tokens([0, 1], lambda ids: "".join(pieces[i] for i in ids)) == 2  # never closed: all
