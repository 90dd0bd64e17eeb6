"""`bulkinfer bench host`: how long the host keeps the device waiting, measured without a device.

The engine runs for real (scheduler, batch preparation, sampling settings, token bookkeeping,
detokenization, output assembly) on SmolLM2's tokenizer, but the forward pass and the sampler are
a stand-in (`SimulatedDevice`) that holds for `--device-ms` without the GIL, as a GPU step does,
and hands back only what a device would: one sampled id per row (from a fixed English text, or the
first token a row's grammar allows), and logprobs where asked. Per case it prints:

- host ms / step: the engine thread's CPU time per step (schedule + prepare + process);
- wall ms / step;
- exposed ms / step: wall minus the device time, the host work the device waited for (the
  critical path);
- for the synchronous loop (today's) and the async one (step N+1 prepared while step N runs).

Kinds: `decode` (every row decoding), `mixed` (rows finish and new prompts of ~220 tokens take
their place, so steps carry prefill chunks), `structured` (every row under a JSON schema: its
bitmask needs its last token), `ngram` (n-gram speculation on in every step, as where verifying
drafts costs the device little; a copy task: the text the outputs follow is in each prompt, so
drafts are accepted). tokens / step counts the tokens a step gives (accepted drafts included).
`--json` prints one record per case.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from bulkinfer.engine.device_step import SampledStep
from bulkinfer.engine.model_runner import ModelRunner
from bulkinfer.engine.sampler import RowLogprobs, SamplingBatch
from bulkinfer.engine.scheduler import SchedulerOutput
from bulkinfer.engine.step_batch import PreparedStep

DEFAULT_MODEL = "smollm2-135m-instruct"
KINDS = ("decode", "mixed", "structured", "ngram")
# Outputs come from this text's tokens, so detokenization sees ordinary words.
TEXT = ("The quarterly report shows revenue grew by twelve percent, driven by strong demand in the "
        "northern region, while costs stayed flat. Customers praised the faster delivery times and "
        "the new support portal; complaints fell to their lowest level in three years. ")
SCHEMA = {"type": "object", "properties": {"summary": {"type": "string"}, "score": {"type": "integer"}},
          "required": ["summary", "score"]}


class SimulatedDevice:
    """The device side of a step, simulated: the real host preparation, then `device_ms` of
    sleeping (no GIL held) in place of the forward pass and sampling, and ids a device would
    return."""

    def __init__(self, runner: ModelRunner, device_ms: float, text_ids: Sequence[int]) -> None:
        self.runner = runner
        self.device_ms = device_ms
        self.text_ids = list(text_ids)
        self.busy_s = 0.0  # device time spent
        self.bitmask_wait_s = 0.0  # time the device waited for a grammar bitmask from the host
        self._text = np.asarray(self.text_ids, dtype=np.int64)
        # Per request: where its output starts in the text, less its prompt length (so a sampled
        # position p gives the text's token at offset + p + 1).
        self._offset: dict[str, int] = {}
        self._lock = threading.Lock()

    def prepare_step(self, output: SchedulerOutput) -> PreparedStep:
        for chunk in output.chunks:
            request_id = chunk.request.request_id
            if request_id not in self._offset:
                start = hash(request_id) % len(self.text_ids)
                self._offset[request_id] = start - chunk.request.num_prompt_tokens
        return self.runner.prepare_step(output)

    def sample_step(self, prepared: PreparedStep, batch: SamplingBatch, sampled_rows: Sequence[str],
                    previous: SampledStep | None = None) -> SampledStep:
        started = time.perf_counter()
        # What the device will hand back, chosen before it "runs" (the GIL held only briefly): as a
        # model would, the token at each sampled position (a drafted one included) is the text's
        # token at that output position, so n-gram drafts are accepted where they follow the text.
        assert prepared.batch is not None
        # In a few numpy calls, not per row: a device's sampling holds no GIL, and the GIL this
        # thread takes is time the host loses.
        positions = prepared.batch.positions[prepared.batch.sample_rows[: len(sampled_rows)]].numpy()
        offsets = np.fromiter(map(self._offset.__getitem__, sampled_rows), dtype=np.int64,
                              count=len(sampled_rows))
        tokens = self._text[(offsets + positions + 1) % len(self._text)].tolist()
        time.sleep(max(0.0, self.device_ms / 1e3 - (time.perf_counter() - started)))
        waited = time.perf_counter()
        batch.resolve_bitmask()  # a grammar bitmask the host fills while the "forward pass" runs
        waited = time.perf_counter() - waited
        if batch.bitmask is not None:
            tokens = allowed_tokens(batch.bitmask.numpy(), tokens)
        logprobs: list[RowLogprobs | None] = [None] * len(tokens)
        for row, k in zip(batch.logprob_rows, batch.num_logprobs, strict=True):
            logprobs[row] = RowLogprobs(tokens[row], -0.5, [tokens[row]] * k, [-0.5] * k, 1)
        with self._lock:
            self.busy_s += time.perf_counter() - started - waited
            self.bitmask_wait_s += waited
        return SampledStep(tokens, logprobs)


def allowed_tokens(bitmask: np.ndarray, preferred: list[int]) -> list[int]:
    """Each row's preferred token where its grammar allows it, else the lowest allowed id (what a
    masked argmax of a model that likes the preferred token would give)."""
    words = bitmask[: len(preferred)].view(np.uint32).astype(np.int64)
    tokens = np.array(preferred, dtype=np.int64)
    rows = np.arange(len(tokens))
    allowed = (words[rows, tokens >> 5] >> (tokens & 31)) & 1
    first_word = np.argmax(words != 0, axis=1)  # a row with no token allowed takes id 0
    word = words[rows, first_word]
    lowest_bit = np.log2(word & -word, where=word > 0, out=np.zeros(len(word))).astype(np.int64)
    return np.where(allowed == 1, tokens, first_word * 32 + lowest_bit).tolist()


@dataclass
class Case:
    kind: str
    rows: int
    device_ms: float
    mode: str  # "sync" or "async"
    host_ms: float
    wall_ms: float
    exposed_ms: float  # wall less the device's busy time: what the device waited for
    busy_ms: float  # the stand-in's measured time per step (D, and its sleep's overshoot)
    bitmask_wait_ms: float  # of the exposed time, waiting for grammar bitmasks (structured)
    steps: int
    tokens_per_step: float = 0.0  # tokens generated per step (n-gram: accepted drafts included)

    @property
    def ratio(self) -> float:
        """Wall over max(device, host), the device's time as measured: 1.0 is the host fully hidden."""
        return self.wall_ms / max(self.busy_ms, self.host_ms)


