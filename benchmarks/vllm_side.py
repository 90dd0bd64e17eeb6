"""The vLLM side of `bulkinfer bench suite --with-vllm VENV`: run by that virtualenv's Python.

A standalone script (it imports vLLM, never bulkinfer: the two live in different virtualenvs).
It reads ``{"model", "dtype"}`` from SETTINGS.json, loads one vLLM engine (prefix caching on, its
defaults otherwise) and writes ``{"load_s", "vllm_version"}`` to SCRATCH/ready.json. Then it serves
workloads one at a time, so the suite can run each workload through bulkinfer and then through vLLM
(the two compared minutes apart, not a whole suite apart): each line on stdin names a JSON file
``{"name", "prompts", "max_tokens"}``; it resets the prefix cache, warms up on two short prompts,
times one ``generate`` of every prompt at once (token ids in, greedy, EOS ignored, exactly
max_tokens out) and writes ``{"name", "wall_s", "output_tokens", "cached_tokens"}`` to that file's
name + ".result" (whole: written aside, then renamed). It exits when stdin closes.

    VENV/bin/python benchmarks/vllm_side.py SETTINGS.json SCRATCH
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def write_whole(path: str, figures: dict) -> None:
    with open(path + ".part", "w") as out:
        json.dump(figures, out)
    os.replace(path + ".part", path)


def run_workload(llm: Any, workload: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm.reset_prefix_cache()
    warm = [TokensPrompt(prompt_token_ids=p[-8:]) for p in workload["prompts"][:2]]
    llm.generate(warm, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    llm.reset_prefix_cache()
    prompts = [TokensPrompt(prompt_token_ids=p) for p in workload["prompts"]]
    lengths = workload["max_tokens"]  # one per prompt, or one for all
    if isinstance(lengths, int):
        lengths = [lengths] * len(prompts)
    params = [SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True) for n in lengths]
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - started
    print(f"vllm {workload['name']}: {wall:.2f} s", file=sys.stderr, flush=True)
    return {
        "name": workload["name"],
        "wall_s": wall,
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
        "cached_tokens": sum(o.num_cached_tokens or 0 for o in outputs),
    }


def main(settings_path: str, scratch: str) -> int:
    settings = json.loads(open(settings_path).read())
    import vllm
    from vllm import LLM

    started = time.perf_counter()
    llm = LLM(model=settings["model"], dtype=settings["dtype"], enable_prefix_caching=True, seed=0)
    write_whole(os.path.join(scratch, "ready.json"),
                {"load_s": time.perf_counter() - started, "vllm_version": vllm.__version__})
    for line in sys.stdin:
        path = line.strip()
        if path:
            write_whole(path + ".result", run_workload(llm, json.loads(open(path).read())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1], sys.argv[2]))
