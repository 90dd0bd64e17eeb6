"""Thinking models: where a row's thinking is, in its prompt and in its output.

A thinking model writes `<think>` … `</think>` before its answer (Qwen3, DeepSeek-R1 and its
distills, Phi-4-reasoning). Some templates open the block in the prompt (the output then starts
inside it), some leave it to the model, and some close an empty one when thinking is off (Qwen3's
`enable_thinking=False`). `ThinkingState` says which, from the rendered prompt; the output is split
into thinking and answer as vLLM's reasoning parsers split it, and a constrained answer (a JSON
schema, tool calls) is held to its grammar only after the thinking.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import StrEnum
from typing import Any

OPEN, CLOSE = "<think>", "</think>"
PROMPT_TAIL = 64  # characters of the rendered prompt read for an opened block (the generation prompt)
JsonFormat = dict[str, Any]


class ThinkingState(StrEnum):
    OFF = "off"  # the model does not think here (no thinking template, or an empty block in the prompt)
    OPEN = "open"  # the prompt opened the block: the output starts with thinking
    OWN = "own"  # the model opens the block itself (Qwen3 in thinking mode)


def template_thinks(template: str | None) -> bool:
    """Whether a chat template belongs to a thinking model (it names the thinking markers)."""
    return bool(template) and CLOSE in (template or "")


def thinking_state(prompt: str, thinks: bool) -> ThinkingState:
    """Where the thinking of a model (`thinks`: its template's) starts, given its rendered prompt."""
    if not thinks:
        return ThinkingState.OFF
    tail = prompt[-PROMPT_TAIL:]
    opened, closed = tail.rfind(OPEN), tail.rfind(CLOSE)
    if opened >= 0 and closed < opened:
        return ThinkingState.OPEN
    if closed >= 0:
        return ThinkingState.OFF  # an empty block closed in the prompt: thinking is off
    return ThinkingState.OWN


def thinking_prefix(state: ThinkingState, budget: int | None = None) -> JsonFormat | None:
    """The grammar of the thinking before a constrained answer (any text, at most `budget` tokens:
    then the closing marker is forced), then the blank line a model writes after it; None where
    there is none. A model that opens the block itself must open it, as it does in thinking mode."""
    if state == ThinkingState.OFF:
        return None
    begin = "" if state == ThinkingState.OPEN else OPEN
    text: JsonFormat = {"type": "any_text", "excludes": [OPEN]}
    if budget is not None:
        text["max_tokens"] = budget
    return {"type": "sequence", "elements": [{"type": "tag", "begin": begin, "content": text, "end": CLOSE},
                                             {"type": "regex", "pattern": "[ \\n]{0,3}"}]}


def split_thinking(text: str, state: ThinkingState) -> tuple[str | None, str]:
    """(the thinking, the answer) of an output; thinking None where there is none. A block that
    never closes (cut at max_tokens) is all thinking, with an empty answer."""
    if state == ThinkingState.OFF:
        return None, text
    body = text
    if state == ThinkingState.OWN:
        stripped = text.lstrip()
        if not stripped.startswith(OPEN):
            return None, text
        body = stripped[len(OPEN):]
    end = body.find(CLOSE)
    if end < 0:
        return body.strip(), ""
    return body[:end].strip(), body[end + len(CLOSE):].lstrip()


def thinking_tokens(token_ids: Sequence[int], decode: Callable[[list[int]], str]) -> int:
    """How many of the output's tokens the thinking took, through its closing marker (all of them
    when it never closed): the fewest leading tokens whose text holds `</think>` (binary search)."""
    ids = list(token_ids)
    if CLOSE not in decode(ids):
        return len(ids)
    low, high = 1, len(ids)
    while low < high:
        middle = (low + high) // 2
        if CLOSE in decode(ids[:middle]):
            high = middle
        else:
            low = middle + 1
    return low