def run_case(engine: Any, device: SimulatedDevice, kind: str, rows: int, steps: int, mode: str,
             prompt: Callable[[], list[int]], seed: int) -> Case:
    """Fill the engine with `rows` requests, let them all start, then time `steps` steps."""
    from bulkinfer.engine import SamplingParams

    engine.async_scheduling = mode == "async"
    rng = random.Random(seed)
    counter = iter(range(10**9))

    def params() -> SamplingParams:
        if kind == "mixed":  # rows end at varied steps, so new prompts keep arriving
            return SamplingParams(temperature=0.0, max_tokens=rng.randint(16, 96), ignore_eos=True)
        if kind == "structured":
            return SamplingParams(temperature=0.0, max_tokens=10**4, ignore_eos=True, json_schema=SCHEMA)
        return SamplingParams(temperature=0.0, max_tokens=10**4, ignore_eos=True)

    def add() -> None:
        engine.add_request(f"{kind}-{mode}-{next(counter)}", prompt(), params())

    for _ in range(rows):
        add()
    while engine.scheduler.num_waiting or any(not r.output_token_ids for r in engine.scheduler.running):
        for _ in engine.step():
            add()
    engine.step()  # the pipeline full
    busy_before, bitmask_before = device.busy_s, device.bitmask_wait_s
    tokens_before = engine.counters.generation_tokens
    cpu_before, wall_before = time.thread_time(), time.perf_counter()
    for _ in range(steps):
        for _ in engine.step():
            if kind == "mixed":
                add()
    wall = (time.perf_counter() - wall_before) / steps * 1e3
    host = (time.thread_time() - cpu_before) / steps * 1e3
    busy = (device.busy_s - busy_before) / steps * 1e3
    bitmask_wait = (device.bitmask_wait_s - bitmask_before) / steps * 1e3
    tokens = (engine.counters.generation_tokens - tokens_before) / steps
    for request in list(engine.scheduler.running) + list(engine.scheduler.waiting):
        engine.abort_request(request.request_id)
    while engine.has_unfinished_requests():
        engine.step()
    return Case(kind, rows, device.device_ms, mode, round(host, 3), round(wall, 3),
                round(max(0.0, wall - busy), 3), round(busy, 3), round(bitmask_wait, 3), steps,
                round(tokens, 2))


