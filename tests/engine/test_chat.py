"""render_chat: the tokenizer's template when it has one, ChatML otherwise, errors with the reason."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from bulkinfer.engine.chat import DEFAULT_CHAT_TEMPLATE, ChatTemplateError, render_chat

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
CHATML = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture
def tokenizer(tiny_checkpoint: Path):
    return AutoTokenizer.from_pretrained(tiny_checkpoint)


def test_the_tokenizers_own_template_is_used(tokenizer):
    tokenizer.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}" \
                              "{% if add_generation_prompt %}[assistant] {% endif %}"
    assert render_chat(tokenizer, MESSAGES) == "[system] Be brief.\n[user] hi\n[assistant] "
    assert render_chat(tokenizer, MESSAGES, add_generation_prompt=False) == "[system] Be brief.\n[user] hi\n"


def test_without_a_template_chatml_is_used(tokenizer):
    tokenizer.chat_template = None
    assert render_chat(tokenizer, MESSAGES) == CHATML
    assert render_chat(tokenizer, MESSAGES, add_generation_prompt=False) == CHATML.removesuffix(
        "<|im_start|>assistant\n")
    # The tiny tokenizer knows the ChatML markers as special tokens: one id each.
    ids = tokenizer.encode(render_chat(tokenizer, MESSAGES), add_special_tokens=False)
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3


def test_default_template_is_the_tiny_checkpoints_chatml(tokenizer):
    assert tokenizer.chat_template == DEFAULT_CHAT_TEMPLATE  # the same text: one ChatML in the project
    assert render_chat(tokenizer, MESSAGES) == CHATML


def test_text_parts_are_joined_and_null_content_is_empty(tokenizer):
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": None, "tool_calls": []}]
    assert render_chat(tokenizer, messages, add_generation_prompt=False) == \
        "<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n"


@pytest.mark.parametrize(("messages", "reason"), [
    ([], "non-empty list"),
    ("hi", "non-empty list"),
    (["hi"], r"messages\[0\] must be an object"),
    ([{"content": "hi"}], r"messages\[0\] needs a role"),
    ([{"role": "user", "content": 3}], r"messages\[0\].content must be text"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x"}}]}],
     r"content\[0\] must be a text part .* 'input_audio'"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"detail": "low"}}]}],
     r"content\[0\].image_url.url must be a string"),
])
def test_invalid_messages_raise_with_the_reason(tokenizer, messages, reason):
    with pytest.raises(ChatTemplateError, match=reason):
        render_chat(tokenizer, messages)


def test_a_failing_template_raises_a_value_error_with_its_message(tokenizer):
    tokenizer.chat_template = "{{ raise_exception('system messages are not supported') }}"
    with pytest.raises(ValueError, match="system messages are not supported") as raised:
        render_chat(tokenizer, MESSAGES)
    assert isinstance(raised.value, ChatTemplateError)


def test_llm_chat_generates_from_the_rendered_conversation(tiny_checkpoint: Path):
    from bulkinfer.engine import LLM, SamplingParams

    llm = LLM(model=str(tiny_checkpoint), dtype="float32", num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    [as_chat, second] = llm.chat([MESSAGES, MESSAGES[1:]], params)
    prompt_ids = llm.tokenizer.encode(CHATML, add_special_tokens=False)
    [as_tokens] = llm.generate([prompt_ids], params)
    assert as_chat.prompt_token_ids == prompt_ids and as_chat.token_ids == as_tokens.token_ids
    assert second.num_prompt_tokens < as_chat.num_prompt_tokens
    [single] = llm.chat(MESSAGES, params)  # one conversation on its own
    assert single.token_ids == as_chat.token_ids
    with pytest.raises(ChatTemplateError, match=r"conversation 1: messages\[0\] needs a role"):
        llm.chat([MESSAGES, [{"content": "no role"}]], params)


def test_gemma3s_template_folds_the_system_message_into_the_first_user_turn(checkpoint_factory):
    gemma = AutoTokenizer.from_pretrained(checkpoint_factory(arch="gemma3"))
    conversation = [*MESSAGES, {"role": "assistant", "content": "ok "}, {"role": "user", "content": "more"}]
    assert render_chat(gemma, conversation) == (
        "<|begin_of_text|><start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n"
        "<start_of_turn>model\nok<end_of_turn>\n<start_of_turn>user\nmore<end_of_turn>\n<start_of_turn>model\n")
    ids = gemma.encode(render_chat(gemma, MESSAGES), add_special_tokens=False)
    assert ids.count(gemma.bos_token_id) == 1 and ids[0] == gemma.bos_token_id
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        render_chat(gemma, [{"role": "assistant", "content": "hi"}])


def test_earlier_calls_reach_the_template_with_their_arguments_as_objects() -> None:
    """OpenAI sends a call's arguments as JSON text; templates write them with `tojson` (as vLLM
    passes them): the template sees an object, and the row's tools and switches reach it."""
    seen = {}

    class Recorder:
        chat_template = "{{ messages }}"

        def apply_chat_template(self, messages, **kwargs):
            seen.update(messages=messages, **kwargs)
            return "rendered"

    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"city": "Oslo"}'}}
    broken = {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "{not json"}}
    tools = [{"type": "function", "function": {"name": "f"}}]
    render_chat(Recorder(), [{"role": "assistant", "content": None, "tool_calls": [call, broken]},
                             {"role": "tool", "tool_call_id": "c1", "content": "4C"}],
                tools=tools, enable_thinking=False)
    assistant = seen["messages"][0]
    assert assistant["content"] == ""
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert assistant["tool_calls"][1] == broken  # left as written: the template decides what to do with it
    assert seen["tools"] == tools and seen["enable_thinking"] is False
