"""n > 1: child requests share the prompt's KV blocks through the prefix cache, sample
independently by (seed, index), and come back as one RequestOutput."""

from __future__ import annotations

import random

import pytest

from bulkinfer.engine import LLM, EngineConfig, LLMEngine, SamplingParams

BLOCK = 16


def prompt(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 2048) for _ in range(length)]


@pytest.fixture(scope="module")
def engine(tiny_checkpoint) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_checkpoint), dtype="float32", num_kv_blocks=64))


def run(engine: LLMEngine) -> dict:
    """Step until idle; every output by request id."""
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step()})
    return outputs


def test_children_share_the_full_prompt_blocks_and_own_their_tails(engine):
    tokens = prompt(3 * BLOCK + 5)
    kv = engine.scheduler.kv_cache_manager
    free_before = kv.num_free_blocks
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
    engine.add_request("fan", tokens, params)
    engine.step()  # child 0 computes the prompt; the others wait for its full blocks
    engine.step()  # they are admitted on prefix-cache hits
    children = [engine.scheduler.get_request(f"fan\x1fn{i}") for i in range(4)]
    assert all(c is not None and c.block_ids for c in children)
    shared = children[0].block_ids[:3]
    assert all(c.block_ids[:3] == shared for c in children)
    tails = [block for c in children for block in c.block_ids[3:]]
    assert len(tails) == len(set(tails)) == 4  # one private tail block each
    assert set(tails).isdisjoint(shared)
    assert free_before - kv.num_free_blocks == 3 + 4  # the prompt's full blocks once
    assert [c.num_cached_tokens for c in children[1:]] == [3 * BLOCK] * 3

    [output] = run(engine).values()
    assert output.request_id == "fan" and len(output.outputs) == 4
    assert [o.index for o in output.outputs] == [0, 1, 2, 3]
    assert len({tuple(o.token_ids) for o in output.outputs}) == 4  # independent samples
    assert all(len(o.token_ids) == 6 and o.finish_reason == "length" for o in output.outputs)
    assert output.token_ids == output.outputs[0].token_ids and output.text == output.outputs[0].text
    assert output.num_completion_tokens == 24 and output.num_prompt_tokens == len(tokens)
    assert kv.num_free_blocks == free_before


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_child_i_depends_only_on_seed_and_index(tiny_checkpoint, dtype):
    llm = LLM(model=str(tiny_checkpoint), dtype=dtype, num_kv_blocks=64)
    tokens = prompt(20, seed=1)
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    [three] = llm.generate([tokens], params)
    [two] = llm.generate(
        [tokens], SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    )
    assert [o.token_ids for o in two.outputs] == [o.token_ids for o in three.outputs[:2]]
    # n=1 is sample 0 of the same seed.
    [one] = llm.generate([tokens], SamplingParams(temperature=1.0, seed=5, max_tokens=8, ignore_eos=True))
    assert one.token_ids == three.outputs[0].token_ids and len(one.outputs) == 1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_children_are_identical(tiny_checkpoint, dtype):
    """Identical rows (a job's duplicates) decode side by side to the same tokens and logprobs."""
    llm = LLM(model=str(tiny_checkpoint), dtype=dtype, num_kv_blocks=64)
    params = SamplingParams(n=3, temperature=0.0, max_tokens=5, logprobs=2)
    [output] = llm.generate([prompt(10, seed=2)], params)
    assert len({(tuple(o.token_ids), repr(o.logprobs)) for o in output.outputs}) == 1


def test_aborting_the_parent_aborts_every_child(engine):
    kv = engine.scheduler.kv_cache_manager
    free_before = kv.num_free_blocks
    engine.add_request("gone", prompt(40, seed=3), SamplingParams(n=3, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.abort_request("gone")
    assert not engine.scheduler.has_unfinished_requests()
    [output] = engine.step()
    assert output.finish_reason == "abort" and len(output.outputs) == 3
    assert all(o.finish_reason == "abort" for o in output.outputs)
    assert kv.num_free_blocks == free_before
    assert not engine.abort_request("gone")


def test_an_invalid_request_with_n_fails_once(engine):
    engine.add_request("bad", [], SamplingParams(n=3))
    [output] = engine.step()
    assert output.finish_reason == "error" and output.error == "prompt is empty"
    assert len(output.outputs) == 3 and all(o.finish_reason == "error" for o in output.outputs)
    assert not engine.has_unfinished_requests()


def test_a_prompt_error_with_valid_n_reports_n_outputs(engine):
    engine.add_request("oov", [7, 10**6], SamplingParams(n=2))
    [output] = engine.step()
    assert output.finish_reason == "error" and "vocabulary" in output.error
    assert [o.index for o in output.outputs] == [0, 1]
