"""Logprobs are the model's raw log-softmax at each output position (checked against transformers)."""

from __future__ import annotations

import pytest
import torch

from bulkinfer.engine import LLM, SamplingParams
from tests.engine.hf_reference import hf_model
from tests.engine.test_llm_correctness import PROMPTS


@pytest.fixture(scope="module")
def llm(tiny_checkpoint) -> LLM:
    return LLM(model=str(tiny_checkpoint), dtype="float32", num_kv_blocks=128)


def hf_logprobs(model_dir: str, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), vocab]: log-softmax of transformers' logits before each output token."""
    with torch.inference_mode():
        logits = hf_model(model_dir)(torch.tensor([prompt + output])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) + len(output) - 1], dim=-1)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=6, logprobs=5),
        # Sampled with filters and a penalty: logprobs are still the raw model's.
        SamplingParams(temperature=0.9, top_k=20, presence_penalty=1.0, seed=3, max_tokens=6, logprobs=3),
    ],
)
def test_logprobs_equal_transformers_log_softmax(llm, tiny_checkpoint, params):
    prompts = [PROMPTS[1], PROMPTS[12]]
    outputs = llm.generate(prompts, params)
    for prompt, output in zip(prompts, outputs, strict=True):
        positions = output.outputs[0].logprobs
        assert positions is not None and len(positions) == len(output.token_ids)
        reference = hf_logprobs(str(tiny_checkpoint), prompt, output.token_ids)
        for i, (token_id, position) in enumerate(zip(output.token_ids, positions, strict=True)):
            assert position.chosen.token_id == token_id
            assert position.chosen.logprob == pytest.approx(float(reference[i, token_id]), abs=1e-4)
            top = reference[i].topk(params.logprobs)
            assert [t.token_id for t in position.top] == top.indices.tolist()
            assert [t.logprob for t in position.top] == pytest.approx(top.values.tolist(), abs=1e-4)
        if params.temperature == 0.0:
            assert all(p.chosen.token_id == p.top[0].token_id for p in positions)


def test_token_text_and_bytes(llm):
    [output] = llm.generate("def main():\n", SamplingParams(temperature=0.0, max_tokens=8, logprobs=2))
    tokenizer = llm.tokenizer
    raw = b""
    for position in output.outputs[0].logprobs:
        for entry in [position.chosen, *position.top]:
            assert entry.token == tokenizer.decode([entry.token_id])
            assert isinstance(entry.bytes, list) and all(0 <= b < 256 for b in entry.bytes)
        raw += bytes(position.chosen.bytes)
    # The chosen tokens' bytes concatenate to the generated text.
    assert raw.decode("utf-8", errors="replace") == tokenizer.decode(output.token_ids)


def test_logprobs_zero_gives_only_the_chosen_token_and_none_gives_nothing(llm):
    zero, none = llm.generate(
        [PROMPTS[4], PROMPTS[4]],
        [
            SamplingParams(temperature=0.0, max_tokens=3, logprobs=0),
            SamplingParams(temperature=0.0, max_tokens=3),
        ],
    )
    assert [p.top for p in zero.outputs[0].logprobs] == [[], [], []]
    assert none.outputs[0].logprobs is None
    assert zero.token_ids == none.token_ids
