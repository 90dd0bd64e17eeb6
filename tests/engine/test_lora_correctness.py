"""Greedy tokens with LoRA adapters == transformers on the same adapter merged into the base
(peft's ``merge_and_unload``), for every architecture the engine serves.

One engine per arch and dtype runs rows of 4 adapters (ranks 4 to 16, one rsLoRA) and the base
model mixed in the same steps, under prefix hits (rows share prefixes within and across
adapters), chunked prefill (40 tokens a step) and preemption (a 17-block pool). fp32: every token
is the merged model's argmax on the engine's context, or a proven fp32 tie. bf16: merging rounds
``W + s B A`` to bf16, another bf16 model than bf16 weights plus a separate update, so the reference
is peft's own unmerged model in bf16 (its bf16 update, as the engine's, beside the base matmul): at
least ``LORA_MIN_AGREEMENT`` of the engine's tokens its argmax on the engine's context, and by the merged
fp32 model the engine's tokens lose no more than peft's bf16 choices do (x ``LORA_DEFICIT_FACTOR``,
plus bf16 noise). Not a per-token near-tie bound: bf16 rounds differently on AMX, AVX512-BF16 and
emulating CPUs, and on a Zen 4 one flip came 9 ulps apart (peft's gap 0.281 against a bound of
0.25) while the engine's tokens were as good as peft's.
"""

from __future__ import annotations

import random

import pytest
import torch

from bulkinfer.engine import EngineConfig, LLMEngine, LoRARequest, SamplingParams
from bulkinfer.engine.lora.rows import LoRARows
from tests.engine.hf_reference import (
    TEST_DEVICE,
    assert_greedy_by_teacher_forcing,
    assert_no_worse_than_reference,
    hf_model,
)
from tests.engine.lora_adapters import ALL_PROJECTIONS, ATTENTION_ONLY, PHI3_PROJECTIONS, make_adapter

DENSE_ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma3", "phi3"]
MOE_ARCHS = ["qwen3_moe", "mixtral"]
# bf16 on the Llama layout (suite time: the other archs share its LoRA path).
CASES = [(arch, "float32") for arch in DENSE_ARCHS + MOE_ARCHS] + [("llama", "bfloat16")]
MAX_NEW_TOKENS = {"float32": 8, "bfloat16": 16}
# bf16 as mixture-of-experts models are judged (tests/engine/hf_reference.py). Measured on an AVX2-only
# EPYC (emulated bf16), per adapter: agreement 0.896-0.979; tokens lost to the fp32 argmax 0.007-0.022
# a token against peft's bf16 choices' 0.005-0.015, under a bf16 noise of 0.27.
LORA_MIN_AGREEMENT = 0.8
LORA_DEFICIT_FACTOR = 1.5
# PEFT's random init (init_lora_weights=False) scaled down: the update stays the size of a trained
# one next to the base weights, yet every adapter changes the base model's tokens (checked).
ADAPTER_SCALE = 0.5
# (seed, rank, alpha, rsLoRA) of the four adapters.
ADAPTERS = [(11, 4, 8.0, False), (12, 8, 16.0, False), (13, 16, 16.0, True), (14, 8, 32.0, False)]


def targets_of(arch: str) -> tuple[str, ...]:
    if arch in MOE_ARCHS:
        return ATTENTION_ONLY  # experts take no LoRA
    return PHI3_PROJECTIONS if arch == "phi3" else ALL_PROJECTIONS


def make_prompts(seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(5, 2048) for _ in range(n)]

    shared = tokens(40)  # 2.5 blocks: every adapter's rows hit their own cached blocks of it
    return [shared + tokens(5), shared + tokens(20), tokens(33)]


PROMPTS = make_prompts()


class WithAdapter:
    """The engine's model with one adapter slot on every row: what the tie checks compute."""

    def __init__(self, model, slot: int) -> None:
        self._model, self._slot = model, slot

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, input_ids, *args, **kwargs):
        self._model.step_rows.lora = LoRARows(torch.full_like(input_ids, self._slot))
        try:
            return self._model(input_ids, *args, **kwargs)
        finally:
            self._model.step_rows.lora = None


@pytest.mark.parametrize(("arch", "dtype"), CASES, ids=[f"{a}-{d}" for a, d in CASES])
def test_mixed_adapters_match_merged_models(arch, dtype, checkpoint_factory, monkeypatch):
    base_dir = str(checkpoint_factory(arch=arch))
    adapters = [make_adapter(base_dir, seed, rank, alpha, targets_of(arch), rslora,
                             weight_scale=ADAPTER_SCALE) for seed, rank, alpha, rslora in ADAPTERS]
    requests = [None] + [LoRARequest(f"adapter-{i}", i + 1, str(path))
                         for i, (path, _) in enumerate(adapters)]
    engine = LLMEngine(EngineConfig(model=base_dir, device=TEST_DEVICE, dtype=dtype, num_kv_blocks=18,
                                    kv_growth_reserve_tokens=0, max_num_batched_tokens=40,
                                    enable_lora=True, max_loras=4, max_lora_rank=16))
    most_in_a_step = []  # (adapters, whether base rows too) of each step's rows
    init = LoRARows.__init__

    def recorded(self, slots):
        init(self, slots)
        most_in_a_step.append((len(set(slots[slots >= 0].tolist())), bool((slots < 0).any())))

    monkeypatch.setattr(LoRARows, "__init__", recorded)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS[dtype], ignore_eos=True)
    rows = [(lora, prompt) for prompt in PROMPTS for lora in requests]
    for i, (lora, prompt) in enumerate(rows):
        engine.add_request(str(i), prompt, params, lora_request=lora)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step()})
    metrics = engine.get_metrics()
    assert metrics["num_preemptions"] > 0 and metrics["prefix_cache_hits"] > 0
    assert (4, True) in most_in_a_step  # 4 adapters and base rows in one step
    outputs = [finished[str(i)] for i in range(len(rows))]
    for (lora, _), output in zip(rows, outputs, strict=True):
        assert output.error is None and len(output.token_ids) == MAX_NEW_TOKENS[dtype]
        assert output.lora_name == (lora.lora_name if lora else None)

    def tokens_of(lora):
        return [out.token_ids for (row_lora, _), out in zip(rows, outputs, strict=True) if row_lora == lora]

    for lora in requests[1:]:
        assert tokens_of(lora) != tokens_of(None)  # the adapter changes what the base model says
    for index, lora in enumerate(requests):
        pairs = [(prompt, output.token_ids) for (row_lora, prompt), output in zip(rows, outputs, strict=True)
                 if row_lora == lora]
        reference_dir = base_dir if lora is None else str(adapters[index - 1][1])
        model = engine.model if lora is None else WithAdapter(engine.model, engine.lora.slot_of(lora))
        if dtype == "float32":
            assert_greedy_by_teacher_forcing(pairs, reference_dir, model)
        else:
            low = hf_model(base_dir, torch.bfloat16) if lora is None else \
                peft_model(base_dir, str(adapters[index - 1][0]))
            assert_no_worse_than_reference(pairs, low, hf_model(reference_dir), torch.bfloat16,
                                           LORA_MIN_AGREEMENT, LORA_DEFICIT_FACTOR)


def peft_model(base_dir: str, adapter_dir: str) -> torch.nn.Module:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16)
    # The adapter in bf16 too, as the engine holds it (peft otherwise computes the update in fp32).
    return PeftModel.from_pretrained(base, adapter_dir, autocast_adapter_dtype=False).eval()
