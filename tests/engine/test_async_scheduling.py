"""Async scheduling (engine/device_step.py) gives every row exactly the tokens the synchronous loop
gives: step N+1 is scheduled and launched while step N runs, its decode inputs filled from step N's
sampled ids, across preemption, chunked prefill, prefix-cache hits, aborts, stops and every
sampling option (fp32; the CPU default is batch invariant, so the different step compositions of
the two loops cannot change a bit)."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import time
from pathlib import Path

import pytest

from bulkinfer.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from bulkinfer.engine.device_step import resolve_async_scheduling
from bulkinfer.engine.sampler import SamplingBatch
from bulkinfer.engine.scheduler import Scheduler


def prompts(seed: int = 0, vocab: int = 2048) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(5, vocab) for _ in range(40)]
    out = [shared + [rng.randrange(5, vocab) for _ in range(n)] for n in (1, 9, 17, 30)]
    out += [[rng.randrange(5, vocab) for _ in range(n)] for n in (2, 5, 24, 47, 70)]
    return out


PROMPTS = prompts()


def params_for(i: int, stop_ids: list[int], penalties: bool = False) -> SamplingParams:
    """A mix: greedy and seeded sampling, varied lengths, stop ids the model does emit,
    min_tokens, logprobs; with `penalties`, rows whose counts take a token still on the device."""
    kinds = [
        SamplingParams(temperature=0.0, max_tokens=5 + i),
        SamplingParams(temperature=0.9, top_p=0.8, seed=i, max_tokens=12),
        SamplingParams(temperature=1.0, top_k=20, min_p=0.05, seed=100 + i, max_tokens=9, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=14, min_tokens=2, stop_token_ids=stop_ids),
    ]
    if penalties:
        kinds.append(SamplingParams(temperature=0.7, seed=7 * i, max_tokens=10, presence_penalty=0.5,
                                    repetition_penalty=1.2))
    return kinds[i % len(kinds)]


def run(checkpoint: str, asynchronous: bool, penalties: bool = False,
        **options: object) -> list[tuple[list[int], str | None]]:
    llm = LLM(model=checkpoint, dtype="float32", async_scheduling=asynchronous, **options)
    assert llm.engine.async_scheduling is asynchronous
    # Stop ids each greedy stop row emits after min_tokens: those rows end early, on a stop.
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=6))
    stop_ids = [output.outputs[0].token_ids[4] for output in greedy]
    outputs = llm.generate(PROMPTS, [params_for(i, stop_ids, penalties) for i in range(len(PROMPTS))])
    llm.engine.shutdown()
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outputs]


@pytest.mark.parametrize("options", [
    {"num_kv_blocks": 128},
    # Preemption (a pool too small for every row) and chunked prefill (8-token steps).
    {"num_kv_blocks": 12, "kv_growth_reserve_tokens": 0, "max_num_batched_tokens": 8},
    # Penalty rows: their counts take the token the step in flight samples, on the device.
    {"num_kv_blocks": 128, "penalties": True},
], ids=["plain", "preempt-chunked", "penalties"])
def test_async_rows_get_the_synchronous_tokens(tiny_checkpoint, options, monkeypatch):
    expected = run(str(tiny_checkpoint), False, **options)
    assert "stop" in {reason for _, reason in expected}
    filled = []
    fill = SamplingBatch.fill_placeholders

    def counted(batch, *args):
        filled.append(bool(batch.penalties and batch.penalties.placeholders))
        return fill(batch, *args)

    monkeypatch.setattr(SamplingBatch, "fill_placeholders", counted)
    assert run(str(tiny_checkpoint), True, **options) == expected
    assert any(filled) is bool(options.get("penalties"))  # penalty rows ran ahead with the rest


def test_async_engine_aborts_and_logprobs(tiny_checkpoint):
    """An abort while a step is in flight ends the row with what it had; logprobs and prompt
    logprobs come back as in the synchronous loop."""

    def generate(asynchronous: bool) -> dict[str, object]:
        engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint), dtype="float32", num_kv_blocks=128,
                                        async_scheduling=asynchronous))
        params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, prompt_logprobs=2)
        for i, prompt in enumerate(PROMPTS[:5]):
            engine.add_request(str(i), prompt, params)
        results: dict[str, object] = {}
        steps = 0
        while engine.has_unfinished_requests():
            for output in engine.step():
                completion = output.outputs[0]
                chosen = [(p.chosen.token_id, round(p.chosen.logprob, 5)) for p in completion.logprobs or []]
                results[output.request_id] = (completion.token_ids, completion.finish_reason, chosen,
                                              len(output.prompt_logprobs or []))
            steps += 1
            if steps == 4:
                engine.abort_request("2")
        engine.shutdown()
        return results

    synchronous, asynchronous = generate(False), generate(True)
    assert synchronous["2"][1] == asynchronous["2"][1] == "abort"
    for request_id in ("0", "1", "3", "4"):
        assert asynchronous[request_id] == synchronous[request_id]


def test_async_scheduling_is_the_gpu_default_with_adapters_speculation_and_ranks(tiny_checkpoint):
    """LoRA (the step in flight keeps its adapter slots), speculation (n-gram drafts run ahead,
    others synchronously) and tensor parallel (the other ranks are sent the filled tokens) all
    run async on a GPU by default; on a CPU the "device" is the same cores: off."""
    EngineConfig(model=str(tiny_checkpoint), async_scheduling=True, tensor_parallel_size=2,
                 speculative_config={"method": "ngram", "num_speculative_tokens": 2}).validate()
    config = EngineConfig(model=str(tiny_checkpoint), device="cuda", enable_lora=True,
                          speculative_config={"method": "ngram"})
    assert resolve_async_scheduling(config)
    assert resolve_async_scheduling(dataclasses.replace(config, enable_lora=False, tensor_parallel_size=2))
    assert not resolve_async_scheduling(dataclasses.replace(config, async_scheduling=False))
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint), num_kv_blocks=16))
    assert engine.async_scheduling is False


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculating_rows_get_the_synchronous_tokens_with_steps_without_drafts_run_ahead(
        tiny_checkpoint, method, monkeypatch):
    """Speculation with async scheduling: while more than 3 requests run the gate keeps drafts off
    and steps run ahead; for the tail every step verifies drafts, synchronously (its drafts are read
    from every token sampled so far). Greedy, seeded and stopping rows get the tokens of the
    synchronous loop, and both kinds of step ran."""
    from tests.engine.test_speculative import copy_heavy_prompts

    model = str(tiny_checkpoint)
    speculative = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1} \
        if method == "ngram" else {"method": "draft_model", "model": model, "num_speculative_tokens": 3}
    rows = copy_heavy_prompts() + PROMPTS[:6]
    params = [SamplingParams(temperature=0.0, max_tokens=6 + 3 * i) if i % 3 else
              SamplingParams(temperature=0.8, seed=i, max_tokens=8 + 2 * i) for i in range(len(rows))]
    ran_ahead = []
    commit = Scheduler.commit_in_flight

    def counted(scheduler, output):
        ran_ahead.append(len(output.chunks))
        return commit(scheduler, output)

    monkeypatch.setattr(Scheduler, "commit_in_flight", counted)

    def generate(asynchronous: bool) -> tuple[list[tuple[list[int], str | None]], dict]:
        llm = LLM(model=model, dtype="float32", num_kv_blocks=256, async_scheduling=asynchronous,
                  speculative_config={**speculative, "disable_by_batch_size": 3})
        outputs = llm.generate(rows, params)
        stats = llm.get_metrics()["speculative_decoding"]
        llm.engine.shutdown()
        return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outputs], stats

    expected, _ = generate(False)
    assert not ran_ahead
    got, stats = generate(True)
    assert got == expected
    assert ran_ahead, "no step ran ahead"
    assert stats["steps_on"] > 0 and stats["steps_off"] > 0 and stats["num_draft_tokens"] > 0
    if method == "draft_model":  # the target as its own draft: greedy drafts are accepted
        assert stats["num_accepted_tokens"] > 0


def echoing_checkpoint(base: Path, folder: Path, scale: float = 0.1) -> str:
    """The tiny checkpoint made to repeat itself: lm_head tied to the embeddings and every layer's
    output projections scaled down, so greedy mostly emits its last token again (n-gram drafts
    are accepted) while attention, and so every KV write, still moves the logits a little."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(base, folder)
    weights = load_file(str(folder / "model.safetensors"))
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = tensor * scale
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, str(folder / "model.safetensors"))
    return str(folder)