def bench_cli(argv: list[str] | None = None, resolve_model: Callable[[str], str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bulkinfer bench host", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="whose tokenizer and shapes (a folder, a "
                        "catalog name or a .gguf file)")
    parser.add_argument("--device-ms", type=float, default=5.0, help="the stand-in device's time per step")
    parser.add_argument("--rows", default="64,256,512", help="comma-separated row counts")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    parser.add_argument("--modes", default="sync,async", help="comma-separated: sync (today's loop), async")
    parser.add_argument("--steps", type=int, default=30, help="steps timed per case")
    parser.add_argument("--json", action="store_true", help="print one JSON record per case instead")
    args = parser.parse_args(argv)
    kinds = args.kinds.split(",")
    if unknown := set(kinds) - set(KINDS):
        parser.error(f"unknown kinds {sorted(unknown)}; choose from {', '.join(KINDS)}")
    modes_asked = args.modes.split(",")
    if unknown := set(modes_asked) - {"sync", "async"}:
        parser.error(f"unknown modes {sorted(unknown)}; choose from sync, async")
    row_counts = [int(r) for r in args.rows.split(",")]
    model_dir = resolve_model(args.model) if resolve_model else args.model
    cases = []
    for kind in kinds:
        engine, device = build_engine(model_dir, kind, max(row_counts), args.device_ms)
        prompt = prompt_maker(engine.tokenizer, seed=0)
        if kind == "ngram":  # a copy task: the text the outputs follow is in the prompt, to be looked up
            prompt = _with_text(prompt, device.text_ids)
        for rows in row_counts:
            for mode in modes_asked:
                case = run_case(engine, device, kind, rows, args.steps, mode, prompt, seed=rows)
                cases.append(case)
                if args.json:
                    print(json.dumps(asdict(case) | {"wall_over_max": round(case.ratio, 3)}), flush=True)
        engine.shutdown()
    if not args.json:
        print_table(cases, model_dir)
    return 0


def build_engine(model_dir: str, kind: str, max_rows: int, device_ms: float) -> tuple[Any, SimulatedDevice]:
    """An engine as a GPU worker runs it (not batch invariant, async capable), its device simulated."""
    from bulkinfer.engine import EngineConfig, LLMEngine

    # Speculation at every batch size: the gate's cost curve measures this CPU's forward, not the
    # stand-in's (whose step costs D ms whatever it verifies).
    speculative = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": max_rows} \
        if kind == "ngram" else None
    engine = LLMEngine(EngineConfig(
        model=model_dir, dtype="float32", max_num_seqs=max_rows, max_model_len=2048,
        num_kv_blocks=max_rows * 24 + 64, kv_populate_seconds=0, batch_invariant=False,
        async_scheduling=True, speculative_config=speculative,
    ))
    text_ids = engine.tokenizer.encode(TEXT)
    device = SimulatedDevice(engine.runner, device_ms, text_ids)
    engine.device = device
    return engine, device


def prompt_maker(tokenizer: Any, seed: int) -> Callable[[], list[int]]:
    """Prompts as a batch job's: one of 4 shared ~200-token instructions, then a ~20-token row."""
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    ordinary = [t for t in range(len(tokenizer)) if t not in special]
    instructions = [[rng.choice(ordinary) for _ in range(200)] for _ in range(4)]
    return lambda: instructions[rng.randrange(4)] + [rng.choice(ordinary) for _ in range(rng.randint(10, 30))]


def _with_text(prompt: Callable[[], list[int]], text_ids: list[int]) -> Callable[[], list[int]]:
    return lambda: prompt() + text_ids


def print_table(cases: list[Case], model_dir: str) -> None:
    print(f"bench host: tokenizer and shapes of {model_dir}; simulated device; "
          "host ms = the engine thread's CPU time")
    print("| kind | rows | device ms (measured) | loop | host ms / step | exposed ms / step "
          "| of which bitmask wait | wall ms / step | wall / max(device, host) | tokens / step |")
    print("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for c in cases:
        print(f"| {c.kind} | {c.rows} | {c.device_ms:g} ({c.busy_ms:.2f}) | {c.mode} | {c.host_ms:.2f} "
              f"| {c.exposed_ms:.2f} | {c.bitmask_wait_ms:.2f} | {c.wall_ms:.2f} | {c.ratio:.2f} "
              f"| {c.tokens_per_step:.1f} |")
