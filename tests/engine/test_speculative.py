"""Speculative decoding (n-gram and draft model) never changes what a request gets.

Every scenario compares an engine with speculation against the same engine without it, on every
architecture, in fp32 and bf16: greedy and seeded outputs are identical token for token; unseeded
sampling keeps the target distribution.
`disable_by_batch_size` keeps speculation on at every batch size, so every step verifies drafts.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from bulkinfer.engine import LLM, EngineConfig, SamplingParams
from bulkinfer.engine.speculative.layer_skip import write_layer_skip_draft
from bulkinfer.engine.speculative.ngram import TokenArrays, propose_ngram
from tests.engine.hf_reference import assert_greedy_within_noise
from tests.engine.test_llm_correctness import ARCHS, DTYPES, MOE_ARCHS, MOE_PROMPTS, NEWER_FAMILIES, PROMPTS

ALWAYS = {"disable_by_batch_size": 1024}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         **ALWAYS}
MAX_TOKENS = {"float32": 24, "bfloat16": 32}


def copy_heavy_prompts(seed: int = 1, vocab: int = 2048) -> list[list[int]]:
    """Prompts that repeat a segment, so prompt lookup finds drafts (some right, some wrong)."""
    rng = random.Random(seed)
    prompts = []
    for length in (5, 9, 14, 20):
        segment = [rng.randrange(5, vocab) for _ in range(length)]
        prompts.append(segment * 3 + segment[: length // 2])
    return prompts


SCENARIO_PROMPTS = PROMPTS + copy_heavy_prompts()


def make_llm(model: str, dtype: str, speculative: dict | None = None, **options) -> LLM:
    options = {"num_kv_blocks": 256, **options}
    return LLM(model=model, dtype=dtype, speculative_config=speculative, **options)


def assert_identical(spec_outputs, base_outputs) -> None:
    """Token for token, with the same finish reasons, in fp32 and bf16 alike: each verified position
    is computed as a lone decode computes it (engine/model_runner.py), so not even bf16 rounding
    differs."""
    for spec, base in zip(spec_outputs, base_outputs, strict=True):
        assert spec.error is None, spec.error
        assert spec.outputs[0].token_ids == base.outputs[0].token_ids
        assert spec.outputs[0].finish_reason == base.outputs[0].finish_reason


def spec_metrics(llm: LLM) -> dict:
    return llm.get_metrics()["speculative_decoding"]


# ---- proposals and settings ----------------------------------------------------------------------


def test_ngram_takes_the_longest_most_recent_match() -> None:
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # Suffix [2, 3]: the longest match (n=2) occurred twice; the most recent is followed by 7, 8.
    assert propose_ngram(tokens, 3, 1, 3) == [7, 8, 5]
    # Suffix [5, 2, 3] (n=3) never occurred before: n=2 wins.
    assert propose_ngram(tokens, 2, 2, 3) == [7, 8]
    assert propose_ngram([4, 5, 6, 4, 5], 4, 1, 2) == [6, 4, 5]  # drafts run up to the end
    assert propose_ngram([1, 2, 3, 4], 3, 1, 3) == []  # the last token never occurred before
    assert propose_ngram([7, 1, 9, 1], 3, 2, 3) == []  # only a 1-gram matches, below the minimum
    assert propose_ngram([3, 3, 3, 3], 2, 1, 3) == [3]  # the most recent match ends just before the end


def test_ngram_matches_a_plain_search_on_any_tokens() -> None:
    """The byte search against the definition, on small vocabularies (many overlapping and
    misaligned matches) and ids near 2**31."""
    def plain(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
        for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
            for start in range(len(tokens) - 1 - n, -1, -1):  # most recent first, ending before the last
                if tokens[start:start + n] == tokens[len(tokens) - n:]:
                    return tokens[start + n:start + n + k]
        return []

    rng = random.Random(3)
    for _ in range(3000):
        vocab = rng.choice([2, 3, 300, 2**20, 2**31 - 1])
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
        k, n_min = rng.randint(1, 5), rng.randint(1, 3)
        n_max = rng.randint(n_min, 6)
        assert propose_ngram(tokens, k, n_min, n_max) == plain(tokens, k, n_min, n_max), tokens
    # Bytes across a token boundary are no match: 0x01000000 then 0 hold 1's bytes (01 00 00 00).
    assert propose_ngram([1, 5, 0x01000000, 0, 1], 1, 1, 1) == [5]


def test_the_lookups_token_arrays_follow_each_sequence_as_it_grows_and_start_over_if_it_changed() -> None:
    arrays = TokenArrays()
    tokens = list(range(50))
    for grown in (50, 51, 130, 131):  # appended to, past the buffer's first size
        tokens += [7] * (grown - len(tokens))
        assert arrays.of("a", tokens).tolist() == tokens
    assert arrays.of("b", [1, 2]).tolist() == [1, 2]  # each request its own
    shorter = tokens[:100] + [9, 9]  # a sequence cut back and grown again (never while it runs)
    assert arrays.of("a", shorter).tolist() == shorter
    changed = shorter[:-1] + [8, 4]  # a reused id whose tokens differ where the array ended
    assert arrays.of("a", changed).tolist() == changed
    arrays.release("a")
    assert arrays.of("a", [3]).tolist() == [3]


@pytest.mark.parametrize("bad, message", [
    ({"method": "medusa"}, "method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min (4) exceeds"),
    ({"method": "draft_model"}, "speculative_config.model (the draft checkpoint) is required"),
    ({"method": "ngram", "lookahead": 3}, "unknown key 'lookahead'"),
])
def test_bad_settings_are_refused_by_name(bad: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        EngineConfig(model="m", speculative_config=bad).validate()
    assert message in str(info.value)


def test_a_draft_model_must_share_the_vocabulary(checkpoint_factory) -> None:
    target = str(checkpoint_factory())
    draft = str(checkpoint_factory(preset="small"))
    with pytest.raises(ValueError, match="must share the tokenizer"):
        make_llm(target, "float32", {"method": "draft_model", "model": draft})


# ---- greedy: identical, on every arch and dtype -----------------------------------------------------


@pytest.fixture(scope="module", params=[arch for arch in ARCHS if arch not in NEWER_FAMILIES])
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def layer_skip(checkpoint_factory, tmp_path_factory):
    """`layer_skip(arch)`: a draft of the tiny checkpoint's first 3 of 4 layers, which agrees with
    it often but not always."""

    def make(arch: str = "llama") -> str:
        out = tmp_path_factory.getbasetemp() / f"draft-{arch}"
        if not out.exists():
            write_layer_skip_draft(checkpoint_factory(arch=arch), out, 3)
        return str(out)

    return make


def same_model_draft(model: str, k: int = 3) -> dict:
    """The target as its own draft: its greedy token is drafted, so sampling accepts often."""
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k, **ALWAYS}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_is_identical_with_speculation(checkpoint_factory, layer_skip, arch: str, dtype: str,
                                              method: str) -> None:
    assert_greedy_identical_with_speculation(checkpoint_factory, layer_skip, arch, dtype, method)


# One method each for the newer families (suite time): Gemma 3's layer-skip draft keeps the first
# layers' local/global kinds; Phi-3 decodes on the native path between n-gram verifications.
@pytest.mark.parametrize("newer_arch, method", [("gemma3", "draft_model"), ("phi3", "ngram")])
def test_greedy_is_identical_with_speculation_on_the_newer_families(checkpoint_factory, layer_skip,
                                                                     newer_arch: str, method: str) -> None:
    assert_greedy_identical_with_speculation(checkpoint_factory, layer_skip, newer_arch, "float32", method)


def assert_greedy_identical_with_speculation(checkpoint_factory, layer_skip, arch: str, dtype: str,
                                             method: str) -> None:
    target = str(checkpoint_factory(arch=arch))
    speculative = NGRAM if method == "ngram" else {
        "method": "draft_model", "model": layer_skip(arch), "num_speculative_tokens": 3, **ALWAYS}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS[dtype], ignore_eos=True)
    base_llm = make_llm(target, dtype)
    base = base_llm.generate(SCENARIO_PROMPTS, params)
    base_again = base_llm.generate(SCENARIO_PROMPTS, params)
    llm = make_llm(target, dtype, speculative)
    first = llm.generate(SCENARIO_PROMPTS, params)
    # The whole prompts now hit the prefix cache (in bf16, recomputing a prompt's last tokens alone
    # rounds differently from prefilling it whole, so the second runs are compared with each other).
    again = llm.generate(SCENARIO_PROMPTS, params)
    assert llm.get_metrics()["prefix_cache_hits"] > 0
    assert_identical(first, base)
    assert_identical(again, base_again)
    stats = spec_metrics(llm)
    assert stats["num_draft_tokens"] > stats["num_accepted_tokens"] > 0  # accepted and rejected drafts


def test_the_same_model_as_draft_accepts_everything(tiny_checkpoint) -> None:
    target = str(tiny_checkpoint)
    spec = {"method": "draft_model", "model": target, "num_speculative_tokens": 3, **ALWAYS}
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    base = make_llm(target, "float32").generate(PROMPTS, params)
    llm = make_llm(target, "float32", spec)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == [
        o.outputs[0].token_ids for o in base]
    stats = spec_metrics(llm)
    assert stats["acceptance_rate"] == 1.0
    assert stats["acceptance_rate_per_position"] == [1.0, 1.0, 1.0]
    # 4 tokens per verification, except where max_tokens left room for fewer drafts.
    assert 3.5 < stats["mean_accepted_length"] <= 4.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_chunked_prefill_preemption_and_max_tokens_mid_proposal(tiny_checkpoint, layer_skip, dtype: str,
                                                                method: str) -> None:
    """A 24-token budget chunks the prompts and cuts drafts to what fits; 20 blocks for 22 requests
    force preemptions (a preempted request's draft KV is rebuilt from position 0); max_tokens of 1-6
    end requests inside a proposal's reach."""
    target = str(tiny_checkpoint)
    options = {"num_kv_blocks": 20, "max_num_batched_tokens": 24, "kv_growth_reserve_tokens": 0}
    prompts = SCENARIO_PROMPTS
    params = [SamplingParams(temperature=0.0, max_tokens=1 + i % 6 if i % 3 else 30, ignore_eos=True)
              for i in range(len(prompts))]
    base = make_llm(target, dtype, **options).generate(prompts, params)
    speculative = NGRAM if method == "ngram" else {
        "method": "draft_model", "model": layer_skip("llama"), "num_speculative_tokens": 3, **ALWAYS}
    llm = make_llm(target, dtype, speculative, **options)
    outputs = llm.generate(prompts, params)
    assert llm.get_metrics()["num_preemptions"] > 0
    if method == "draft_model":
        assert spec_metrics(llm)["num_accepted_tokens"] > 0
    if dtype == "float32":
        assert_identical(outputs, base)
    else:
        # Drafts take blocks, so requests are preempted at other moments than without them, and a
        # preempted request recomputes its tokens as a prefill, which rounds differently from the
        # decodes that first computed them in bf16 (with or without speculation). So bf16 is held
        # to the engine's own standard against transformers: >= 90% its argmax, the rest near-ties.
        pairs = [(list(p), o.outputs[0].token_ids) for p, o in zip(prompts, outputs, strict=True)]
        assert_greedy_within_noise(pairs, target, llm.engine.model, torch.bfloat16)
    for output, p in zip(outputs, params, strict=True):
        assert len(output.outputs[0].token_ids) == p.max_tokens


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_mixture_of_experts_greedy_is_identical_with_a_draft_model(checkpoint_factory, layer_skip,
                                                                   arch: str) -> None:
    """Token for token in bf16: a verified draft row's router and experts give the bits a lone decode
    gives (engine/models/moe.py), so no routing decision differs with speculation."""
    target = str(checkpoint_factory(arch=arch))
    prompts = MOE_PROMPTS[:6] + copy_heavy_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    base = make_llm(target, "bfloat16").generate(prompts, params)
    speculative = {"method": "draft_model", "model": layer_skip(arch), "num_speculative_tokens": 3, **ALWAYS}
    llm = make_llm(target, "bfloat16", speculative)
    outputs = llm.generate(prompts, params)
    assert_identical(outputs, base)
    stats = spec_metrics(llm)
    assert stats["num_draft_tokens"] > stats["num_accepted_tokens"] > 0


# ---- what ends a request, and what it reports --------------------------------------------------------


def test_stops_and_logprobs_are_those_of_decoding(tiny_checkpoint) -> None:
    """Stop strings and stop token ids met on an accepted draft drop the tokens after it (the
    target as its own draft: greedy drafts are all accepted, so stops fall inside them)."""
    target = str(tiny_checkpoint)
    base_llm = make_llm(target, "float32")
    llm = make_llm(target, "float32", same_model_draft(target, k=4))
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    runs = base_llm.generate(SCENARIO_PROMPTS, greedy)
    cases = []
    for prompt, run in zip(SCENARIO_PROMPTS, runs, strict=True):
        tokens = run.outputs[0].token_ids
        text = run.outputs[0].text
        stop_text = text[len(text) // 2 : len(text) // 2 + 3]
        cases.append((prompt, SamplingParams(temperature=0.0, max_tokens=30, stop=[stop_text], logprobs=2)))
        cases.append((prompt, SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[tokens[7]])))
        cases.append((prompt, SamplingParams(temperature=0.0, max_tokens=30, stop=[stop_text],
                                             include_stop_str_in_output=True, min_tokens=5)))
    prompts = [c[0] for c in cases]
    params = [c[1] for c in cases]
    expected = base_llm.generate(prompts, params)
    got = llm.generate(prompts, params)
    stopped_early = 0
    for want, have in zip(expected, got, strict=True):
        w, h = want.outputs[0], have.outputs[0]
        assert (h.token_ids, h.text, h.finish_reason, h.stop_reason) == (w.token_ids, w.text, w.finish_reason,
                                                                        w.stop_reason)
        if w.logprobs is not None:
            assert len(h.logprobs) == len(w.logprobs) == len(w.token_ids)
            for a, b in zip(h.logprobs, w.logprobs, strict=True):
                assert [t.token_id for t in a.top] == [t.token_id for t in b.top]
                assert a.chosen.logprob == pytest.approx(b.chosen.logprob, abs=1e-4)
        stopped_early += w.finish_reason == "stop"
    assert stopped_early > len(cases) // 2
    assert spec_metrics(llm)["num_accepted_tokens"] > 0


def test_structured_output_with_drafts_the_grammar_refuses(tiny_checkpoint, checkpoint_factory) -> None:
    """A draft model with other weights proposes tokens the JSON grammar refuses; the output is
    the one decoding gives, and valid."""
    import json

    target = str(tiny_checkpoint)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    spec = {"method": "draft_model", "model": str(checkpoint_factory(seed=1)), **ALWAYS,
            "num_speculative_tokens": 3}  # other weights: its drafts are mostly wrong, often not JSON
    ngram_llm = make_llm(target, "float32", NGRAM)
    draft_llm = make_llm(target, "float32", spec)
    base_llm = make_llm(target, "float32")
    prompts = ["Person: " + " ".join(str(i) for i in range(n)) for n in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=120, json_schema=schema)
    expected = base_llm.generate(prompts, params)
    for llm in (ngram_llm, draft_llm):
        got = llm.generate(prompts, params)
        for want, have in zip(expected, got, strict=True):
            assert have.outputs[0].token_ids == want.outputs[0].token_ids
            if want.outputs[0].finish_reason == "stop":
                json.loads(have.outputs[0].text)
    refused = ngram_llm.engine._grammars.manager.num_drafts_refused
    assert refused > 0, "no draft was refused by the grammar: the scenario tests nothing"


# ---- sampling --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_seeded_sampling_is_identical(tiny_checkpoint, dtype: str) -> None:
    target = str(tiny_checkpoint)
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, seed=s, max_tokens=24, ignore_eos=True,
                             repetition_penalty=r)
              for s, (t, k, p, r) in enumerate([(0.7, 0, 1.0, 1.0), (1.0, 20, 1.0, 1.0), (0.5, 0, 0.9, 1.1),
                                                (0.3, 5, 1.0, 1.0)] * 5)]
    prompts = (copy_heavy_prompts() * 5)[: len(params)]
    base = make_llm(target, dtype).generate(prompts, params)
    for speculative in (NGRAM, same_model_draft(target)):
        llm = make_llm(target, dtype, speculative)
        assert_identical(llm.generate(prompts, params), base)
        if speculative is not NGRAM:  # random weights rarely repeat themselves: lookups seldom hit
            assert spec_metrics(llm)["num_accepted_tokens"] > 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_unseeded_sampling_keeps_the_target_distribution(tiny_checkpoint, dtype: str) -> None:
    """400 unseeded samples per engine (different engine seeds, so different draws): the token
    histogram at each drafted position matches decoding's within a chi-square test at p = 0.001."""
    target = str(tiny_checkpoint)
    prompt = copy_heavy_prompts()[0]
    params = SamplingParams(temperature=1.0, top_k=4, max_tokens=6, ignore_eos=True)
    base = make_llm(target, dtype, seed=1, num_kv_blocks=512).generate([prompt] * 400, params)
    llm = make_llm(target, dtype, same_model_draft(target), seed=2, num_kv_blocks=512)
    got = llm.generate([prompt] * 400, params)
    assert spec_metrics(llm)["num_accepted_tokens"] > 100
    for position in range(1, 6):
        want = [o.outputs[0].token_ids[position] for o in base]
        have = [o.outputs[0].token_ids[position] for o in got]
        assert chi_square_p(want, have) > 0.001, (position, sorted(want)[:20], sorted(have)[:20])


