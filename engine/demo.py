"""The offline demo: one shared instruction over many rows, through the engine, with its figures.

This is what `make demo` runs until the job pipeline (API → Celery → worker → object store) lands.
"""

from __future__ import annotations

import argparse
import time

from engine.checkpoints import cached_checkpoint

INSTRUCTION = (
    "You are a support-ticket triage assistant. Read the customer's message and answer with one "
    "category from: billing, outage, login, feature-request, other. Then give a one-line reason. "
    "Be brief and do not repeat the message. "
) * 4  # a long shared instruction, as batch users have: its KV blocks are computed once

TICKETS = [
    "I was charged twice for my subscription this month.",
    "The dashboard has been down since 9am, nothing loads.",
    "I can't log in after resetting my password.",
    "Could you add a dark mode to the mobile app?",
    "My invoice shows the wrong company address.",
    "Password reset emails never arrive.",
    "The API returns 503 for every request in eu-west.",
    "Please support exporting reports as CSV.",
]


def demo_cli(argv: list[str] | None = None) -> int:
    from engine import LLM, SamplingParams

    parser = argparse.ArgumentParser(prog="bulkinfer demo", description=__doc__)
    parser.add_argument("--rows", type=int, default=64, help="number of rows to process")
    parser.add_argument("--preset", default="small", choices=["tiny", "small"])
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)

    started = time.perf_counter()
    model_dir = cached_checkpoint(preset=args.preset, arch="llama", seed=0)
    print(f"model: {model_dir} (a locally built random-weight '{args.preset}' checkpoint: "
          "its text is noise, its figures are real)")
    llm = LLM(model=str(model_dir))
    print(f"engine ready in {time.perf_counter() - started:.1f}s")

    rows = [f"{TICKETS[i % len(TICKETS)]} (ticket #{i})" for i in range(args.rows)]
    prompts = [f"{INSTRUCTION}\nTicket: {row}\nAnswer:" for row in rows]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)

    run_started = time.perf_counter()
    outputs = llm.generate(prompts, params)
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
