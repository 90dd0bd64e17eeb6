"""Values a row may send that no tensor holds as given: they must run (or be that row's error),
never break the step for every request in the engine."""

from __future__ import annotations

from bulkinfer.engine import LLM, SamplingParams


def test_a_top_k_beyond_int64_samples_as_no_top_k_and_leaves_the_engine_working(tiny_checkpoint):
    llm = LLM(model=str(tiny_checkpoint), dtype="float32", num_kv_blocks=64)
    seeded = {"temperature": 1.0, "seed": 7, "max_tokens": 6, "ignore_eos": True}
    huge, off = llm.generate(["hello world", "hello world"],
                             [SamplingParams(top_k=2**64, **seeded), SamplingParams(top_k=-1, **seeded)])
    assert huge.token_ids == off.token_ids and len(huge.token_ids) == 6  # any k past the vocab keeps it all
    # The engine still serves the next requests (it raised on every step after the huge top_k before).
    after = llm.generate(["class A:"], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(after[0].token_ids) == 3
