"""Bad requests fail alone: each gets finish_reason="error" and a clear message, the rest are served."""

from __future__ import annotations

import pytest
import torch

from bulkinfer.engine import LLM, EngineConfig, ErrorKind, LLMEngine, SamplingParams
from tests.engine.hf_reference import assert_same_greedy, hf_greedy
from tests.engine.test_llm_correctness import PROMPTS

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


@pytest.fixture(scope="module")
def llm(tiny_checkpoint) -> LLM:
    return LLM(model=str(tiny_checkpoint), dtype="float32", num_kv_blocks=64, max_model_len=128)


def test_bad_requests_fail_alone_in_a_batch(llm, tiny_checkpoint):
    good = [PROMPTS[0], PROMPTS[7], PROMPTS[12]]
    bad = {
        "empty prompt": ([], GREEDY, "empty", ErrorKind.EMPTY_PROMPT),
        "too long": ([7] * 200, GREEDY, "max_model_len", ErrorKind.PROMPT_TOO_LONG),
        "max_tokens -1": ([7, 8, 9], SamplingParams(temperature=0.0, max_tokens=-1), "max_tokens",
                         ErrorKind.INVALID_SAMPLING),
        "out of vocab": ([7, 99999], GREEDY, "vocabulary", ErrorKind.INVALID_PROMPT),
        "negative id": ([7, -3], GREEDY, "negative", ErrorKind.INVALID_PROMPT),
        "not token ids": ([1.5, 2.5], GREEDY, "token ids", ErrorKind.INVALID_PROMPT),
        "bad temperature": ([7, 8], SamplingParams(temperature=-1.0), "temperature",
                            ErrorKind.INVALID_SAMPLING),
        "bad top_p": ([7, 8], SamplingParams(top_p=0.0), "top_p must be in (0, 1]",
                      ErrorKind.INVALID_SAMPLING),
        "two constraints": ([7, 8], SamplingParams(regex="a+", choice=["a"]), "at most one of",
                            ErrorKind.STRUCTURED_OUTPUT),
    }
    prompts = [good[0], *[b[0] for b in bad.values()], *good[1:]]
    params = [GREEDY, *[b[1] for b in bad.values()], GREEDY, GREEDY]
    outputs = llm.generate(prompts, params)
    assert len(outputs) == len(prompts)

    good_outputs = [outputs[0], *outputs[-2:]]
    for prompt, output in zip(good, good_outputs, strict=True):
        assert output.finish_reason == "length" and output.error is None
        reference = hf_greedy(tiny_checkpoint, prompt, GREEDY.max_tokens)
        assert_same_greedy(output.token_ids, reference, prompt, tiny_checkpoint, llm.engine.model)

    for (name, (_, _, expected, kind)), output in zip(bad.items(), outputs[1:-2], strict=True):
        assert output.finish_reason == "error", name
        assert expected in output.error, (name, output.error)
        assert output.error_kind == kind, (name, output.error_kind)
        assert output.token_ids == [] and output.text == "", name


def test_error_is_reported_on_next_step_and_engine_keeps_serving(tiny_checkpoint):
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint), dtype="float32", num_kv_blocks=64,
                                    max_model_len=128))
    engine.add_request("good", PROMPTS[1], GREEDY)
    engine.add_request("bad", [], GREEDY)
    first = engine.step()
    assert [(o.request_id, o.finish_reason) for o in first] == [("bad", "error")]
    assert first[0].error == "prompt is empty" and first[0].error_kind == ErrorKind.EMPTY_PROMPT
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.request_id for o in outputs] == ["good"]
    reference = hf_greedy(tiny_checkpoint, PROMPTS[1], GREEDY.max_tokens)
    assert_same_greedy(outputs[0].token_ids, reference, PROMPTS[1], tiny_checkpoint, engine.model)
    assert engine.get_metrics()["num_errors"] == 1


def test_abort_running_request(tiny_checkpoint):
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint), dtype="float32", num_kv_blocks=64))
    engine.add_request("keep", PROMPTS[2], GREEDY)
    engine.add_request("drop", PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=50))
    engine.step()
    engine.step()
    assert engine.abort_request("drop")
    assert not engine.abort_request("drop")  # already gone
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step()})
    assert outputs["drop"].finish_reason == "abort" and 0 < len(outputs["drop"].token_ids) < 50
    reference = hf_greedy(tiny_checkpoint, PROMPTS[2], GREEDY.max_tokens)
    assert_same_greedy(outputs["keep"].token_ids, reference, PROMPTS[2], tiny_checkpoint, engine.model)
    assert engine.get_metrics()["kv_blocks_used"] == 0  # aborted blocks were freed


def test_duplicate_live_request_id_is_a_caller_error(tiny_checkpoint):
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint), dtype="float32", num_kv_blocks=64))
    engine.add_request("x", PROMPTS[0], GREEDY)
    with pytest.raises(ValueError, match="already"):
        engine.add_request("x", PROMPTS[1], GREEDY)


def test_max_model_len_beyond_the_model_is_rejected(tiny_checkpoint):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLMEngine(EngineConfig(model=str(tiny_checkpoint), dtype="float32", num_kv_blocks=64,
                               max_model_len=100_000))


def test_params_count_must_match_prompts(llm):
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate([[5, 6], [7, 8], [9]], [GREEDY, GREEDY])


def test_request_metrics_are_filled(llm):
    [output] = llm.generate([PROMPTS[4]], GREEDY)
    m = output.metrics
    assert m.time_to_first_token is not None and m.time_to_first_token > 0
    assert m.e2e_latency >= m.time_to_first_token
    assert m.time_per_output_token is not None and m.time_per_output_token > 0
    metrics = llm.get_metrics()
    assert metrics["generation_tokens"] > 0 and metrics["generation_tokens_per_s"] > 0
    assert metrics["num_steps"] > 0 and metrics["kv_blocks_total"] == 63


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_non_finite_logits_fail_that_request_with_a_reason_instead_of_emitting_tokens(tiny_checkpoint, dtype):
    llm = LLM(model=str(tiny_checkpoint), dtype=dtype, num_kv_blocks=64, max_model_len=128)
    bad_token = 11
    clean = [PROMPTS[0], PROMPTS[7]]
    expected = [output.token_ids for output in llm.generate(clean, GREEDY)]
    with torch.no_grad():  # a weight gone NaN (a bad conversion, an fp16 overflow): only this token's row
        llm.engine.model.embed_tokens.weight[bad_token] = float("nan")
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=6)
    poisoned = [[5, bad_token, 9, 14], [bad_token, 20]]
    outputs = llm.generate([clean[0], *poisoned, clean[1]], [GREEDY, GREEDY, sampled, GREEDY])
    for output in outputs[1:3]:
        assert output.finish_reason == "error" and output.token_ids == []
        assert output.error is not None and "non-finite logits" in output.error
        assert output.error_kind == ErrorKind.NON_FINITE_LOGITS
    assert [outputs[0].token_ids, outputs[3].token_ids] == expected
    assert all(output.finish_reason == "length" for output in (outputs[0], outputs[3]))
