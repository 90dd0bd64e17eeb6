"""A worker's engine spanning 2 ranks: when a rank dies mid-generation, the host's crash isolation
rebuilds the engine (and its ranks) and every request still gets the tokens one rank gives."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from bulkinfer.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from bulkinfer.worker.hosts.engine_host import EngineHost, EngineRequest

OPTIONS = dict(dtype="float32", num_kv_blocks=64, kv_populate_seconds=0)
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
PROMPTS = ["def main():", "import os\n", "class Foo(", "the quick brown fox"]


def test_a_killed_rank_is_rebuilt_by_the_host_and_the_requests_finish_as_with_one_rank(
        tiny_checkpoint: Path) -> None:
    expected = [output.outputs[0].token_ids
                for output in LLM(str(tiny_checkpoint), **OPTIONS).generate(PROMPTS, GREEDY)]
    built: list[LLMEngine] = []

    def load() -> LLMEngine:
        engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint), tensor_parallel_size=2, **OPTIONS))
        built.append(engine)
        return engine

    host = EngineHost(load, name="tp").start()
    try:
        submission = host.submit([EngineRequest(prompt, GREEDY) for prompt in PROMPTS])

        def kill_a_rank(engine: LLMEngine) -> int:
            pid = engine.parallel.rank_pids[0]
            os.kill(pid, signal.SIGKILL)
            return pid

        assert host.wait_ready(120)
        killed = host.call(kill_a_rank)
        assert submission.wait(120)
        outputs = submission.results()
        assert [output.token_ids for output in outputs] == expected
        assert host.crashes == 1 and len(built) == 2
        assert killed not in built[1].parallel.rank_pids
        assert all(process.poll() is not None for process in built[0].parallel._processes)
    finally:
        host.stop()
        for engine in built:
            engine.shutdown()