@pytest.mark.parametrize("options", [
    {"num_kv_blocks": 256},
    {"num_kv_blocks": 14, "kv_growth_reserve_tokens": 0, "max_num_batched_tokens": 12},
], ids=["plain", "preempt-chunked"])
def test_ngram_drafts_run_ahead_and_rows_get_the_synchronous_tokens(tiny_checkpoint, tmp_path, options,
                                                                    monkeypatch):
    """Step N+1 verifies drafts looked up as if step N's were accepted: where they were, the row
    goes on; where step N rejected one, step N+1's chunk of that row is void and it goes on from
    its accepted tokens. On a model that repeats itself (drafts accepted) and the random one
    (drafts rejected), with greedy, seeded, stopping and min_tokens rows, preemption and chunked
    prefill: the synchronous loop's tokens and logprobs, with drafting steps run ahead."""
    from tests.engine.test_speculative import copy_heavy_prompts

    echo = echoing_checkpoint(tiny_checkpoint, tmp_path / "echo")
    rows = copy_heavy_prompts() + PROMPTS[:5]
    ahead, stepped_back = [], []
    commit, step_back = Scheduler.commit_in_flight, Scheduler._step_back

    def counted_commit(scheduler, output):
        ahead.append(sum(bool(chunk.spec_token_ids) for chunk in output.chunks))
        return commit(scheduler, output)

    def counted_step_back(request, num_valid):
        stepped_back.append(request.request_id)
        return step_back(request, num_valid)

    monkeypatch.setattr(Scheduler, "commit_in_flight", counted_commit)
    monkeypatch.setattr(Scheduler, "_step_back", staticmethod(counted_step_back))

    def generate(model: str, asynchronous: bool) -> tuple[list, dict]:
        llm = LLM(model=model, dtype="float32", async_scheduling=asynchronous, **options,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                      "disable_by_batch_size": 64})
        greedy = llm.generate(rows, SamplingParams(temperature=0.0, max_tokens=8))
        stop_ids = [output.outputs[0].token_ids[4] for output in greedy]
        params = [
            [SamplingParams(temperature=0.0, max_tokens=20 + i, logprobs=1),
             SamplingParams(temperature=0.8, seed=i, max_tokens=16),
             SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_ids[i]]),
             # min_tokens keeps the stop id out of the first 3 tokens (drafted positions included).
             SamplingParams(temperature=0.0, max_tokens=24, min_tokens=3,
                            stop_token_ids=[stop_ids[i]])][i % 4]
            for i in range(len(rows))]
        outputs = llm.generate(rows, params)
        stats = llm.get_metrics()["speculative_decoding"]
        llm.engine.shutdown()
        return [(o.outputs[0].token_ids, o.outputs[0].finish_reason,
                 [round(lp.chosen.logprob, 4) for lp in o.outputs[0].logprobs or []]) for o in outputs], stats

    for model in (echo, str(tiny_checkpoint)):
        expected, _ = generate(model, False)
        ahead.clear()
        stepped_back.clear()
        got, stats = generate(model, True)
        assert got == expected
        assert sum(ahead) > 0, "no drafts were verified ahead"
        assert stepped_back, "no rejected draft voided a step launched after it"
        if model == echo:  # drafts verified ahead were accepted, and the rows went on from them
            assert stats["num_accepted_tokens"] > 0 and sum(ahead) > len(stepped_back)
            assert {reason for _, reason, _ in got} == {"stop", "length"}, got


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "ok": {"type": "boolean"}}, "required": ["name", "ok"],
          "additionalProperties": False}


