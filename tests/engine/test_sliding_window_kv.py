"""Sliding-window layers in the paged KV cache, end to end, token-exact against transformers (fp32).

- Every layer slides (Phi-4-mini-like: Phi-3 with partial rotary and a 24-token window on every
  layer): blocks behind the window go back to the pool while requests run, and outputs stay
  transformers' under prefix-cache hits, chunked prefill and preemption.
- Mixed layers (the tiny Gemma 3: local layers with a 20-token window, global layers) keep every
  block; its prefix hits, chunked prefill and preemption are in test_llm_correctness's ARCHS.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bulkinfer.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from tests.engine.hf_reference import TEST_DEVICE, assert_same_greedy, hf_greedy
from tests.engine.test_llm_correctness import PROMPTS

WINDOW = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def sliding_phi3(base: Path, out: Path) -> Path:
    """The tiny phi3 checkpoint with a window on every layer and half-head rotary (Phi-4-mini
    rotates 3/4 of each head): same weights, edited config."""
    shutil.copytree(base, out)
    config = json.loads((out / "config.json").read_text())
    rope = config["rope_parameters"]
    rope["partial_rotary_factor"] = 0.5
    rotary_half = config["head_dim"] // 4
    for name in ("short_factor", "long_factor"):
        rope[name] = rope[name][:rotary_half]
    config["sliding_window"] = WINDOW
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def window_dir(checkpoint_factory, tmp_path_factory) -> str:
    return str(sliding_phi3(checkpoint_factory(arch="phi3"), tmp_path_factory.mktemp("phi3") / "window"))


def assert_matches_transformers(model_dir: str, model, outputs) -> None:
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert output.error is None, output.error
        reference = hf_greedy(model_dir, prompt, GREEDY.max_tokens)
        assert_same_greedy(output.token_ids, reference, prompt, model_dir, model)


def test_blocks_behind_the_window_are_freed_while_requests_run(window_dir: str) -> None:
    engine = LLMEngine(EngineConfig(model=window_dir, device=TEST_DEVICE, num_kv_blocks=256, dtype="float32"))
    manager = engine.scheduler.kv_cache_manager
    assert manager.sliding_window == WINDOW
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    finished, dropped_seen = {}, 0
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step()})
        for request in engine.scheduler.running:
            held = manager.num_held_blocks(request)
            dropped_seen = max(dropped_seen, len(request.block_ids) - held)
            if request.num_output_tokens >= 2:  # allocated for a decode at n: keeps positions
                assert held <= 3  # n - 23 .. n + 1, at most 3 blocks of 16, whatever the length
    assert dropped_seen >= 4  # the 100-token prompts gave back most of their blocks
    assert engine.get_metrics()["prefix_cache_hits"] > 0  # shared prefixes hit dropped-but-cached blocks
    assert_matches_transformers(window_dir, engine.model, [finished[str(i)] for i in range(len(PROMPTS))])


@pytest.mark.parametrize("setting", [dict(max_num_batched_tokens=7),
                                     dict(num_kv_blocks=12, kv_growth_reserve_tokens=0)],
                         ids=["chunked-prefill", "preemption"])
def test_token_exact_under_chunked_prefill_and_preemption(window_dir: str, setting: dict) -> None:
    options = {"num_kv_blocks": 256, **setting}
    llm = LLM(model=window_dir, device=TEST_DEVICE, dtype="float32", **options)
    outputs = llm.generate(PROMPTS, GREEDY)
    if "kv_growth_reserve_tokens" in setting:
        assert llm.get_metrics()["num_preemptions"] > 0
    assert_matches_transformers(window_dir, llm.engine.model, outputs)
