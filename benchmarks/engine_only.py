"""The engine side of `bulkinfer bench service` (run by it as `python -m bulkinfer.benchmarks.engine_only`).

`rows`: writes the engine benchmark's shared-prefix workload as a JSONL job input, one
`{"id", "prompt"}` per request. `bulkinfer.benchmarks.engine.make_workload` picks the token ids, but only
among " word" tokens that encode back to themselves, so the text a user would upload gives exactly those
ids again (checked here) and the shared instructions stay one cacheable prefix.

`run`: the same rows through `engine.LLM.generate`, with the options and sampling a worker would
use (`BULKINFER_ENGINE_OPTIONS` over the worker's defaults; the job's sampling through
`bulkinfer.worker.hosts.engine_rows.engine_sampling`), after one short warm-up request, as the stack is
measured warm. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

WORD_TOKEN = re.compile(r" [a-z]{2,}")
WARM_UP_PROMPT = "warm up"  # shares no prefix with the workload, so it leaves the cache cold for it


def word_token_ids(tokenizer: Any) -> list[int]:
    """Token ids whose text is " word" and that encode back to that one id."""
    ids = []
    for token_id in range(len(tokenizer)):
        text = tokenizer.decode([token_id])
        if WORD_TOKEN.fullmatch(text) and tokenizer.encode(text, add_special_tokens=False) == [token_id]:
            ids.append(token_id)
    return ids


def write_rows(model_dir: str, path: Path, *, requests: int, shared_len: int, tail_len: int,
               max_tokens: int) -> dict[str, Any]:
    """Write the rows; returns their token counts (prompt ids as the engine will encode the text)."""
    from transformers import AutoTokenizer

    from bulkinfer.benchmarks.workloads import make_workload

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    words = word_token_ids(tokenizer)
    # Indices into `words`, picked with the engine benchmark's own logic and seed.
    workload = make_workload("shared-prefix", num_requests=requests, vocab_size=len(words), special_ids=set(),
                             shared_len=shared_len, tail_len=tail_len, num_shared=4, max_tokens=max_tokens)
    prompt_tokens = 0
    with path.open("w") as out:
        for index, picks in enumerate(workload.prompts):
            ids = [words[i] for i in picks]
            text = tokenizer.decode(ids)
            if tokenizer.encode(text) != ids:
                raise RuntimeError(f"row {index}: its text does not encode back to the workload's token ids")
            prompt_tokens += len(ids)
            out.write(json.dumps({"id": f"r{index:05d}", "prompt": text}) + "\n")
    return {"rows": requests, "prompt_tokens": prompt_tokens}


def run_engine_only(model_dir: str, rows_path: Path, sampling: dict[str, Any],
                    engine_options: dict[str, Any]) -> dict[str, Any]:
    import torch

    from bulkinfer.engine import LLM
    from bulkinfer.jobs.sampling import JobSampling
    from bulkinfer.worker.hosts.engine_rows import engine_sampling
    from bulkinfer.worker.hosts.model_hosts import engine_options as with_worker_defaults

    options = with_worker_defaults(engine_options)
    params = engine_sampling(JobSampling.model_validate(sampling))
    rows = [json.loads(line) for line in rows_path.read_text().splitlines() if line.strip()]
    llm = LLM(model=model_dir, **options)
    llm.generate([WARM_UP_PROMPT], params)
    load_before = os.getloadavg()[0]
    busy_before = llm.get_metrics()["busy_time_s"]
    started = time.perf_counter()
    outputs = llm.generate([row["prompt"] for row in rows], params)
    wall = time.perf_counter() - started
    busy = llm.get_metrics()["busy_time_s"] - busy_before
    load = (load_before, os.getloadavg()[0])  # the machine is shared: say how busy it was
    errors = [output.error for output in outputs if output.finish_reason == "error"]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")
    return {
        "rows": len(outputs), "wall_s": wall, "busy_s": busy, "engine_options": options,
        "torch_threads": torch.get_num_threads(), "load": load,
        "prompt_tokens": sum(output.num_prompt_tokens for output in outputs),
        "cached_tokens": sum(output.num_cached_tokens for output in outputs),
        "completion_tokens": sum(output.num_completion_tokens for output in outputs),
        "completion_tokens_per_row": sorted({output.num_completion_tokens for output in outputs}),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bulkinfer.benchmarks.engine_only", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["rows", "run"])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--rows", type=Path, required=True, help="the JSONL rows file (written by `rows`)")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--shared-len", type=int, default=400)
    parser.add_argument("--tail-len", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--sampling", default="{}", help="the job's sampling (JSON)")
    parser.add_argument("--engine-options", default="{}", help="the worker's BULKINFER_ENGINE_OPTIONS")
    args = parser.parse_args(argv)
    if args.command == "rows":
        report = write_rows(args.model_dir, args.rows, requests=args.requests, shared_len=args.shared_len,
                            tail_len=args.tail_len, max_tokens=args.max_tokens)
    else:
        report = run_engine_only(args.model_dir, args.rows, json.loads(args.sampling),
                                 json.loads(args.engine_options))
    sys.stdout.write(json.dumps(report) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