def chi_square_p(a: list[int], b: list[int]) -> float:
    """p-value of a two-sample chi-square test of equal distributions (categories with fewer than
    10 samples pooled), by the Wilson-Hilferty approximation of the chi-square tail."""
    categories = sorted(set(a) | set(b))
    counts = [(a.count(c), b.count(c)) for c in categories]
    common = [pair for pair in counts if sum(pair) >= 10]
    rare = [pair for pair in counts if sum(pair) < 10]
    if rare:
        common.append((sum(x for x, _ in rare), sum(y for _, y in rare)))
    if len(common) < 2:
        return 1.0
    n_a, n_b = len(a), len(b)
    statistic = 0.0
    for x, y in common:
        total = x + y
        for observed, n in ((x, n_a), (y, n_b)):
            expected = total * n / (n_a + n_b)
            statistic += (observed - expected) ** 2 / expected
    k = len(common) - 1
    z = ((statistic / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


# ---- when it runs -----------------------------------------------------------------------------------


def test_a_batch_limit_keeps_speculation_for_the_tail(tiny_checkpoint) -> None:
    """With at most 2 running requests speculating, 12 requests of different lengths decode
    without drafts until the last two remain."""
    target = str(tiny_checkpoint)
    llm = make_llm(target, "float32", {**same_model_draft(target), "disable_by_batch_size": 2})
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 6 * i, ignore_eos=True) for i in range(12)]
    llm.generate(copy_heavy_prompts() * 3, params)
    stats = spec_metrics(llm)
    assert stats["steps_off"] >= 4 * 5  # the first steps run 12..3 requests: no drafts
    assert stats["steps_on"] > 0 and stats["num_draft_tokens"] > 0


