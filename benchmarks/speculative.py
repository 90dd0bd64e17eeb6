"""`bulkinfer bench spec`: speculative decoding on and off, the same rows, one run.

Tasks (the real SmolLM2 chat model by default, greedy, its own EOS):
- copy-heavy: "fix the typos in this paragraph" — the answer copies most of the prompt, so prompt
  lookup (n-gram) drafts are often right;
- extract: "extract the sentences that contain the word X" — the answer quotes some of the prompt;
- free text: "write a short story about ..." — little to copy.

For each task, at 1, 4, 16 and 64 requests running at once (``--rounds`` x N rows per level in two
halves, each side going first in one; N kept running: a row starts as soon as another finishes,
until the last ones drain), the output tok/s
without speculation and with each method, their ratio, and the acceptance. ``--drain-sets`` measures
as before 2026-12-03 instead: sets of N rows submitted together, each set run until its longest row
finishes (so a set's slowest row runs alone at the end, the tail that the mixed-length job measures
on its own). Then a whole job
whose rows have very different output lengths (paragraphs of 1-10 sentences): its wall time off
and on — the tail of a job is where speculation pays. Speculation is adaptive (the engine's
measured cost curve decides when it runs), as a deployment runs it. With ``--draft-layers N`` a
layer-skip draft (the model's first N layers) is measured as well.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

SENTENCES = [
    "The quarterly report shows that revenue grew by twelve percent in the northern region.",
    "Our support team answered most tickets within two hours during the holiday season.",
    "The new printer on the third floor keeps jamming when people print double-sided pages.",
    "Please remember to lock the side door when you leave the building after six.",
    "The river near the old mill floods every spring after the snow melts in the hills.",
    "Customers asked for a simpler checkout page with fewer steps and clearer prices.",
    "The library will extend its opening hours on weekends starting next month.",
    "Our cat sleeps on the warm windowsill every afternoon while the sun is out.",
    "The engineering team moved the nightly backups to a cheaper storage tier.",
    "A local bakery donated fresh bread to the shelter every Friday this winter.",
    "The train to the airport leaves every twenty minutes from the central station.",
    "Several volunteers cleaned the beach and collected four bags of plastic waste.",
]
STORY_TOPICS = ["a lighthouse keeper", "a lost umbrella", "a robot learning to cook", "a quiet village",
                "a dragon afraid of heights", "a detective cat", "the last bus home", "a garden on Mars"]
LEVELS = (1, 4, 16, 64)


def with_typos(text: str, rng: random.Random, rate: float = 0.15) -> str:
    """Swap two inner letters of about `rate` of the longer words."""
    words = text.split(" ")
    for i, word in enumerate(words):
        if len(word) > 4 and rng.random() < rate:
            j = rng.randrange(1, len(word) - 2)
            words[i] = word[:j] + word[j + 1] + word[j] + word[j + 2:]
    return " ".join(words)


def copy_messages(rng: random.Random, num_sentences: int) -> list[dict[str, str]]:
    paragraph = " ".join(rng.sample(SENTENCES, num_sentences))
    return [{"role": "user", "content": "Fix the typos in this paragraph. Reply with the corrected paragraph "
                                        f"only.\n\n{with_typos(paragraph, rng)}"}]


def extract_messages(rng: random.Random, num_sentences: int) -> list[dict[str, str]]:
    """The paragraph's sentences, some naming a topic word; the answer quotes those sentences."""
    chosen = rng.sample(SENTENCES, num_sentences + 2)
    word = rng.choice(["the", "every", "and"])
    return [{"role": "user", "content": f"Extract the sentences that contain the word \"{word}\" from this "
                                        f"text, one per line, word for word.\n\n{' '.join(chosen)}"}]