def test_grammar_rows_get_the_synchronous_tokens_with_their_bitmask_handed_over_late(tiny_checkpoint):
    """Grammar rows run ahead too: step N+1's forward pass is launched before step N's tokens are
    known, and its bitmask is handed to its sampling once they are; every token is the one the
    synchronous loop samples, and every finished output parses."""
    params = [SamplingParams(json_schema=SCHEMA, temperature=1.0, seed=i, max_tokens=60) if i % 2 == 0
              else SamplingParams(temperature=0.8, seed=i, max_tokens=20) for i in range(len(PROMPTS))]

    def generate(asynchronous: bool) -> list[tuple[list[int], str | None, str]]:
        llm = LLM(model=str(tiny_checkpoint), dtype="float32", num_kv_blocks=128,
                  async_scheduling=asynchronous)
        handed = []
        fill = llm.engine._hand_bitmask
        llm.engine._hand_bitmask = lambda step: (handed.append(step), fill(step))
        outputs = llm.generate(PROMPTS, params)
        llm.engine.shutdown()
        assert bool(handed) is asynchronous  # the late hand-over did happen
        return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].text) for o in outputs]

    expected = generate(False)
    assert generate(True) == expected
    finished = [text for i, (_, reason, text) in enumerate(expected) if i % 2 == 0 and reason == "stop"]
    assert finished, "no grammar row finished: the test checks nothing"
    for text in finished:
        assert set(json.loads(text)) == {"name", "ok"}