# ---- the scheduler's side: slots for drafts, rollback, caching ----------------------------------------


def test_drafts_get_slots_that_go_back_when_rejected_and_only_accepted_tokens_are_cached() -> None:
    from bulkinfer.engine.request import Request
    from bulkinfer.engine.scheduler import Scheduler

    # Without batch invariance, which caches only blocks wholly inside the prompt.
    config = EngineConfig(model="m", block_size=4, max_num_batched_tokens=64, batch_invariant=False)
    scheduler = Scheduler(config, num_kv_blocks=16, eos_token_id=None)
    request = Request("r", list(range(10, 16)), SamplingParams(max_tokens=50, ignore_eos=True))
    scheduler.add_request(request)
    scheduler.update_from_output(scheduler.schedule(), {"r": 1})  # prefill 6 tokens, sample 1
    pool = scheduler.kv_cache_manager.block_pool
    free_before = pool.num_free_blocks
    assert len(request.block_ids) == 2  # 7 tokens known, 6 computed

    request.spec_token_ids = [2, 3, 4, 5, 6, 7]  # 1 + 6 positions: slots up to position 12
    output = scheduler.schedule()
    [chunk] = output.chunks
    assert chunk.spec_token_ids == (2, 3, 4, 5, 6, 7) and chunk.num_new_tokens == 7
    assert len(request.block_ids) == 4 and pool.num_free_blocks == free_before - 2
    # Drafts 2 and 3 accepted, then the target's own 9: three tokens, 9 and 10 computed.
    scheduler.update_from_output(output, {"r": [2, 3, 9]})
    assert request.output_token_ids == [1, 2, 3, 9]
    assert request.num_computed_tokens == 9 and request.num_tokens == 10
    assert len(request.block_ids) == 3 and pool.num_free_blocks == free_before - 1  # the 4th went back
    cached = scheduler.kv_cache_manager._num_cached_blocks["r"]
    assert cached == 2  # blocks of computed accepted tokens only: [10..13], [14, 15, 1, 2]
    hashes = scheduler.kv_cache_manager.block_hashes(request)
    assert all(pool.get_cached_block(hashes[i], request.all_token_ids[4 * i: 4 * i + 4],
                                     hashes[i - 1] if i else None) is not None for i in range(2))


