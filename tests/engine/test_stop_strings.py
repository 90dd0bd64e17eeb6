"""Stop strings (matched across token boundaries, text cut), stop token ids and min_tokens in the engine."""

from __future__ import annotations

import json
import shutil

import pytest

from bulkinfer.engine import LLM, SamplingParams
from tests.engine.test_llm_correctness import PROMPTS

PROMPT = "def fibonacci(n):\n    return"
MAX = 40


@pytest.fixture(scope="module")
def llm(tiny_checkpoint) -> LLM:
    return LLM(model=str(tiny_checkpoint), dtype="float32", num_kv_blocks=64)


@pytest.fixture(scope="module")
def greedy(llm):
    [output] = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=MAX, ignore_eos=True))
    return output


def boundary_stop(llm, token_ids: list[int]) -> tuple[str, int]:
    """A stop string made of the end of token k and the start of token k+1, whose first match in
    the text is exactly there; returns it and k + 1 (the token that completes it)."""
    text = llm.tokenizer.decode(token_ids)
    for k in range(2, len(token_ids) - 1):
        left = llm.tokenizer.decode(token_ids[: k + 1])
        right = llm.tokenizer.decode(token_ids[: k + 2])
        if len(left) < 2 or len(right) - len(left) < 2 or not text.startswith(right):
            continue
        stop = left[-2:] + right[len(left) : len(left) + 2]
        if text.find(stop) == len(left) - 2 and "\ufffd" not in stop:
            return stop, k + 1
    raise AssertionError("no token boundary to put a stop string on")


def test_stop_string_spanning_tokens_cuts_the_text(llm, greedy):
    stop, completing = boundary_stop(llm, greedy.token_ids)
    [output] = llm.generate(
        PROMPT, SamplingParams(temperature=0.0, max_tokens=MAX, stop=[stop, "never there"])
    )
    assert output.finish_reason == "stop" and output.outputs[0].stop_reason == stop
    assert output.token_ids == greedy.token_ids[: completing + 1]
    assert output.text == greedy.text[: greedy.text.find(stop)]
    [kept] = llm.generate(
        PROMPT,
        SamplingParams(temperature=0.0, max_tokens=MAX, stop=stop, include_stop_str_in_output=True),
    )
    assert kept.text == greedy.text[: greedy.text.find(stop) + len(stop)]


def test_stop_string_on_the_last_allowed_token_still_says_stop(llm, greedy):
    stop, completing = boundary_stop(llm, greedy.token_ids)
    [output] = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=completing + 1, stop=stop))
    assert output.finish_reason == "stop" and output.outputs[0].stop_reason == stop


def test_stop_strings_do_not_disturb_a_batch(llm, greedy):
    stop, _ = boundary_stop(llm, greedy.token_ids)
    plain = SamplingParams(temperature=0.0, max_tokens=8)
    outputs = llm.generate(
        [PROMPTS[0], PROMPT, PROMPTS[5]],
        [plain, SamplingParams(temperature=0.0, max_tokens=MAX, stop=stop), plain],
    )
    alone = llm.generate([PROMPTS[0], PROMPTS[5]], plain)
    assert [outputs[0].token_ids, outputs[2].token_ids] == [o.token_ids for o in alone]
    assert outputs[1].finish_reason == "stop"


def test_no_match_runs_to_length_with_the_full_text(llm, greedy):
    [output] = llm.generate(
        PROMPT, SamplingParams(temperature=0.0, max_tokens=MAX, ignore_eos=True, stop=["\x00never"])
    )
    assert output.finish_reason == "length" and output.outputs[0].stop_reason is None
    assert output.text == greedy.text and output.token_ids == greedy.token_ids


def test_stop_token_id_ends_the_request_and_is_left_out_of_the_text(llm, greedy):
    index = next(i for i, t in enumerate(greedy.token_ids) if i >= 2 and t not in greedy.token_ids[:i])
    stop_id = greedy.token_ids[index]
    [output] = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=MAX, stop_token_ids=[stop_id]))
    assert output.finish_reason == "stop" and output.outputs[0].stop_reason == stop_id
    assert output.token_ids == greedy.token_ids[: index + 1]
    assert output.text == llm.tokenizer.decode(greedy.token_ids[:index])
    [kept] = llm.generate(
        PROMPT,
        SamplingParams(
            temperature=0.0, max_tokens=MAX, stop_token_ids=[stop_id], include_stop_str_in_output=True
        ),
    )
    assert kept.text == llm.tokenizer.decode(greedy.token_ids[: index + 1])


def test_min_tokens_holds_off_stop_token_ids(llm, greedy):
    first = greedy.token_ids[0]
    [early] = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[first]))
    assert early.token_ids == [first] and early.finish_reason == "stop"
    [held] = llm.generate(
        PROMPT, SamplingParams(temperature=0.0, max_tokens=10, min_tokens=3, stop_token_ids=[first])
    )
    # The first token was masked, so another one was chosen and generation ran on.
    assert held.token_ids[0] != first and len(held.token_ids) >= 3
    assert first not in held.token_ids[:3]
    assert held.finish_reason == ("stop" if first in held.token_ids else "length")


def test_min_tokens_holds_off_stop_strings_as_in_vllm(llm, greedy):
    stop, completing = boundary_stop(llm, greedy.token_ids)
    params = SamplingParams(temperature=0.0, max_tokens=MAX, stop=stop, min_tokens=completing + 2,
                            ignore_eos=True)
    [output] = llm.generate(PROMPT, params)
    # The first match completed before min_tokens, so it ended nothing; only a later one may stop it.
    later = greedy.text.find(stop, greedy.text.find(stop) + 1)
    assert len(output.token_ids) > completing + 1
    if later >= 0:
        assert (output.text, output.finish_reason) == (greedy.text[:later], "stop")
    else:
        assert (output.text, output.finish_reason) == (greedy.text, "length")


def test_every_eos_id_of_generation_config_ends_a_request(tiny_checkpoint, tmp_path, greedy):
    # Llama 3 instruct lists two EOS ids (<|end_of_text|>, <|eot_id|>); a model that ends turns with
    # the second must stop there, not run to max_tokens.
    second_eos = greedy.token_ids[2]
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_checkpoint, model_dir)
    config_file = model_dir / "generation_config.json"
    generation = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**generation, "eos_token_id": [1, second_eos]}))
    llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=64)
    assert llm.engine.eos_token_ids == [1, second_eos]
    [output] = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=MAX))
    stop_at = greedy.token_ids.index(second_eos)
    assert output.token_ids == greedy.token_ids[: stop_at + 1] and output.finish_reason == "stop"
    assert output.outputs[0].stop_reason is None  # EOS, not a stop id of the request
    [held] = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=MAX, min_tokens=stop_at + 2))
    assert second_eos not in held.token_ids[: stop_at + 2]  # min_tokens masks every EOS id
    [ignored] = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=MAX, ignore_eos=True))
    assert ignored.token_ids == greedy.token_ids
