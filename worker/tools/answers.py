"""A row's plan for tools and thinking (decided when its prompt is rendered), and its output read back
by that plan: the thinking apart, the calls parsed, the text that is left the answer."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from bulkinfer.engine import SamplingParams
from bulkinfer.jobs.tool_calls import ToolRequest
from bulkinfer.worker.tools.constraints import output_structural_tag
from bulkinfer.worker.tools.formats import ParsedCall, ToolCallsUnreadable, ToolFormat
from bulkinfer.worker.tools.reasoning import ThinkingState, split_thinking, thinking_tokens


@dataclass(frozen=True)
class ChatPlan:
    """How a row's output is held and read: its tools in `tool_format`, and where its thinking is."""

    tools: ToolRequest | None = None
    tool_format: ToolFormat | None = None
    thinking: ThinkingState = ThinkingState.OFF
    hide_reasoning: bool = False
    thinking_budget: int | None = None

    @property
    def reads_output(self) -> bool:
        return self.tools is not None or self.thinking != ThinkingState.OFF

    def sampling(self, params: SamplingParams) -> SamplingParams:
        """`params` with the structural tag the plan needs in place of a plain `json_schema`, and the
        special tokens kept in the text (thinking and call markers may be special tokens)."""
        if not self.reads_output:
            return params
        tag = output_structural_tag(self.tools, self.tool_format, self.thinking, params.json_schema,
                                    self.thinking_budget)
        if tag is None:
            return dataclasses.replace(params, skip_special_tokens=False)
        return dataclasses.replace(params, json_schema=None, structural_tag=tag, skip_special_tokens=False)


PLAIN = ChatPlan()


@dataclass(frozen=True)
class Answer:
    text: str  # the answer's text, without thinking and calls
    reasoning: str | None = None  # the thinking (None: none, or hidden)
    reasoning_tokens: int = 0
    calls: list[ParsedCall] = field(default_factory=list)


def read_answer(plan: ChatPlan, text: str, token_ids: Sequence[int], decode: Callable[[list[int]], str],
                cut: bool = False) -> Answer:
    """One sample's output read by `plan`; raises `ToolCallsUnreadable` for a call that was started
    and not finished (max_tokens cut it: `cut`, and no call before it finished) or that names a
    function the row did not offer."""
    if not plan.reads_output:
        return Answer(text)
    reasoning, answer = split_thinking(text, plan.thinking)
    tokens = thinking_tokens(token_ids, decode) if reasoning is not None else 0
    calls: list[ParsedCall] = []
    if plan.tools is not None and plan.tool_format is not None and plan.tools.choice != "none":
        answer, calls = plan.tool_format.split(answer, cut)
        offered = {function.name for function in plan.tools.callable}
        unknown = [call.name for call in calls if call.name not in offered]
        if unknown:
            raise ToolCallsUnreadable(f"the answer calls {unknown[0]!r}, which the request did not offer")
    return Answer(answer, None if plan.hide_reasoning else reasoning, tokens, calls)