def test_drafts_fit_the_budget_and_max_tokens_and_never_preempt() -> None:
    from bulkinfer.engine.request import Request
    from bulkinfer.engine.scheduler import Scheduler

    config = EngineConfig(model="m", block_size=4, max_num_batched_tokens=3)
    scheduler = Scheduler(config, num_kv_blocks=3, eos_token_id=None)  # 2 usable blocks: 8 slots
    request = Request("r", [10, 11, 12], SamplingParams(max_tokens=3, ignore_eos=True))
    scheduler.add_request(request)
    scheduler.update_from_output(scheduler.schedule(), {"r": 1})
    request.spec_token_ids = [5, 6, 7, 8]
    [chunk] = scheduler.schedule().chunks
    assert chunk.spec_token_ids == (5,)  # max_tokens=3: one output so far, room for 2 more = 1 draft
    other = Request("o", [20, 21, 22, 23, 24, 25, 26], SamplingParams(max_tokens=5, ignore_eos=True))
    scheduler2 = Scheduler(config, num_kv_blocks=3, eos_token_id=None)
    scheduler2.add_request(other)
    scheduler2.update_from_output(scheduler2.schedule(), {})  # a 3-token prefill chunk
    scheduler2.update_from_output(scheduler2.schedule(), {})
    scheduler2.update_from_output(scheduler2.schedule(), {"o": 1})  # 8 tokens known: 2 blocks full
    other.spec_token_ids = [2, 3]
    [chunk] = scheduler2.schedule().chunks
    assert chunk.spec_token_ids == () and scheduler2.num_preemptions == 0  # no block for drafts
