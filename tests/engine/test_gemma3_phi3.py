"""Gemma 3 and Phi-3 specifics beyond the shared correctness suites: Phi-3's long-context rotary
past its original context, the Hub's older config formats, what we refuse, Gemma's attention
soft-cap as transformers treats it, and which of them take the native decode path."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from bulkinfer.engine import LLM, SamplingParams, cpu_kernels
from bulkinfer.engine.attention import TorchPagedAttention
from bulkinfer.engine.checkpoints import GEMMA3_SLIDING_WINDOW, PHI3_ORIGINAL_CONTEXT
from bulkinfer.engine.models.gemma3 import parse_gemma3_config
from bulkinfer.engine.models.llama_config import UnsupportedModelError
from bulkinfer.engine.models.loader import load_model, model_config_from_dir
from bulkinfer.engine.models.phi3 import parse_phi3_config
from tests.engine.hf_reference import TEST_DEVICE, assert_same_greedy, hf_greedy, hf_model
from tests.engine.test_model_vs_transformers import run_and_compare
from tests.engine.test_native_decode import native_runs


def edited_copy(base: Path, out: Path, **changes) -> Path:
    shutil.copytree(base, out)
    config = json.loads((out / "config.json").read_text())
    config.update(changes)
    (out / "config.json").write_text(json.dumps(config))
    return out


def hf_stepwise_greedy(model_dir: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' Phi-3 forward with its KV cache, one token a step: each pass picks the factors
    for the positions it computes. (Its ``generate`` also drops the cache when a sequence crosses
    the original context and re-encodes everything with the long factors: see engine/models/phi3.py.)"""
    model = hf_model(model_dir)
    with torch.inference_mode():
        out = model(torch.tensor([prompt]), use_cache=True)
        tokens = [int(out.logits[0, -1].argmax())]
        for step in range(max_new_tokens - 1):
            out = model(torch.tensor([[tokens[-1]]]), cache=out.past_key_values, use_cache=True,
                        position_ids=torch.tensor([[len(prompt) + step]]))
            tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def test_phi3_takes_the_long_factors_from_the_original_context_on(checkpoint_factory):
    """A prompt inside the original context (256), generation past it: every position from 256 on
    is rotated with the long factors and 1/attention factor, as transformers' forward does."""
    model_dir = str(checkpoint_factory(arch="phi3"))
    rng = random.Random(4)
    prompt = [rng.randrange(5, 2048) for _ in range(PHI3_ORIGINAL_CONTEXT - 6)]
    llm = LLM(model=model_dir, device=TEST_DEVICE, dtype="float32", num_kv_blocks=64)
    [output] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert output.token_ids == hf_stepwise_greedy(model_dir, prompt, 16)
    # Inside the original context, transformers' generate agrees too.
    assert output.token_ids[:6] == hf_greedy(model_dir, prompt, 6)
    rotary = llm.engine.model.rotary
    last_short, first_long = (rotary(torch.tensor([p]), torch.float32)[0][0, 0]
                              for p in (PHI3_ORIGINAL_CONTEXT - 1, PHI3_ORIGINAL_CONTEXT))
    factor = rotary.attention_factor
    torch.testing.assert_close(first_long, torch.cos(PHI3_ORIGINAL_CONTEXT * rotary.long) * factor)
    torch.testing.assert_close(last_short, torch.cos((PHI3_ORIGINAL_CONTEXT - 1) * rotary.short) * factor)
    assert not torch.equal(rotary.short, rotary.long)


