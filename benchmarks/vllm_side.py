"""The vLLM side of `bulkinfer bench suite --with-vllm VENV`: run by that virtualenv's Python.

A standalone script (it imports vLLM, never bulkinfer: the two live in different virtualenvs).
It reads a JSON request ``{"model", "dtype", "workloads": [{"name", "prompts", "max_tokens"}]}``,
loads one vLLM engine (prefix caching on, its defaults otherwise), and for each workload resets the
prefix cache, warms up on two short prompts, then times one ``generate`` of every prompt at once
(token ids in, greedy, EOS ignored, exactly max_tokens out). It writes the figures as JSON:
``{"load_s", "vllm_version", "results": [{"name", "wall_s", "output_tokens", "cached_tokens"}]}``.

    VENV/bin/python benchmarks/vllm_side.py REQUEST.json RESULT.json
"""

from __future__ import annotations

import json
import sys
import time


def main(request_path: str, result_path: str) -> int:
    request = json.loads(open(request_path).read())
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    llm = LLM(model=request["model"], dtype=request["dtype"], enable_prefix_caching=True, seed=0)
    load_s = time.perf_counter() - started
    results = []
    for workload in request["workloads"]:
        llm.reset_prefix_cache()
        warm = [TokensPrompt(prompt_token_ids=p[-8:]) for p in workload["prompts"][:2]]
        llm.generate(warm, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
        llm.reset_prefix_cache()
        prompts = [TokensPrompt(prompt_token_ids=p) for p in workload["prompts"]]
        params = [SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)
                  for n in workload["max_tokens"]]
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - started
        results.append({
            "name": workload["name"],
            "wall_s": wall,
            "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
            "cached_tokens": sum(o.num_cached_tokens or 0 for o in outputs),
        })
        print(f"vllm {workload['name']}: {wall:.2f} s", file=sys.stderr, flush=True)
    with open(result_path, "w") as out:
        json.dump({"load_s": load_s, "vllm_version": vllm.__version__, "results": results}, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1], sys.argv[2]))