def test_overlapping_steps_are_charged_once(tiny_checkpoint):
    """Usage accounting splits each step's time over its rows; with steps overlapping, a step's
    time is its share of the wall, so the rows together are never charged more than the run took,
    and nothing is left on the device when the engine says it is done."""
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint), dtype="float32", num_kv_blocks=128,
                                    async_scheduling=True))
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=8 + i))
    charged = 0.0
    started = time.monotonic()
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.metrics is not None
            charged += output.metrics.engine_seconds
    wall = time.monotonic() - started
    assert engine._in_flight is None
    assert 0 < charged <= wall * 1.001
    engine.shutdown()


def test_lora_rows_get_the_synchronous_tokens_with_more_adapters_than_slots(checkpoint_factory):
    """Three adapters and the base through 2 slots: adapters are swapped in while a step that reads
    the others is in flight (never into its slots), and rows finish while their adapter's step is
    still in flight (its slot stays held until that step is taken)."""
    from bulkinfer.engine import LoRARequest
    from tests.engine.lora_adapters import make_adapter

    base = str(checkpoint_factory(arch="llama"))
    adapters = [LoRARequest(f"a{i}", i + 1, str(make_adapter(base, 30 + i)[0])) for i in range(3)]
    rows = PROMPTS[:8]
    loras = [adapters[i % 3] if i % 4 != 3 else None for i in range(len(rows))]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=3 + i % 5)
              for i in range(len(rows))]

    def generate(asynchronous: bool) -> tuple[list[list[int]], list[tuple[int, set[int]]]]:
        llm = LLM(model=base, dtype="float32", num_kv_blocks=128, enable_lora=True, max_loras=2,
                  async_scheduling=asynchronous, max_num_batched_tokens=32)
        manager = llm.engine.lora
        # Each slot loaded, beside the slots the step before it (in flight, async) reads.
        loads: list[tuple[int, set[int]]] = []
        begin, slot_of = manager.begin_step, manager.slot_of
        previous: list[set[int]] = [set()]

        def begin_step():
            previous[0] = set(manager._step_slots)
            begin()

        def watched_slot_of(request):
            had = request is not None and request.lora_int_id in manager._slot_of
            slot = slot_of(request)
            if request is not None and not had:
                loads.append((slot, previous[0]))
            return slot

        manager.begin_step, manager.slot_of = begin_step, watched_slot_of
        outputs = llm.generate(rows, params, lora_request=loras)
        llm.engine.shutdown()
        return [output.outputs[0].token_ids for output in outputs], loads

    expected, _ = generate(False)
    tokens, loads = generate(True)
    assert tokens == expected
    assert len(loads) > 2  # adapters were swapped in mid-run
    assert all(slot not in in_flight for slot, in_flight in loads), loads