def test_hub_format_configs_parse_like_transformers_5_ones():
    # google/gemma-3-1b-it's fields (scaled): rope_theta/rope_scaling global, rope_local_base_freq,
    # sliding_window_pattern, no layer_types.
    common = dict(vocab_size=2048, hidden_size=128, intermediate_size=344, num_hidden_layers=12,
                  num_attention_heads=4, num_key_value_heads=1, head_dim=32, max_position_embeddings=2048,
                  rms_norm_eps=1e-6, query_pre_attn_scalar=32, sliding_window=20, eos_token_id=[1, 106])
    hub = parse_gemma3_config("Gemma3ForCausalLM", {
        **common, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "sliding_window_pattern": 6,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "hidden_activation": "gelu_pytorch_tanh"})
    v5 = parse_gemma3_config("Gemma3ForCausalLM", {
        **common, "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 2,
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}})
    assert hub == v5
    assert hub.sliding_windows == ((20,) * 5 + (None,)) * 2
    assert hub.rope_theta == 1e6 and hub.local_rope_theta == 1e4 and hub.rope_scaling["factor"] == 8.0
    assert hub.tie_word_embeddings and hub.eos_token_ids == (1, 106)
    # microsoft/Phi-3-mini-128k-instruct's: rope_scaling type "longrope" (older: "su"), the original
    # context at the top level, no factor (the ratio of the two contexts).
    phi = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096,
               original_max_position_embeddings=1024, rope_theta=10000.0, sliding_window=262144)
    factors = {"short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    old = parse_phi3_config("Phi3ForCausalLM", {**phi, "rope_scaling": {"type": "su", **factors}})
    new = parse_phi3_config("Phi3ForCausalLM", {**phi, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 1024, **factors}})
    assert old == new and old.longrope is not None
    assert old.longrope.attention_factor == pytest.approx((1 + torch.log(torch.tensor(4.0)).item()
                                                           / torch.log(torch.tensor(1024.0)).item()) ** 0.5)
    assert old.sliding_windows == (262144, 262144) and old.rotary_dim == 16


@pytest.mark.parametrize("parse, config, message", [
    (parse_gemma3_config, {"hidden_activation": "relu"}, "hidden_activation 'relu'"),
    (parse_gemma3_config, {"layer_types": ["chunked_attention"] * 2}, "layer types"),
    (parse_phi3_config, {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope scaling type 'dynamic'"),
    (parse_phi3_config, {"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}},
     "longrope factors need 8"),
])
def test_what_we_do_not_serve_is_refused_by_name(parse, config: dict, message: str) -> None:
    base = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    architecture = "Gemma3ForCausalLM" if parse is parse_gemma3_config else "Phi3ForCausalLM"
    with pytest.raises(UnsupportedModelError, match=message):
        parse(architecture, {**base, **config})


def test_gemma3_attention_soft_cap_is_ignored_as_transformers_ignores_it(checkpoint_factory, tmp_path):
    """transformers' Gemma3 reads attn_logit_softcapping but never applies it; neither do we (a cap
    of 1.0 would flatten every attention distribution)."""
    capped = tmp_path / "capped"
    model_dir = edited_copy(checkpoint_factory(arch="gemma3"), capped, attn_logit_softcapping=1.0)
    run_and_compare(model_dir, [{0: 30, 1: 12}, {0: 1, 1: 18}], lengths=[30, 30])


def test_gemma3_local_layers_see_only_their_window(checkpoint_factory):
    """Prompts far longer than the local window, in chunks, against transformers (the window and the
    global layers' full context both matter: a wrong mask on either kind changes the logits)."""
    model_dir = checkpoint_factory(arch="gemma3")
    assert model_config_from_dir(model_dir).sliding_windows == (GEMMA3_SLIDING_WINDOW, None) * 2
    run_and_compare(model_dir, [{0: 50, 1: 13}, {0: 1, 1: 40}], lengths=[50, 53], num_decode_steps=5)


def test_phi3_decodes_on_the_native_path_and_the_others_do_not(checkpoint_factory, tmp_path, monkeypatch):
    kernels = cpu_kernels.load()
    phi3 = str(checkpoint_factory(arch="phi3"))
    llm = LLM(model=phi3, dtype="float32", num_kv_blocks=64)
    if kernels is None or torch.float32 not in kernels.row_gemm_dtypes:
        assert llm.engine.model.native_decode is None  # no row kernel for fp32 on this CPU
        return
    assert llm.engine.model.native_decode is not None  # longrope's cos/sin come from the model
    counts = native_runs(llm, monkeypatch)
    prompt = [5 + i * 7 % 2000 for i in range(40)]
    [output] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert counts["steps"] >= 10
    assert_same_greedy(output.token_ids, hf_greedy(phi3, prompt, 12), prompt, phi3, llm.engine.model)
    # Partial rotary (Phi-4-mini) and Gemma 3's layout are not the native driver's.
    partial = json.loads((Path(phi3) / "config.json").read_text())["rope_parameters"]
    partial = {**partial, "partial_rotary_factor": 0.5, "short_factor": partial["short_factor"][:8],
               "long_factor": partial["long_factor"][:8]}
    for model_dir in (edited_copy(Path(phi3), tmp_path / "partial", rope_parameters=partial),
                      checkpoint_factory(arch="gemma3")):
        model = load_model(model_dir, TorchPagedAttention(kernels=kernels))
        model.use_cpu_kernels(kernels)
        assert model.native_decode is None