def story_messages(rng: random.Random, _: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Write a short story about {rng.choice(STORY_TOPICS)}."}]


TASKS: dict[str, Callable[[random.Random, int], list[dict[str, str]]]] = {
    "copy-heavy": copy_messages, "extract": extract_messages, "free-text": story_messages}


@dataclass
class Run:
    label: str
    wall_s: float
    output_tokens: int
    speculation: dict[str, Any] | None
    token_ids: list[list[int]] = field(repr=False, default_factory=list)

    @property
    def output_tps(self) -> float:
        return self.output_tokens / max(self.wall_s, 1e-9)


def prompts_for(tokenizer: Any, task: str, count: int, seed: int, sentences: Callable[[random.Random], int]
                ) -> list[list[int]]:
    rng = random.Random(seed)
    return [list(tokenizer.apply_chat_template(TASKS[task](rng, sentences(rng)), add_generation_prompt=True,
                                               tokenize=True, return_dict=False))
            for _ in range(count)]


def generate_keeping(llm: Any, prompts: list[list[int]], params: Any, running: int) -> list[list[int]]:
    """Every prompt's output token ids, with `running` requests in the engine at a time: the next
    prompt goes in as soon as a request finishes."""
    engine, waiting = llm.engine, list(enumerate(prompts))
    index_of: dict[str, int] = {}
    outputs: dict[int, list[int]] = {}

    def submit() -> None:
        index, prompt = waiting.pop(0)
        request_id = f"bench-spec-{id(index_of)}-{index}"
        index_of[request_id] = index
        engine.add_request(request_id, prompt, params)

    for _ in range(min(running, len(waiting))):
        submit()
    while len(outputs) < len(prompts) and engine.has_unfinished_requests():
        for output in engine.step():
            outputs[index_of[output.request_id]] = list(output.outputs[0].token_ids)
            if waiting:
                submit()
    return [outputs[i] for i in range(len(prompts))]


def measure(engines: dict[str, Any], prompt_sets: list[list[list[int]]], params: Any,
            running: int | None = None) -> list[Run]:
    """Each set of prompts to every engine, one set after another, the engines' order reversed every
    other set (so neither side always runs first); walls and tokens added. A set is submitted at
    once, or with `running` given, kept at `running` requests in flight."""
    before = {label: (llm.get_metrics().get("speculative_decoding") or {}).copy()
              for label, llm in engines.items()}
    walls = dict.fromkeys(engines, 0.0)
    token_ids: dict[str, list[list[int]]] = {label: [] for label in engines}
    for i, prompts in enumerate(prompt_sets):
        for label in list(engines) if i % 2 == 0 else reversed(list(engines)):
            started = time.perf_counter()
            if running is None:
                outputs = [list(o.outputs[0].token_ids) for o in engines[label].generate(prompts, params)]
            else:
                outputs = generate_keeping(engines[label], prompts, params, running)
            walls[label] += time.perf_counter() - started
            token_ids[label] += outputs
    return [Run(label, walls[label], sum(len(t) for t in token_ids[label]),
                _delta(before[label], llm.get_metrics().get("speculative_decoding")), token_ids[label])
            for label, llm in engines.items()]


def _delta(before: dict[str, Any], after: dict[str, Any] | None) -> dict[str, Any] | None:
    """This run's speculation figures (the engine's counters minus those before it)."""
    if after is None:
        return None
    drafted = after["num_draft_tokens"] - before.get("num_draft_tokens", 0)
    accepted = after["num_accepted_tokens"] - before.get("num_accepted_tokens", 0)
    verifications = after["num_verifications"] - before.get("num_verifications", 0)
    return {"draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_length": 1 + accepted / verifications if verifications else 0.0,
            "steps_on": after["steps_on"] - before.get("steps_on", 0),
            "steps_off": after["steps_off"] - before.get("steps_off", 0),
            "break_even_batch": after["break_even_batch"]}


def build_engines(model_dir: str, dtype: str, methods: dict[str, dict[str, Any] | None],
                  options: dict[str, Any]) -> dict[str, Any]:
    from bulkinfer.engine import LLM, SamplingParams

    engines = {}
    for label, speculative in methods.items():
        started = time.perf_counter()
        llm = LLM(model_dir, dtype=dtype, speculative_config=speculative, **options)
        llm.generate([[1, 2, 3, 4]] * 2, SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
        ready = time.perf_counter() - started
        print(f"  engine {label}: ready in {ready:.1f} s (dtype {llm.dtype_choice.dtype})")
        engines[label] = llm
    return engines


def ratio_line(runs: list[Run]) -> str:
    base = runs[0]
    parts = [f"off {base.output_tps:,.1f} tok/s"]
    for run in runs[1:]:
        spec = run.speculation or {}
        same = sum(a == b for a, b in zip(run.token_ids, base.token_ids, strict=True))
        on = spec.get("steps_on", 0)
        parts.append(f"{run.label} {run.output_tps:,.1f} tok/s = {run.output_tps / base.output_tps:.2f}x "
                     f"(accepted {spec.get('acceptance_rate', 0):.0%}, "
                     f"{spec.get('mean_accepted_length', 0):.2f} tok/verification, "
                     f"on {on}/{on + spec.get('steps_off', 0)} steps, "
                     f"identical rows {same}/{len(base.token_ids)})")
    return "; ".join(parts)


def bench_cli(argv: list[str] | None = None, resolve_model: Callable[[str], str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bulkinfer bench spec", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="a model folder, catalog name or .gguf file (default: the real SmolLM2)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--levels", default=",".join(map(str, LEVELS)), help="requests running at once")
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"comma list of: {', '.join(TASKS)}")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3,
                        help="prompt sets per task and level (one at a time; their figures added)")
    parser.add_argument("--drain-sets", action="store_true",
                        help="submit each level's rows in sets of N, each run until its last row finishes "
                             "(instead of keeping N running)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--draft-layers", type=int, default=0,
                        help="also measure a layer-skip draft of the model's first N layers (0: not)")
    parser.add_argument("--tail-rows", type=int, default=48, help="rows of the mixed-length job (0: skip it)")
    parser.add_argument("--json", type=Path, help="also write the figures here as JSON")
    args = parser.parse_args(argv)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if unknown := sorted(set(tasks) - set(TASKS)):
        parser.error(f"unknown tasks {unknown}; choose from {', '.join(TASKS)}")
    model_dir = resolve_model(args.model) if resolve_model else args.model
    from transformers import AutoTokenizer

    from bulkinfer.benchmarks.engine import describe_cpu
    from bulkinfer.engine import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    print(f"model: {model_dir}; torch threads: {torch.get_num_threads()}")
    describe_cpu()
    k = args.num_speculative_tokens
    methods: dict[str, dict[str, Any] | None] = {
        "off": None, "ngram": {"method": "ngram", "num_speculative_tokens": k}}
    if args.draft_layers:
        from bulkinfer.engine.speculative.layer_skip import write_layer_skip_draft

        draft = write_layer_skip_draft(model_dir, Path(tempfile.mkdtemp()) / "draft", args.draft_layers)
        methods[f"draft-{args.draft_layers}L"] = {"method": "draft_model", "model": str(draft),
                                                  "num_speculative_tokens": k}
    levels = [int(n) for n in args.levels.split(",") if n.strip()]
    options = {"max_num_seqs": max(max(levels), 64), "max_num_batched_tokens": 2048}
    engines = build_engines(model_dir, args.dtype, methods, options)
    for label, llm in engines.items():
        spec = llm.get_metrics().get("speculative_decoding")
        if spec and spec.get("cost_curve"):
            curve = spec["cost_curve"]
            ratios = ", ".join(f"{b}: {v / d:.2f}" for b, d, v in zip(curve["batches"], curve["decode_s"],
                                                                         curve["verify_s"], strict=True))
            print(f"  {label}: verify/decode step cost by running requests ({k} drafts each): {ratios}")
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    figures: dict[str, Any] = {"levels": {}, "tail": None}
    seed = 0
    for task in tasks:
        for level in levels:
            sets = []
            for _ in range(args.rounds):
                seed += 1
                sets.append(prompts_for(tokenizer, task, level, seed, lambda rng: rng.randint(3, 5)))
            if args.drain_sets:
                runs = measure(engines, sets, params)
            else:  # the same rows, N kept running, in two halves: each side goes first in one of them
                rows = [prompt for prompt_set in sets for prompt in prompt_set]
                half = len(rows) // 2
                runs = measure(engines, [rows[:half], rows[half:]], params, running=level)
            print(f"{task}, {level} running: {ratio_line(runs)}")
            figures["levels"][f"{task}/{level}"] = [_figures(run) for run in runs]
    if args.tail_rows:
        prompts = prompts_for(tokenizer, "copy-heavy", args.tail_rows, 99, lambda rng: rng.choice([1, 2, 10]))
        tail_params = SamplingParams(temperature=0.0, max_tokens=max(args.max_tokens, 320))
        runs = measure(engines, [prompts, prompts], tail_params)  # twice, each side first once
        base = runs[0]
        for run in runs[1:]:
            print(f"mixed-length job ({args.tail_rows} rows of 1-10 sentences, run twice): "
                  f"off {base.wall_s:.1f} s, "
                  f"{run.label} {run.wall_s:.1f} s = {base.wall_s / run.wall_s:.2f}x sooner "
                  f"(accepted {(run.speculation or {}).get('acceptance_rate', 0):.0%})")
        figures["tail"] = [_figures(run) for run in runs]
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
        print(f"figures: {args.json}")
    return 0


def _figures(run: Run) -> dict[str, Any]:
    data = asdict(run)
    data.pop("token_ids")
    return {**data, "output_tps": run.output_tps}


if __name__ == "__main__":
    raise SystemExit(bench_cli())
