"""SmolLM2-135M-Instruct quantized as llm-compressor would (W4A16 in groups of 64, W8A8 with dynamic
per-token activations) and run by the engine: W4A16 gives transformers' greedy tokens on the same
dequantized weights; W8A8 still answers, and its tokens are the unquantized-activation reference's
on nearly every position (the activation rounding's cost, measured and bounded)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bulkinfer.benchmarks.quant_checkpoints import activation_args, write_quantized_checkpoint
from bulkinfer.engine import LLM, SamplingParams, cpu_kernels
from bulkinfer.engine.attention import TorchPagedAttention
from bulkinfer.engine.chat import chat_token_ids
from bulkinfer.engine.models import load_model
from tests.engine.hf_reference import assert_same_greedy, hf_greedy, hf_model

QUESTIONS = {"What is the capital of France? Answer in one sentence.": "Paris",
             "What is the capital of Japan?": "Tokyo"}
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def quantized(real_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("smollm2-quantized")
    return {"W4A16": write_quantized_checkpoint(real_model, root / "w4a16", bits=4, group_size=64),
            "W8A8": write_quantized_checkpoint(real_model, root / "w8a8",
                                               activations=activation_args(static=False, symmetric=True))}


def _answers(folder: Path) -> tuple[Path, list[list[int]], list]:
    """(the float twin, the questions' prompt ids, the engine's greedy outputs) of one quantized copy."""
    llm = LLM(str(folder), dtype="float32")
    prompts = [chat_token_ids(llm.engine.tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))
    return folder.with_name(folder.name + "-float"), prompts, outputs


def test_w4a16_smollm2_gives_transformers_greedy_tokens_and_answers(quantized: dict[str, Path]) -> None:
    folder = quantized["W4A16"]
    twin, prompts, outputs = _answers(folder)
    kernels = cpu_kernels.load()
    model = load_model(folder, TorchPagedAttention(kernels=kernels))
    model.use_cpu_kernels(kernels)
    for prompt, output, answer in zip(prompts, outputs, QUESTIONS.values(), strict=True):
        tokens = list(output.outputs[0].token_ids)
        assert_same_greedy(tokens, hf_greedy(twin, prompt, NEW_TOKENS), prompt, twin, model)
        assert answer in output.outputs[0].text


def test_w8a8_smollm2_answers_and_agrees_with_the_unquantized_activations(quantized: dict[str, Path]) -> None:
    twin, prompts, outputs = _answers(quantized["W8A8"])
    reference = hf_model(str(twin))
    agreeing = total = 0
    for prompt, output, answer in zip(prompts, outputs, QUESTIONS.values(), strict=True):
        assert answer in output.outputs[0].text
        tokens = list(output.outputs[0].token_ids)
        with torch.inference_mode():  # teacher forcing: the reference's argmax on our own context
            logits = reference(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
        agreeing += int((logits.argmax(-1) == torch.tensor(tokens)).sum())
        total += len(tokens)
    assert agreeing / total >= 0.9, f"{agreeing} of {total} tokens agree with unquantized activations"
