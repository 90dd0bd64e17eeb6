"""EngineHost in-process with the tiny model: threaded submit, abort, ordering, failures."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

from bulkinfer.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from bulkinfer.worker.hosts.engine_host import EngineHost, EngineRequest, EngineUnavailable

# dtype pinned: outputs are compared with an fp32 offline engine.
ENGINE_OPTIONS = {"max_model_len": 256, "num_kv_blocks": 64, "max_num_seqs": 16,
                  "dtype": "float32"}
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
PROMPTS = ["def main():", "import os\n", "class Foo(", "the quick brown fox", "return self.", "x = [1, 2,"]
WAIT_S = 60


@pytest.fixture(scope="module")
def host(tiny_checkpoint: Path) -> Iterator[EngineHost]:
    engine_host = EngineHost(lambda: LLMEngine(EngineConfig(model=str(tiny_checkpoint), **ENGINE_OPTIONS)),
                             name="test").start()
    yield engine_host
    engine_host.stop()


@pytest.fixture(scope="module")
def offline_texts(tiny_checkpoint: Path) -> dict[str, str]:
    llm = LLM(str(tiny_checkpoint), **ENGINE_OPTIONS)
    return {output.prompt: output.text for output in llm.generate(PROMPTS, GREEDY)}


def test_outputs_come_back_in_submit_order_and_match_offline_generation(
        host: EngineHost, offline_texts: dict[str, str]) -> None:
    submission = host.submit([EngineRequest(prompt, GREEDY) for prompt in PROMPTS])
    assert submission.wait(WAIT_S)
    outputs = submission.results()
    assert [output.prompt for output in outputs] == PROMPTS
    assert [output.text for output in outputs] == [offline_texts[prompt] for prompt in PROMPTS]
    assert all(output.finish_reason == "length" for output in outputs)


def test_two_threads_submitting_at_once_each_get_their_own_outputs(
        host: EngineHost, offline_texts: dict[str, str]) -> None:
    halves = {"a": PROMPTS[:3] * 2, "b": PROMPTS[3:] * 2}
    results: dict[str, list[str | None]] = {}
    start = threading.Barrier(2)

    def submit_half(name: str) -> None:
        start.wait()
        submission = host.submit([EngineRequest(prompt, GREEDY) for prompt in halves[name]])
        assert submission.wait(WAIT_S)
        results[name] = [output.text for output in submission.results()]

    threads = [threading.Thread(target=submit_half, args=(name,)) for name in halves]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S)
    expected = {name: [offline_texts[prompt] for prompt in prompts] for name, prompts in halves.items()}
    assert results == expected


def test_abort_finishes_unfinished_requests_with_abort(host: EngineHost) -> None:
    endless = SamplingParams(temperature=0.0, max_tokens=240, ignore_eos=True)
    submission = host.submit([EngineRequest("while True:", endless), EngineRequest("for i in", endless)])
    submission.abort()
    assert submission.wait(WAIT_S)
    outputs = submission.results()
    assert [output.finish_reason for output in outputs] == ["abort", "abort"]
    assert all(output.num_completion_tokens < 240 for output in outputs)
    # The host keeps serving after an abort.
    after = host.submit([EngineRequest(PROMPTS[0], GREEDY)])
    assert after.wait(WAIT_S) and after.results()[0].finish_reason == "length"


def test_bad_requests_come_back_as_errors_without_disturbing_others(host: EngineHost) -> None:
    submission = host.submit([EngineRequest("", GREEDY), EngineRequest("a " * 400, GREEDY),
                              EngineRequest(PROMPTS[0], GREEDY)])
    assert submission.wait(WAIT_S)
    empty, too_long, fine = submission.results()
    assert (empty.finish_reason, empty.error) == ("error", "prompt is empty")
    assert too_long.finish_reason == "error" and "max_model_len=256" in (too_long.error or "")
    assert fine.finish_reason == "length"


def test_metrics_are_read_on_the_engine_thread(host: EngineHost) -> None:
    seen: list[str] = []
    metrics = host.call(lambda engine: seen.append(threading.current_thread().name) or engine.get_metrics())
    assert seen == ["engine-test"]
    assert metrics["num_running"] == 0 and metrics["kv_blocks_total"] == ENGINE_OPTIONS["num_kv_blocks"] - 1


def test_a_model_that_fails_to_load_fails_every_submission_with_the_reason(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    broken = EngineHost(lambda: LLMEngine(EngineConfig(model=str(missing))), name="broken")
    submission = broken.submit([EngineRequest("hello", GREEDY)])  # queued before the load even starts
    broken.start()
    with pytest.raises(EngineUnavailable, match="no-such-model"):
        broken.wait_ready(WAIT_S)
    assert submission.wait(WAIT_S)
    with pytest.raises(EngineUnavailable, match="no-such-model"):
        submission.results()
    with pytest.raises(EngineUnavailable):
        broken.submit([EngineRequest("hello", GREEDY)])


def crashing_engine(tiny_checkpoint: Path, crashes_when) -> LLMEngine:  # noqa: ANN001
    """An engine whose step raises whenever `crashes_when(engine)` says so."""
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint), **ENGINE_OPTIONS))
    step = engine.step

    def maybe_crash() -> list:
        if crashes_when(engine):
            raise RuntimeError("kernel exploded")
        return step()

    engine.step = maybe_crash  # type: ignore[method-assign]
    return engine


def test_a_request_that_crashes_the_engine_fails_alone_and_every_other_request_finishes(
        tiny_checkpoint: Path, offline_texts: dict[str, str]) -> None:
    poison = "this prompt breaks a kernel"

    def poison_is_running(engine: LLMEngine) -> bool:
        poison_ids = engine.tokenizer.encode(poison)
        return any(list(parent.prompt_token_ids) == poison_ids for parent in engine._parents.values())

    def load() -> LLMEngine:
        return crashing_engine(tiny_checkpoint, poison_is_running)

    host = EngineHost(load, name="crashing").start()
    try:
        mine = host.submit([EngineRequest(prompt, GREEDY) for prompt in [*PROMPTS[:3], poison, *PROMPTS[3:]]])
        theirs = host.submit([EngineRequest(prompt, GREEDY) for prompt in PROMPTS[:3]])  # another job's
        assert mine.wait(WAIT_S) and theirs.wait(WAIT_S)
        outputs = mine.results()
        failed = outputs[3]
        assert failed.finish_reason == "error" and failed.error is not None
        assert "crashed twice" in failed.error and "kernel exploded" in failed.error
        rest = outputs[:3] + outputs[4:]
        assert [output.text for output in rest] == [offline_texts[prompt] for prompt in PROMPTS]
        assert [output.text for output in theirs.results()] == [offline_texts[p] for p in PROMPTS[:3]]
        assert host.failure is None and host.crashes >= 2
        later = host.submit([EngineRequest(PROMPTS[0], GREEDY)])  # the host goes on serving
        assert later.wait(WAIT_S) and later.results()[0].text == offline_texts[PROMPTS[0]]
    finally:
        host.stop()


def test_a_passing_crash_reruns_the_requests_with_the_same_outputs(
        tiny_checkpoint: Path, offline_texts: dict[str, str]) -> None:
    steps = []

    def first_step_crashes(engine: LLMEngine) -> bool:
        steps.append(1)
        return len(steps) == 3  # mid-generation, once

    host = EngineHost(lambda: crashing_engine(tiny_checkpoint, first_step_crashes), name="flaky").start()
    try:
        submission = host.submit([EngineRequest(prompt, GREEDY) for prompt in PROMPTS])
        assert submission.wait(WAIT_S)
        assert [output.text for output in submission.results()] == [offline_texts[p] for p in PROMPTS]
        assert host.crashes == 1 and host.failure is None
    finally:
        host.stop()


def test_an_engine_that_cannot_be_rebuilt_after_a_crash_fails_the_waiting_submissions(
        tiny_checkpoint: Path) -> None:
    loads = []

    def load() -> LLMEngine:
        loads.append(1)
        if len(loads) > 1:
            raise OSError("weights vanished")
        return crashing_engine(tiny_checkpoint, lambda engine: True)

    crashing = EngineHost(load, name="crashing").start()
    submission = crashing.submit([EngineRequest("hello", GREEDY)])
    assert submission.wait(WAIT_S)
    with pytest.raises(EngineUnavailable, match="weights vanished"):
        submission.results()
    assert isinstance(crashing.failure, OSError)


def test_an_engine_rebuilt_after_a_crash_is_built_once_the_old_one_is_gone(tiny_checkpoint: Path) -> None:
    """On a GPU the old engine's weights and KV cache plus the new one's do not fit: nothing may keep
    the crashed engine alive (the step's traceback, the engine thread's variables) into the rebuild."""
    built: list[weakref.ref[LLMEngine]] = []
    old_engine_alive_at_rebuild: list[bool] = []

    def load() -> LLMEngine:
        if built:
            old_engine_alive_at_rebuild.append(built[-1]() is not None)
        engine = crashing_engine(tiny_checkpoint, lambda _engine: len(built) == 1)  # the first one crashes
        built.append(weakref.ref(engine))
        return engine

    host = EngineHost(load, name="rebuilt").start()
    try:
        submission = host.submit([EngineRequest(PROMPTS[0], GREEDY)])
        assert submission.wait(WAIT_S)
        assert submission.results()[0].finish_reason in ("length", "stop")  # a passing crash: rerun
        assert host.crashes == 1 and len(built) == 2
        assert old_engine_alive_at_rebuild == [False]
    finally:
        host.stop()
