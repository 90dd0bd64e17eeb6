"""`bulkinfer demo --offline`: the demo job's rows through the engine alone, in this process, with
the run's figures (no Redis, API or worker)."""

from __future__ import annotations

import argparse
import time

from bulkinfer.engine.dtype_choice import DTYPE_CHOICES
from bulkinfer.jobs.demo_data import (
    EXTRACTION_INSTRUCTIONS,
    EXTRACTION_SCHEMA,
    INSTRUCTION,
    TEMPLATE,
    order_rows,
    sample_rows,
)
from bulkinfer.jobs.formats.rows import with_instructions_prompt
from bulkinfer.jobs.model_presets import PRESET_NAMES
from bulkinfer.worker.models.model_files import local_model_dir


def demo_cli(argv: list[str] | None = None) -> int:
    from bulkinfer.engine import LLM, SamplingParams

    parser = argparse.ArgumentParser(prog="bulkinfer demo", description=__doc__)
    parser.add_argument("--rows", type=int, default=64, help="number of rows to process")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", default=None,
                        help="a real model (catalog name, folder or .gguf): the extraction job's rows")
    source.add_argument("--preset", default=None, choices=PRESET_NAMES,
                        help="a random-weight checkpoint: the support-ticket rows")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                        help="compute dtype (auto: bf16 where the CPU has native bf16 matmul, else fp32)")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    name = args.preset or args.model or "small"
    preset = name in PRESET_NAMES  # the support-ticket rows; a real model: the extraction job's
    model_dir = local_model_dir(name)
    if preset:
        print(f"model: {model_dir} (a locally built random-weight '{name}' checkpoint: "
              "its text is noise, its figures are real)")
    else:
        print(f"model: {name} ({model_dir})")
    llm = LLM(model=str(model_dir), dtype=args.dtype)
    print(f"engine ready in {time.perf_counter() - started:.1f}s; dtype {llm.dtype_choice.dtype} "
          f"({llm.dtype_choice.reason})")

    run_started = time.perf_counter()
    if preset:
        # The same prompts the demo job builds: the shared instructions, then the filled-in template.
        rows = [row["ticket"] for row in sample_rows(args.rows)]
        prompts = [with_instructions_prompt(INSTRUCTION, TEMPLATE.format(ticket=row)) for row in rows]
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        outputs = llm.generate(prompts, params)
    else:
        # The extraction job's requests: instructions as the system message, the order as the user's.
        rows = [row["order"] for row in order_rows(args.rows)]
        conversations = [[{"role": "system", "content": EXTRACTION_INSTRUCTIONS},
                          {"role": "user", "content": row}] for row in rows]
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, json_schema=EXTRACTION_SCHEMA)
        outputs = llm.chat(conversations, params)
    wall = time.perf_counter() - run_started

    for row, output in list(zip(rows, outputs, strict=True))[:3]:
        print(f"\n- row: {row}\n  output ({output.finish_reason}): {output.text[:120]!r}")

    prompt_tokens = sum(o.num_prompt_tokens for o in outputs)
    cached_tokens = sum(o.num_cached_tokens for o in outputs)
    completion_tokens = sum(o.num_completion_tokens for o in outputs)
    errors = [o for o in outputs if o.finish_reason == "error"]
    print(f"\nrows: {len(outputs)} ({len(errors)} errors) in {wall:.2f}s")
    print(f"tokens: prompt {prompt_tokens}, served from prefix cache {cached_tokens} "
          f"({cached_tokens / max(prompt_tokens, 1):.0%}), completion {completion_tokens}")
    print(f"throughput: {completion_tokens / wall:.1f} output tok/s, "
          f"{(prompt_tokens + completion_tokens) / wall:.1f} total tok/s")
    return 0 if not errors else 1


if __name__ == "__main__":
    raise SystemExit(demo_cli())
